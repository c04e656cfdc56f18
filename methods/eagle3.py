"""EAGLE-3 chain drafting (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration
of Large Language Models via Training-Time Test").

The head (``models.heads.EagleHead``, kind "eagle3") fuses three target hidden states
(low, middle, high layers) and may draft over a reduced vocabulary mapped back to
target ids.
"""

from __future__ import annotations

import dataclasses

from methods.learned import LearnedHeadMethod

__all__ = ["Eagle3"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Eagle3(LearnedHeadMethod):
  """EAGLE-3 head, chain of ``k`` tokens (see ``LearnedHeadMethod`` for the fields)."""

  name = "eagle3"
  kind = "eagle3"
