"""Medusa chain drafting (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration
Framework with Multiple Decoding Heads").

Head j (``models.heads.MedusaHead``) proposes the top-1 token j + 1 places ahead of the
target's own next token; the chain is the heads' top-1 tokens (no tree).
"""

from __future__ import annotations

import dataclasses

from methods.learned import LearnedHeadMethod

__all__ = ["Medusa"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Medusa(LearnedHeadMethod):
  """Medusa heads, chain of ``k`` <= num_modules tokens (see ``LearnedHeadMethod``)."""

  name = "medusa"
  kind = "medusa"
