"""EAGLE-1 chain and tree drafting (Li et al. 2024, "EAGLE: Speculative Sampling Requires
Rethinking Feature Uncertainty").

The head (``models.heads.EagleHead``, kind "eagle") reads the target's final hidden
state and drafts k tokens by feeding its predicted features back.
"""

from __future__ import annotations

import dataclasses

from methods.learned import LearnedHeadMethod
from models.head_trees import eagle2_capacity

__all__ = ["Eagle"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Eagle(LearnedHeadMethod):
  """EAGLE-1 head: a chain of ``k`` tokens, or with ``tree_nodes > 0`` an EAGLE-2 dynamic
  tree (Li et al. 2024, "EAGLE-2: Faster Inference of Language Models with Dynamic Draft
  Trees") of that many nodes and depth <= k (see ``LearnedHeadMethod`` for the fields)."""

  name = "eagle"
  kind = "eagle"

  def max_tree_nodes(self) -> int:
    return eagle2_capacity(self.k, self.tree_branching)
