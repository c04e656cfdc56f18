"""N-gram prompt lookup (Saxena 2023, "Prompt Lookup Decoding"; vLLM's ngram proposer).

For n from ``n_max`` down to ``n_min``: find the most recent earlier occurrence of the
request's last n tokens in its own prompt + output, and propose the (up to) k tokens
that followed it. By default it runs on the device inside the engine step
(``methods.ngram_device``, over the device token history: asynchronous iterations, no
host work per step); ``device=False`` runs the numpy version on the host, which is also
the test oracle of the device one (same drafts).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from methods.ngram_device import ngram_lookup_device
from specjax.method import Capabilities, DeviceDraft, Draft, Method

__all__ = ["NGram", "ngram_lookup"]


def ngram_lookup(tokens: np.ndarray, n_min: int, n_max: int, k: int) -> np.ndarray:
  """Draft for one sequence: ``i32[<= k]`` (empty if no n-gram matches).

  Example: tokens ``[5, 6, 7, 9, 5, 6]`` with n = 2 matches ``[5, 6]`` at index 0 and
  proposes ``[7, 9, 5]`` for k = 3.
  """
  length = len(tokens)
  for n in range(min(n_max, length - 1), n_min - 1, -1):
    suffix = tokens[length - n:]
    # windows[i] = tokens[i:i+n] for start i in [0, length - n - 1] (excluding the suffix).
    windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
    hits = np.flatnonzero(np.all(windows == suffix, axis=1))
    if hits.size:
      start = hits[-1] + n
      return tokens[start: start + k]
  return tokens[:0]


@dataclasses.dataclass(frozen=True, kw_only=True)
class NGram(Method):
  """Prompt-lookup drafting with ``k`` tokens, n-gram sizes ``n_min..n_max``; on the
  device (fused into the engine step) unless ``device=False``."""

  name = "ngram"
  k: int = 4
  n_min: int = 2
  n_max: int = 4
  device: bool = True

  def __post_init__(self):
    if self.k < 1:
      raise ValueError(f"num_speculative_tokens k={self.k} must be >= 1")
    if not 1 <= self.n_min <= self.n_max:
      raise ValueError(f"n_min={self.n_min}, n_max={self.n_max} must satisfy 1 <= n_min <= n_max")
    if not isinstance(self.device, bool):
      raise ValueError(f"device={self.device!r} must be True (fused, on the device) or False "
                       "(host)")

  @property
  def num_speculative_tokens(self) -> int:
    return self.k

  def capabilities(self) -> Capabilities:
    return Capabilities(runs_on="fused" if self.device else "host")

  def propose_device(self, params, state, rows, *, all_greedy):
    tokens, num = ngram_lookup_device(rows.tokens, rows.num_tokens, rows.budgets, k=self.k,
                                      n_min=self.n_min, n_max=self.n_max)
    return state, DeviceDraft(tokens, num)

  def propose(self, state, context):
    rows = len(context.request_ids)
    tokens = np.full((rows, self.k), -1, np.int32)
    num = np.zeros(rows, np.int32)
    for i, seq in enumerate(context.token_ids):
      budget = int(context.budgets[i])
      if budget <= 0:
        continue
      d = ngram_lookup(np.asarray(seq), self.n_min, self.n_max, min(self.k, budget))
      tokens[i, : len(d)] = d
      num[i] = len(d)
    return state, Draft(tokens, num)
