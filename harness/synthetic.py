"""Drafters for runs whose acceptance is not the target's: a zero-cost drafter for
synthetic acceptance (``EngineConfig.synthetic_acceptance``) and replay, and n-gram
prompt lookup over a recorded request's real tokens (replay on random weights).

They live here, not in ``benchmarks.engine_loop``, so tests and other binaries can use
them without importing that binary's absl flags.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from methods.ngram import ngram_lookup
from specjax.method import Capabilities, DeviceDraft, Draft, Method

__all__ = ["ConstantDrafter", "RecordedNGram"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConstantDrafter(Method):
  """Drafts ``k`` copies of each row's pending token (no compute): with synthetic
  acceptance it makes every step a full-width verify step. ``device=True`` (default)
  drafts inside the engine step (a fused proposer: asynchronous iterations); False on
  the host (one synchronous step each)."""

  name = "constant"
  k: int = 1
  device: bool = True

  def __post_init__(self):
    if self.k < 1 or not isinstance(self.device, bool):
      raise ValueError(f"k={self.k}, device={self.device!r}: k must be >= 1 and device a bool")

  @property
  def num_speculative_tokens(self) -> int:
    return self.k

  def capabilities(self) -> Capabilities:
    return Capabilities(runs_on="fused" if self.device else "host")

  def propose_device(self, params, state, rows, *, all_greedy):
    pending = jnp.take_along_axis(rows.tokens, jnp.maximum(rows.num_tokens - 1, 0)[:, None], 1)
    tokens = jnp.broadcast_to(pending, (pending.shape[0], self.k))
    return state, DeviceDraft(tokens, jnp.minimum(rows.budgets, self.k))

  def propose(self, state, context):
    rows = len(context.request_ids)
    tokens = np.full((rows, self.k), -1, np.int32)
    for i, seq in enumerate(context.token_ids):
      tokens[i] = seq[-1]
    return state, Draft(tokens, np.minimum(context.budgets, self.k).astype(np.int32))


@dataclasses.dataclass(frozen=True, kw_only=True)
class RecordedNGram(Method):
  """N-gram prompt lookup (``methods.ngram.ngram_lookup``, n = ``n_max`` down to
  ``n_min``) over a recorded request's real tokens instead of the engine's: a row at
  output position p drafts what the lookup proposes on ``contexts[request id][:P + p]``
  (P its prompt length), so on a random-weight target whose acceptance is replayed
  (``EngineConfig.acceptance_replay``) the draft *lengths* are the real ones (0 where
  the real context has no match), and a drafter choice that reads them (``methods.
  adaptive``) sees what it would see on the real model. The draft token values are
  the record's and mean nothing to the random target (replay decides acceptance).
  Host path (one synchronous step each), as the host n-gram.

  Attributes:
    k: the most draft tokens per row.
    contexts: request id -> ``i32[n]`` the record's prompt + generated ids (the row's
      engine tokens must not be longer). Not part of the method's identity (equality,
      hash).
    n_min, n_max: n-gram sizes tried, longest first.

  Raises (``propose``):
    KeyError: a row whose request id has no context.
    ValueError: a row longer than its context.
  """

  name = "recorded_ngram"
  k: int = 4
  contexts: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)
  n_min: int = 2
  n_max: int = 4

  def __post_init__(self):
    if self.k < 1 or not 1 <= self.n_min <= self.n_max:
      raise ValueError(f"k={self.k}, n_min={self.n_min}, n_max={self.n_max}: k must be >= 1 "
                       "and 1 <= n_min <= n_max")

  @property
  def num_speculative_tokens(self) -> int:
    return self.k

  def capabilities(self) -> Capabilities:
    return Capabilities(runs_on="host")

  def describe(self) -> dict:
    return {"method": self.name, "k": self.k, "n_min": self.n_min, "n_max": self.n_max,
            "contexts": len(self.contexts)}

  def propose(self, state, context):
    rows = len(context.request_ids)
    tokens = np.full((rows, self.k), -1, np.int32)
    num = np.zeros(rows, np.int32)
    for i, (rid, seq) in enumerate(zip(context.request_ids, context.token_ids)):
      budget = min(self.k, int(context.budgets[i]))
      if budget <= 0:
        continue
      if rid not in self.contexts:
        raise KeyError(f"request {rid!r} has no recorded context ({len(self.contexts)} known)")
      real = self.contexts[rid]
      if len(seq) > len(real):
        raise ValueError(f"request {rid!r} holds {len(seq)} tokens, its recorded context "
                         f"only {len(real)}")
      n = len(ngram_lookup(real[:len(seq)], self.n_min, self.n_max, budget))
      tokens[i, :n] = seq[-1]
      num[i] = n
    return state, Draft(tokens, num)
