"""The only place a method is found by name."""

from __future__ import annotations

import dataclasses
import numbers
import types
import typing

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

__all__ = ["METHODS", "check_option_types", "make_method"]

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
    ValueError: unknown name (lists the known ones), an option of the wrong type
      (``check_option_types``) or bad option values.
  """
  if name not in METHODS:
    raise ValueError(f"method {name=} is unknown; known methods: {sorted(METHODS)}")
  cls = METHODS[name]
  check_option_types(cls, options)
  if cls is AutoRegressive:
    return cls(**options)
  if num_speculative_tokens < 1:
    raise ValueError(f"{num_speculative_tokens=} must be >= 1 for method {name!r}")
  return cls(k=num_speculative_tokens, **options)


def _matches(value, hint) -> bool:
  """Whether ``value`` fits the field annotation ``hint`` (ints pass for floats, bools
  for neither; lists pass for tuples; unknown annotations pass)."""
  if hint is typing.Any or hint is object:
    return True
  origin = typing.get_origin(hint)
  if origin in (typing.Union, types.UnionType):
    return any(_matches(value, a) for a in typing.get_args(hint))
  if hint is type(None):
    return value is None
  if hint in (int, float):  # numpy scalars too
    return (isinstance(value, numbers.Real if hint is float else numbers.Integral)
            and not isinstance(value, bool))
  if hint is tuple or origin is tuple:
    if not isinstance(value, (tuple, list)):
      return False
    args = typing.get_args(hint)
    if len(args) == 2 and args[1] is Ellipsis:
      return all(_matches(v, args[0]) for v in value)
    return not args or (len(args) == len(value) and all(map(_matches, value, args)))
  if isinstance(hint, type):
    return isinstance(value, hint)
  return True


def _describe(hint) -> str:
  return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")


def check_option_types(cls: type[Method], options: dict) -> None:
  """Checks each option against the method's dataclass field annotation, where options
  are parsed into methods (``make_method``), so a wrong type is one line naming the
  option, not a TypeError deep inside a run.

  Raises:
    ValueError: an unknown option, or e.g. ``option h='abc' of method 'svip' must be
      float``.
  """
  hints = typing.get_type_hints(cls)
  fields = {f.name for f in dataclasses.fields(cls) if f.init} - {"k"}  # k: make_method's
  unknown = sorted(set(options) - fields)
  if unknown:
    raise ValueError(f"options {unknown} are not options of method {cls.name!r}; its "
                     f"options: {sorted(fields)}")
  for key, value in options.items():
    if key in fields and key in hints and not _matches(value, hints[key]):
      raise ValueError(f"option {key}={value!r} of method {cls.name!r} must be "
                       f"{_describe(hints[key])}")
