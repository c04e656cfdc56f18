"""A zero-cost drafter for synthetic-acceptance runs (``EngineConfig.synthetic_acceptance``).

It lives here, not in ``benchmarks.engine_loop``, so tests and other binaries can use it
without importing that binary's absl flags.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from specjax.method import Capabilities, DeviceDraft, Draft, Method

__all__ = ["ConstantDrafter"]


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
