"""EAGLE-3 chain and tree drafting (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration
of Large Language Models via Training-Time Test").

The head (``models.heads.EagleHead``, kind "eagle3") fuses three target hidden states
(low, middle, high layers) and may draft over a reduced vocabulary mapped back to
target ids.
"""

from __future__ import annotations

import dataclasses

from methods.learned import LearnedHeadMethod
from models.head_trees import eagle2_capacity

__all__ = ["Eagle3"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Eagle3(LearnedHeadMethod):
  """EAGLE-3 head: a chain of ``k`` tokens, or with ``tree_nodes > 0`` an EAGLE-2 dynamic
  tree (Li et al. 2024, "EAGLE-2: Faster Inference of Language Models with Dynamic Draft
  Trees") of that many nodes and depth <= k (see ``LearnedHeadMethod`` for the fields)."""

  name = "eagle3"
  kind = "eagle3"

  def max_tree_nodes(self) -> int:
    return eagle2_capacity(self.k, self.tree_branching)
