"""A zero-cost drafter for synthetic-acceptance runs (``EngineConfig.synthetic_acceptance``).

It lives here, not in ``benchmarks.engine_loop``, so tests and other binaries can use it
without importing that binary's absl flags.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from specjax.method import Capabilities, Draft, Method

__all__ = ["ConstantDrafter"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConstantDrafter(Method):
  """Drafts ``k`` copies of each row's pending token on the host (no compute): with
  synthetic acceptance it makes every step a full-width verify step."""

  name = "constant"
  k: int = 1

  @property
  def num_speculative_tokens(self) -> int:
    return self.k

  def capabilities(self) -> Capabilities:
    return Capabilities(runs_on="host")

  def propose(self, state, context):
    rows = len(context.request_ids)
    tokens = np.full((rows, self.k), -1, np.int32)
    for i, seq in enumerate(context.token_ids):
      tokens[i] = seq[-1]
    return state, Draft(tokens, np.minimum(context.budgets, self.k).astype(np.int32))
