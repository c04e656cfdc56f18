"""The only place a method is found by name."""

from __future__ import annotations

from methods.adaptive import Adaptive
from methods.ar import AutoRegressive
from methods.draft_model import DraftModel
from methods.eagle import Eagle
from methods.eagle3 import Eagle3
from methods.hsddw import HSDDW
from methods.layerskip import LayerSkip
from methods.medusa import Medusa
from methods.mtp import MTP
from methods.ngram import NGram
from methods.suffix import SuffixDecoding
from methods.sv import SpeculativeVerification
from methods.svip import Svip
from methods.turbospec import TurboSpec
from methods.verify_skip import VerifySkip
from specjax.method import Method

__all__ = ["METHODS", "make_method"]

METHODS: dict[str, type[Method]] = {
    "ar": AutoRegressive,
    "ngram": NGram,
    "draft_model": DraftModel,
    "eagle": Eagle,
    "eagle3": Eagle3,
    "mtp": MTP,
    "medusa": Medusa,
    "hsddw": HSDDW,
    "verify_skip": VerifySkip,
    "suffix": SuffixDecoding,
    "adaptive": Adaptive,
    "layerskip": LayerSkip,
    "svip": Svip,
    "turbospec": TurboSpec,
    "sv": SpeculativeVerification,
}


def make_method(name: str, num_speculative_tokens: int = 4, **options) -> Method:
  """Builds a method config by name.

  Raises:
    ValueError: unknown name (lists the known ones) or bad option values.
  """
  if name not in METHODS:
    raise ValueError(f"method {name=} is unknown; known methods: {sorted(METHODS)}")
  cls = METHODS[name]
  if cls is AutoRegressive:
    return cls(**options)
  if num_speculative_tokens < 1:
    raise ValueError(f"{num_speculative_tokens=} must be >= 1 for method {name!r}")
  return cls(k=num_speculative_tokens, **options)
