"""Medusa drafting (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration
Framework with Multiple Decoding Heads").

Head j (``models.heads.MedusaHead``) proposes tokens j + 1 places ahead of the target's
own next token. The chain is the heads' top-1 tokens; with ``tree_nodes > 0`` the draft
is the cartesian product of the heads' top-``tree_branching`` tokens pruned to the
``tree_nodes`` most likely prefixes (``models.head_trees.medusa_tree``).
"""

from __future__ import annotations

import dataclasses

from methods.learned import LearnedHeadMethod
from models.head_trees import medusa_capacity

__all__ = ["Medusa"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Medusa(LearnedHeadMethod):
  """Medusa heads: a chain of ``k`` <= num_modules tokens, or a candidate tree of
  ``tree_nodes`` nodes and depth <= k (see ``LearnedHeadMethod``)."""

  name = "medusa"
  kind = "medusa"

  def max_tree_nodes(self) -> int:
    return medusa_capacity(self.k, self.tree_branching, self.tree_nodes)
