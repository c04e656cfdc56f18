"""The only place a method is found by name.

Composite methods (``adaptive``, ``hsddw``, ``verify_skip``, ``svip``, ``turbospec``,
``sv``) take their inner methods as constructed objects; the options naming them are
declared on the class (``Method.inner_methods``) and ``make_method`` builds those names
here, so the registry imports the methods and no method imports the registry.
"""

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
from specjax.method import InnerMethodOption, Method

__all__ = ["METHODS", "check_option_types", "make_method", "method_options"]

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

  Options that name inner methods (``Method.inner_methods``, e.g. ``drafter="ngram"`` or
  ``drafters="suffix,ngram"``) are built here with the same k, with their own options
  where declared (``drafter_options``); a ``Method`` given there is passed as it is.

  Raises:
    ValueError: unknown name (lists the known ones), an option of the wrong type
      (``check_option_types``) or bad option values.
  """
  if name not in METHODS:
    raise ValueError(f"method {name=} is unknown; known methods: {sorted(METHODS)}")
  cls = METHODS[name]
  if cls is AutoRegressive:
    check_option_types(cls, options)
    return cls(**options)
  if num_speculative_tokens < 1:
    raise ValueError(f"{num_speculative_tokens=} must be >= 1 for method {name!r}")
  options = dict(options)
  for spec in cls.inner_methods:
    options[spec.option] = _build_inner(cls, spec, num_speculative_tokens, options)
  check_option_types(cls, options)
  return cls(k=num_speculative_tokens, **options)


def method_options(cls: type[Method]) -> list[str]:
  """The options ``make_method`` takes for ``cls`` (k aside): its dataclass fields and the
  options of its named inner methods (``InnerMethodOption.options``)."""
  fields = {f.name for f in dataclasses.fields(cls) if f.init} - {"k"}  # k: make_method's
  return sorted(fields | {s.options for s in cls.inner_methods if s.options})


def _build_inner(cls: type[Method], spec: InnerMethodOption, k: int, options: dict):
  """The inner method(s) of option ``spec`` built from ``options`` (which loses
  ``spec.options``): names -> ``make_method(name, k, **inner options)``."""
  value = options.get(spec.option, spec.default)
  raw = options.pop(spec.options, ()) if spec.options else ()
  try:
    pairs = raw.items() if isinstance(raw, dict) else raw
    inner_options = {str(n): tuple(v) if isinstance(v, list) else v for n, v in pairs}
  except (TypeError, ValueError):
    raise ValueError(f"option {spec.options}={raw!r} of method {cls.name!r} must be a dict "
                     f"(or pairs) of {spec.option} options") from None
  if not spec.many:
    return _build_one(cls, spec, value, k, inner_options, value)
  entries = value.split(",") if isinstance(value, str) else value
  if not isinstance(entries, (tuple, list)):
    raise ValueError(f"option {spec.option}={value!r} of method {cls.name!r} must be method "
                     "names (a sequence or a comma-separated string) or Methods")
  return tuple(_build_one(cls, spec, v, k, inner_options, value) for v in entries)


def _build_one(cls, spec: InnerMethodOption, entry, k: int, inner_options: dict, value):
  """``entry`` (of the option's ``value``) as a method: a ``Method`` as it is, a name built."""
  if isinstance(entry, Method):
    if inner_options:
      raise ValueError(f"option {spec.options}={inner_options} of method {cls.name!r} applies "
                       f"to a named {spec.option} only, not to a Method instance")
    return entry
  if isinstance(entry, str) and entry.strip() in METHODS:
    return make_method(entry.strip(), k, **inner_options)
  which = f" ({entry!r} is neither)" if spec.many else ""
  raise ValueError(f"option {spec.option}={value!r} of method {cls.name!r} must be "
                   f"{'method names' if spec.many else 'a method name'} from {sorted(METHODS)} "
                   f"or {'Methods' if spec.many else 'a Method'}{which}")


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
                     f"options: {method_options(cls)}")
  for key, value in options.items():
    if key in fields and key in hints and not _matches(value, hints[key]):
      raise ValueError(f"option {key}={value!r} of method {cls.name!r} must be "
                       f"{_describe(hints[key])}")
