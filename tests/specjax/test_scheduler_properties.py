"""Page accounting of ``Scheduler`` and ``PageAllocator`` under random workloads (hypothesis).

The scheduler is driven directly, without a model: random arrivals, prompt lengths,
``max_tokens``, draft budgets, accepted-token counts, trims and explicit preemptions. After
every operation no page belongs to two live requests, waiting requests hold no pages,
each request's ``page_array`` equals its ``pages``,
the allocator's count equals the pages held, each running request's pages cover its
step's writes; at the end every request finished and every page is free again.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specjax.config import EngineConfig, SamplingParams
from specjax.kv_cache import PageAllocator, pages_needed
from specjax.request import Request, RequestState
from specjax.scheduler import Scheduler


def _check(sched: Scheduler, config: EngineConfig):
  held = [p for s in sched.running for p in s.pages]
  assert len(held) == len(set(held)), "a page is held by two live requests"
  assert all(0 <= p < config.total_pages for p in held)
  assert all(not s.pages for s in sched.waiting), "a waiting request holds pages"
  alloc = sched.allocator
  assert alloc.num_used == len(held)
  assert alloc.num_used + alloc.num_free == config.total_pages
  assert len(sched.running) <= config.max_num_seqs
  assert all(len(s.pages) <= config.pages_per_seq for s in sched.running)
  for s in [*sched.running, *sched.waiting]:  # the engine packs page tables from these
    np.testing.assert_array_equal(s.page_array(), np.asarray(s.pages, np.int32))


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_scheduler_never_leaks_or_shares_pages(data):
  draw = data.draw
  page_size = draw(st.integers(1, 4), label="page_size")
  max_model_len = draw(st.integers(4, 24), label="max_model_len")
  max_num_seqs = draw(st.integers(1, 4), label="max_num_seqs")
  per_seq = pages_needed(max_model_len, page_size)
  num_pages = draw(st.integers(per_seq, per_seq * max_num_seqs + 2), label="num_pages")
  k = draw(st.integers(0, 3), label="k")
  config = EngineConfig(max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                        page_size=page_size, num_pages=num_pages)
  sched = Scheduler(config, reserve_tokens=k)
  num_requests = draw(st.integers(1, 8), label="num_requests")
  arrivals = sorted(draw(st.lists(st.integers(0, 6), min_size=num_requests,
                                  max_size=num_requests), label="arrivals"))
  states = []
  for i, arrival in enumerate(arrivals):
    prompt_len = draw(st.integers(1, max_model_len - 1))
    max_tokens = draw(st.integers(1, 2 * max_model_len))
    req = Request(i, (0,) * prompt_len, SamplingParams(max_tokens=max_tokens),
                  arrival_time=float(arrival))
    state = RequestState(req, np.zeros(2, np.uint32), list(req.prompt_token_ids))
    states.append(state)
    sched.add(state)

  now, steps = 0.0, 0
  while sched.has_work:
    steps += 1
    assert steps < 2000, "no progress"
    sched.admit(now)
    _check(sched, config)
    now += 1.0
    if not sched.running:
      continue
    if len(sched.running) > 1 and draw(st.booleans()):
      victim = sched.running[draw(st.integers(0, len(sched.running) - 1))]
      sched.preempt(victim)
      _check(sched, config)
    budgets = {
        s.request.request_id: max(0, min(k, max_model_len - len(s.tokens),
                                         s.request.sampling.max_tokens - s.num_output - 1))
        for s in sched.running
    }
    preempted = sched.reserve_step(budgets)
    _check(sched, config)
    assert sched.running, "a lone request always fits"
    assert all(not s.pages and s in sched.waiting for s in preempted)
    for s in sched.running:
      need = min(len(s.tokens) + budgets[s.request.request_id], max_model_len)
      assert len(s.pages) * page_size >= need  # this step's writes are covered
    for s in list(sched.running):
      budget = budgets[s.request.request_id]
      for _ in range(draw(st.integers(1, budget + 1))):
        if s.append(1, eos_ids=frozenset(), max_model_len=max_model_len, decode=None):
          break
      s.num_computed = len(s.tokens) - 1
      if s.finish_reason is not None:
        sched.finish(s)
        _check(sched, config)
      elif draw(st.booleans(), label="trim"):  # the engine returns pages reserved ahead
        sched.trim(s, len(s.tokens))
        _check(sched, config)
  assert all(s.finish_reason is not None for s in states)
  assert sched.allocator.num_used == 0
  assert sched.allocator.num_free == config.total_pages


@settings(max_examples=60, deadline=None)
@given(num_pages=st.integers(1, 12),
       ops=st.lists(st.tuples(st.booleans(), st.integers(0, 6)), max_size=40))
def test_page_allocator_matches_a_set_model(num_pages, ops):
  alloc = PageAllocator(num_pages)
  owned: list[list[int]] = []
  for is_alloc, n in ops:
    free_before = alloc.num_free
    if is_alloc:
      pages = alloc.allocate(n)
      if n > free_before:
        assert pages is None and alloc.num_free == free_before  # all or nothing
      else:
        assert len(pages) == len(set(pages)) == n
        assert not set(pages) & {p for o in owned for p in o}
        owned.append(pages)
    elif owned:
      pages = owned.pop(n % len(owned))
      alloc.free(pages)
      with pytest.raises(ValueError, match="not allocated"):
        alloc.free(pages[:1] or [num_pages])  # double free (or a foreign page)
    assert alloc.num_used == sum(len(o) for o in owned)
    assert alloc.num_used + alloc.num_free == num_pages
  for pages in owned:
    alloc.free(pages)
  assert alloc.num_used == 0


def test_page_allocator_rejects_bad_sizes():
  with pytest.raises(ValueError, match="num_pages=0"):
    PageAllocator(0)
  with pytest.raises(ValueError, match="n=-1"):
    PageAllocator(2).allocate(-1)
