"""Base of methods that wrap another drafter (SVIP, TurboSpec, SV).

The wrapped drafter is named (built through ``methods.registry.make_method`` with the
wrapper's k and ``drafter_options``) or given as an instance; the wrapper delegates
``init_state`` / ``propose`` / ``observe`` to it and adds its own policy.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from specjax.method import Capabilities, Method

__all__ = ["WrappedDrafter", "freeze_options"]


def freeze_options(options) -> tuple:
  """A dict (or pairs) of options -> sorted hashable ``((name, value), ...)``; lists
  become tuples (e.g. ``{"feature_layers": [1, 2]}`` -> ``(("feature_layers", (1, 2)),)``)."""
  items = options.items() if isinstance(options, dict) else options
  return tuple(sorted((str(n), tuple(v) if isinstance(v, list) else v) for n, v in items))


@dataclasses.dataclass(frozen=True, kw_only=True)
class WrappedDrafter(Method):
  """Delegates to ``inner`` (built in ``__post_init__``).

  Attributes:
    k: most draft tokens per row (the wrapped drafter's k).
    drafter: a registry name, or a ``Method`` instance with the same k.
    drafter_options: dict or pairs of options for a named drafter.
  """

  k: int = 4
  drafter: Any = "draft_model"
  drafter_options: Any = ()

  def __post_init__(self):
    if self.k < 1:
      raise ValueError(f"num_speculative_tokens k={self.k} must be >= 1")
    object.__setattr__(self, "drafter_options", freeze_options(self.drafter_options))
    if isinstance(self.drafter, Method):
      if self.drafter_options:
        raise ValueError(f"drafter_options={self.drafter_options} apply to a named drafter "
                         "only, not to a drafter instance")
      inner = self.drafter
    else:
      from methods.registry import make_method  # noqa: PLC0415 (the registry imports us)

      inner = make_method(str(self.drafter), self.k, **dict(self.drafter_options))
    if inner.num_speculative_tokens != self.k:
      raise ValueError(f"drafter {inner.name!r} drafts {inner.num_speculative_tokens} tokens; "
                       f"it must equal k={self.k}")
    if inner.host_capabilities().tree:
      raise ValueError(f"drafter {inner.name!r} drafts trees; {self.name!r} wraps chains only")
    object.__setattr__(self, "inner", inner)

  @property
  def num_speculative_tokens(self) -> int:
    return self.k

  def capabilities(self) -> Capabilities:
    return self.inner.host_capabilities()

  def init_state(self, runtime):
    return self.inner.init_state(runtime)

  def propose(self, state, context):
    return self.inner.propose(state, context)

  def observe(self, state, result):
    return self.inner.observe(state, result)

  def observe_prefill(self, state, result):
    return self.inner.observe_prefill(state, result)

  def describe(self) -> dict:
    """Flat: the wrapper's fields (non-scalars as their repr), then the wrapped drafter's
    under ``drafter.`` (e.g. ``{"method": "svip", "h": 0.3, "drafter.method":
    "draft_model", "drafter.k": 4, ...}``)."""
    scalar = lambda v: v if v is None or isinstance(v, (bool, int, float, str)) else repr(v)
    out = {f.name: scalar(getattr(self, f.name)) for f in dataclasses.fields(self)
           if f.name not in ("drafter", "drafter_options") and f.compare}
    inner = {f"drafter.{n}": scalar(v) for n, v in self.inner.describe().items()}
    return {"method": self.name, **out, **inner}
