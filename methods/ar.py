"""Plain autoregressive decoding: the baseline (no drafts)."""

from __future__ import annotations

import dataclasses

from specjax.method import Method, empty_draft

__all__ = ["AutoRegressive"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class AutoRegressive(Method):
  """One target token per step; the matched baseline for c."""

  name = "ar"

  @property
  def num_speculative_tokens(self) -> int:
    return 0

  def propose(self, state, context):
    return state, empty_draft(len(context.request_ids), 0)
