"""What a run names, built: methods from ``NAME[@LABEL]`` and options, models from names.

Shared by the evaluation (``harness.evaluation``) and the trace recorder
(``harness.traces.run_traces``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from methods.registry import METHODS, make_method, method_options

__all__ = ["build_method", "load_model", "method_base"]


def method_base(name: str) -> str:
  """The registry name of a method name with an optional label: ``"eagle3@tree"`` ->
  ``"eagle3"``."""
  return name.split("@", 1)[0]


def build_method(name: str, k: int, options: Mapping[str, Any]):
  """The method ``name`` (``NAME[@LABEL]``) with ``options``; an option ``k`` overrides
  ``num_speculative_tokens`` for it.

  Raises:
    ValueError: an option the method does not have, a ``k`` that is not an int, or a
      value of the wrong type (one line naming the options).
  """
  base = method_base(name)
  options = dict(options)
  if "k" in options:
    k = options.pop("k")
    if not isinstance(k, int) or isinstance(k, bool):
      raise ValueError(f"method_options for {name!r}: k={k!r} must be an int")
  allowed = method_options(METHODS[base]) if base in METHODS else []
  unknown = sorted(set(options) - set(allowed))
  if base in METHODS and unknown:  # k comes from num_speculative_tokens
    raise ValueError(f"method_options for {name!r} ({dict(options)}) are not all options "
                     f"of that method ({unknown} unknown); its options: {allowed}")
  try:
    return make_method(base, k, **options)
  except TypeError as e:  # e.g. a string where a number is compared
    raise ValueError(f"method_options for {name!r} ({dict(options)}): a value has the wrong "
                     f"type ({e})") from e


def load_model(name_or_path: str, dtype: str):
  """``models.zoo.load_model`` (imported on use; tests replace this function)."""
  from models.zoo import load_model as zoo_load  # noqa: PLC0415

  return zoo_load(name_or_path, dtype=dtype)
