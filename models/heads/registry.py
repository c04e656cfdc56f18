"""The registry of head kinds: the ONLY place a kind name (``HeadConfig.kind``) maps to a
head class. Everything else asks the class (``head_class(kind)``) or the head itself."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from models.heads.base import DraftHead
from models.heads.eagle import Eagle1Head, Eagle3Head
from models.heads.early_exit import EarlyExitHead
from models.heads.medusa import MedusaHead
from models.heads.mtp import MTPHead

if TYPE_CHECKING:
  from models.heads.config import HeadConfig

__all__ = ["HEAD_CLASSES", "HEAD_KINDS", "head_class", "make_head"]

HEAD_CLASSES: dict[str, type[DraftHead]] = {
    "eagle": Eagle1Head,
    "eagle3": Eagle3Head,
    "mtp": MTPHead,
    "medusa": MedusaHead,
    "early_exit": EarlyExitHead,
}
HEAD_KINDS: tuple[str, ...] = tuple(HEAD_CLASSES)  # the kind names, in registry order


def head_class(kind: str) -> type[DraftHead]:
  """The class of head ``kind``.

  Raises:
    ValueError: an unknown kind.
  """
  if kind not in HEAD_CLASSES:
    raise ValueError(f"{kind=} must be one of {HEAD_KINDS}")
  return HEAD_CLASSES[kind]


def make_head(cfg: HeadConfig, seed: int = 0, draft_to_target=None) -> DraftHead:
  """A randomly initialised head of ``cfg.kind`` (numpy init: nothing is compiled).

  Args:
    cfg: the head's config.
    seed: numpy seed of the init.
    draft_to_target: ``i32[V']`` for a reduced-vocabulary EAGLE-3 head, else None.

  Raises:
    ValueError: a reduced-vocabulary EAGLE-3 head without a valid ``draft_to_target``, or
      a ``draft_to_target`` for a head without ``draft_vocab_size``.
  """
  return head_class(cfg.kind)(cfg, np.random.default_rng(seed), draft_to_target)
