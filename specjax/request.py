"""Requests, their host-side state, and the token-by-token stop rules."""

from __future__ import annotations

import dataclasses
import enum
import zlib
from collections.abc import Callable

import numpy as np

from specjax.config import SamplingParams

__all__ = ["FinishReason", "Request", "RequestState", "RequestOutput"]


class FinishReason(enum.Enum):
  STOP = "stop"  # EOS, stop token id or stop string
  LENGTH = "length"  # max_tokens or max_model_len


@dataclasses.dataclass(frozen=True)
class Request:
  """A generation request.

  Attributes:
    request_id: unique id (any hashable; str or int).
    prompt_token_ids: the prompt (>= 1 token).
    sampling: ``SamplingParams``.
    arrival_time: seconds after the run starts (online mode); 0 = at once.
    replay_acc_len: measurement only, for an engine with
      ``EngineConfig.acceptance_replay``: a recorded per-position acceptance trace
      (``harness.traces``: ``replay_acc_len[i]`` >= 1 tokens committed by a step
      starting at output position i, one entry per output token up to ``max_tokens``);
      the step at output position i accepts ``min(replay_acc_len[i] - 1, L)`` of its L
      drafts instead of verifying them (not lossless). None otherwise.
    replay_sources: measurement only: further recorded traces of the same request, one
      per replay source 1, 2, ... (source 0 is ``replay_acc_len``; an engine with
      ``EngineConfig.replay_sources`` = 1 + their number). A method that says which
      drafter drafted each row (``Draft.replay_source``, e.g. ``methods.adaptive``: member
      j's rows replay source j) gets that drafter's acceptance; other rows replay source
      0. Each trace obeys ``replay_acc_len``'s rules.
  """

  request_id: object
  prompt_token_ids: tuple[int, ...]
  sampling: SamplingParams = SamplingParams()
  arrival_time: float = 0.0
  replay_acc_len: tuple[int, ...] | None = None
  replay_sources: tuple[tuple[int, ...], ...] = ()


@dataclasses.dataclass
class RequestOutput:
  """Result of one request. Times in seconds (TTFT/TPOT/latency from its arrival)."""

  request_id: object
  prompt_token_ids: list[int]
  output_token_ids: list[int]
  text: str | None
  finish_reason: str
  ttft_s: float
  tpot_s: float
  latency_s: float
  queue_s: float
  num_steps: int
  num_draft_tokens: int
  num_accepted_tokens: int
  num_preemptions: int
  arrival_s: float = 0.0  # seconds after the run started (0 offline)


def _synced(buffer: np.ndarray | None, done: int, items: list[int],
            minimum: int) -> tuple[np.ndarray, int]:
  """``(buffer, len(items))`` with ``buffer[:len(items)] == items``, copying only
  ``items[done:]`` (the ids appended since the last call; ``done`` > ``len(items)``, a
  list cut behind the buffer's back, copies them all). Grows ``buffer`` (``i32``, at
  least ``minimum``) by doubling."""
  n = len(items)
  if done > n:
    done = 0
  if buffer is None or buffer.shape[0] < n:
    grown = np.empty(max(minimum, 2 * n), np.int32)
    if done:
      grown[:done] = buffer[:done]
    buffer = grown
  if done < n:
    buffer[done:n] = items[done:]
  return buffer, n


@dataclasses.dataclass
class RequestState:
  """Mutable host state of a request inside the engine."""

  request: Request
  key: np.ndarray  # u32[2]
  tokens: list[int]  # prompt + output; the last token is pending (KV not written)
  pages: list[int] = dataclasses.field(default_factory=list)
  num_computed: int = 0  # KV positions written and valid
  finish_reason: FinishReason | None = None
  admitted_at: float | None = None
  first_token_at: float | None = None
  finished_at: float | None = None
  num_steps: int = 0
  num_draft_tokens: int = 0
  num_accepted_tokens: int = 0
  num_preemptions: int = 0
  text_len_checked: int = 0
  slot: int | None = None  # decode slot in the device SlotState (None: not decode-ready)
  inflight_tokens: int = 0  # most tokens the steps in flight may still add
  _buffer: np.ndarray | None = dataclasses.field(default=None, repr=False)
  _buffered: int = 0
  _page_buffer: np.ndarray | None = dataclasses.field(default=None, repr=False)
  _pages_buffered: int = 0

  def token_array(self) -> np.ndarray:
    """``i32[len(tokens)]`` view of ``tokens`` kept in a growing numpy buffer: each call
    copies only the tokens appended since the last one (host drafters read this every
    step; converting the whole list each time costs O(length) per row per step)."""
    self._buffer, self._buffered = _synced(self._buffer, self._buffered, self.tokens, 64)
    return self._buffer[: self._buffered]

  def add_pages(self, pages: list[int]) -> None:
    """Appends KV page ids to ``pages`` (the scheduler's allocations)."""
    self.pages.extend(pages)

  def drop_pages(self, keep: int = 0) -> list[int]:
    """Cuts ``pages`` to its first ``keep`` ids; returns the ids cut (to free). Every
    mutation of ``pages`` other than an append goes through here, so ``page_array``
    knows which of its copied ids are still valid."""
    dropped = self.pages[keep:]
    del self.pages[keep:]
    self._pages_buffered = min(self._pages_buffered, keep)
    return dropped

  def page_array(self) -> np.ndarray:
    """``i32[len(pages)]`` view of ``pages`` kept in a growing numpy buffer: each call
    copies only the ids appended since the last one (the engine packs every row's page
    table each step; converting the lists costs O(batch x context) Python work per step:
    ``benchmarks.step_packing`` on a 2-core CPU, 128 rows x 128 pages, 269 us from the
    lists against 67 us from these arrays, which stay flat in the context).
    Valid while ``pages`` changes only by appends and ``drop_pages``."""
    self._page_buffer, self._pages_buffered = _synced(self._page_buffer, self._pages_buffered,
                                                      self.pages, 16)
    return self._page_buffer[: self._pages_buffered]

  @property
  def num_prompt(self) -> int:
    return len(self.request.prompt_token_ids)

  @property
  def num_output(self) -> int:
    return len(self.tokens) - self.num_prompt

  @property
  def output_ids(self) -> list[int]:
    return self.tokens[self.num_prompt:]

  def append(
      self,
      token: int,
      *,
      eos_ids: frozenset[int],
      max_model_len: int,
      decode: Callable[[list[int]], str] | None,
  ) -> bool:
    """Commits one token and applies the stop rules in AR order; True if finished.

    Order matches plain decoding: the token is emitted, then EOS/stop ids, stop
    strings, max_tokens and max_model_len are checked.
    """
    sp = self.request.sampling
    self.tokens.append(int(token))
    if (not sp.ignore_eos and token in eos_ids) or token in sp.stop_token_ids:
      self.finish_reason = FinishReason.STOP
    elif sp.stop and decode is not None and _has_stop_string(decode(self.output_ids), sp.stop):
      self.finish_reason = FinishReason.STOP
    elif self.num_output >= sp.max_tokens or len(self.tokens) >= max_model_len:
      self.finish_reason = FinishReason.LENGTH
    return self.finish_reason is not None


def _has_stop_string(text: str, stops: tuple[str, ...]) -> bool:
  return any(s in text for s in stops)


def truncate_at_stop(text: str, stops: tuple[str, ...]) -> str:
  """Output text up to (excluding) the first stop string, as vLLM returns it."""
  cut = min((text.find(s) for s in stops if s in text), default=-1)
  return text if cut < 0 else text[:cut]


def default_key_seed(engine_seed: int, request_id: object) -> int:
  """Deterministic seed for an unseeded request (stable across runs and batches)."""
  return (engine_seed * 1_000_003 + zlib.crc32(repr(request_id).encode())) % (2**31)
