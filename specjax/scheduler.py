"""Plain-Python scheduler: admission, page allocation, preemption by recompute.

Requests join at step boundaries (continuous batching) in arrival order, pages are
allocated to cover each step's writes and returned when a request finishes. When the
pool runs dry the most recently admitted request is preempted: its pages are freed
and it re-enters the front of the queue with its tokens kept, so it is recomputed
(prefilled again) later; positions and keys do not change, so neither do outputs.
"""

from __future__ import annotations

import collections

from specjax.config import EngineConfig
from specjax.kv_cache import PageAllocator, pages_needed
from specjax.request import RequestState

__all__ = ["Scheduler"]


class Scheduler:
  """Owns the queues and the page allocator."""

  def __init__(self, config: EngineConfig, reserve_tokens: int):
    """``reserve_tokens``: positions beyond the pending token one step may write (k)."""
    self.config = config
    self.allocator = PageAllocator(config.total_pages)
    self.reserve_tokens = reserve_tokens
    self.waiting: collections.deque[RequestState] = collections.deque()
    self.running: list[RequestState] = []
    self.num_preemptions = 0

  def add(self, state: RequestState) -> None:
    self.waiting.append(state)

  @property
  def has_work(self) -> bool:
    return bool(self.waiting or self.running)

  def _ensure_pages(self, state: RequestState, num_tokens: int) -> bool:
    """Makes ``state.pages`` cover positions ``0 .. num_tokens - 1``; False if the pool is dry."""
    need = pages_needed(min(num_tokens, self.config.max_model_len), self.config.page_size)
    extra = need - len(state.pages)
    if extra <= 0:
      return True
    pages = self.allocator.allocate(extra)
    if pages is None:
      return False
    state.add_pages(pages)
    return True

  def admit(self, now: float) -> list[RequestState]:
    """Moves arrived requests into the running set while seats and pages last."""
    admitted = []
    while self.waiting and len(self.running) < self.config.max_num_seqs:
      state = self.waiting[0]
      if state.request.arrival_time > now:
        break
      if not self._ensure_pages(state, len(state.tokens) + self.reserve_tokens):
        break
      self.waiting.popleft()
      state.num_computed = 0
      if state.admitted_at is None:
        state.admitted_at = now
      self.running.append(state)
      admitted.append(state)
    return admitted

  def next_arrival(self) -> float | None:
    return self.waiting[0].request.arrival_time if self.waiting else None

  def reserve_step(self, budgets: dict) -> list[RequestState]:
    """Allocates pages for this step's writes (pending token + budget drafts).

    Preempts the most recently admitted requests until every remaining running
    request fits. Returns the preempted requests.
    """
    preempted = []
    i = 0
    while i < len(self.running):
      state = self.running[i]
      if self._ensure_pages(state, len(state.tokens) + budgets.get(state.request.request_id, 0)):
        i += 1
        continue
      # A lone request always fits: EngineConfig checks num_pages >= pages_per_seq.
      assert len(self.running) > 1, "page pool smaller than one sequence"
      victim = self.running[-1]
      self.preempt(victim)
      preempted.append(victim)
    return preempted

  def pages_short(self, budgets: dict) -> bool:
    """True if ``reserve_step(budgets)`` would have to preempt (a dry run)."""
    extra = 0
    for state in self.running:
      n = min(len(state.tokens) + budgets.get(state.request.request_id, 0),
              self.config.max_model_len)
      extra += max(0, pages_needed(n, self.config.page_size) - len(state.pages))
    return extra > self.allocator.num_free

  def trim(self, state: RequestState, num_tokens: int) -> None:
    """Returns the pages of ``state`` past those covering ``num_tokens`` positions (pages
    reserved ahead for steps in flight that wrote less)."""
    keep = pages_needed(min(num_tokens, self.config.max_model_len), self.config.page_size)
    if len(state.pages) > keep:
      self.allocator.free(state.drop_pages(keep))

  def preempt(self, state: RequestState) -> None:
    self.running.remove(state)
    self.allocator.free(state.drop_pages())
    state.num_computed = 0
    state.num_preemptions += 1
    self.num_preemptions += 1
    self.waiting.appendleft(state)

  def finish(self, state: RequestState) -> None:
    self.running.remove(state)
    self.allocator.free(state.drop_pages())
