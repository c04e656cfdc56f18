"""The EAGLE-3 reduced draft vocabulary: its non-trainable draft -> target id map."""

from __future__ import annotations

import numpy as np
from flax import nnx

__all__ = ["VocabMap", "validate_vocab_map"]


class VocabMap(nnx.Variable):
  """Non-trainable ``i32[V_draft]`` draft -> target token ids (EAGLE-3)."""


def validate_vocab_map(draft_to_target, draft_vocab_size: int, vocab_size: int) -> np.ndarray:
  """Checks an EAGLE-3 draft -> target id map and returns it as ``i32[V_draft]``.

  Raises:
    ValueError: missing (None), wrong shape, non-integer, out of ``[0, vocab_size)``
      or duplicated ids.
  """
  if draft_to_target is None:
    raise ValueError(f"draft_to_target must be given when {draft_vocab_size=} is set")
  m = np.asarray(draft_to_target)
  if m.shape != (draft_vocab_size,):
    raise ValueError(f"draft_to_target shape={m.shape} must be ({draft_vocab_size},)")
  if not np.issubdtype(m.dtype, np.integer):
    raise ValueError(f"draft_to_target dtype={m.dtype} must be an integer type")
  if m.size and (m.min() < 0 or m.max() >= vocab_size):
    raise ValueError(f"draft_to_target ids must be in [0, {vocab_size=})")
  if len(np.unique(m)) != m.size:
    raise ValueError("draft_to_target must not repeat a target id")
  return m.astype(np.int32)
