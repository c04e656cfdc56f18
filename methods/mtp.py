"""Multi-token prediction drafting (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report",
section 2.2).

The head (``models.heads.MTPHead``) has k sequential modules; module j drafts the j-th
token from module j-1's hidden state and the previous token.
"""

from __future__ import annotations

import dataclasses

from methods.learned import LearnedHeadMethod

__all__ = ["MTP"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class MTP(LearnedHeadMethod):
  """MTP modules, chain of ``k`` <= num_modules tokens (see ``LearnedHeadMethod``)."""

  name = "mtp"
  kind = "mtp"
