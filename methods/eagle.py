"""EAGLE-1 chain drafting (Li et al. 2024, "EAGLE: Speculative Sampling Requires
Rethinking Feature Uncertainty").

The head (``models.heads.EagleHead``, kind "eagle") reads the target's final hidden
state and drafts k tokens by feeding its predicted features back.
"""

from __future__ import annotations

import dataclasses

from methods.learned import LearnedHeadMethod

__all__ = ["Eagle"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Eagle(LearnedHeadMethod):
  """EAGLE-1 head, chain of ``k`` tokens (see ``LearnedHeadMethod`` for the fields)."""

  name = "eagle"
  kind = "eagle"
