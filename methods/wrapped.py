"""Base of methods that wrap another drafter (SVIP, TurboSpec, SV).

The wrapped drafter is given as a constructed ``Method`` with the wrapper's k; users name
it (``drafter=``, default "draft_model", with ``drafter_options=``) and
``methods.registry.make_method`` builds it (``WrappedDrafter.inner_methods``). The
wrapper delegates ``init_state`` / ``propose`` / ``observe`` to it and adds its own
policy.
"""

from __future__ import annotations

import dataclasses

from specjax.method import Capabilities, InnerMethodOption, Method

__all__ = ["WrappedDrafter"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class WrappedDrafter(Method):
  """Delegates to ``inner`` (the drafter, or a copy a subclass adapts in ``__post_init__``).

  Attributes:
    k: most draft tokens per row (the wrapped drafter's k).
    drafter: the wrapped chain drafter, a ``Method`` with the same k (through the
      registry: a method name, default "draft_model", and ``drafter_options``, a dict of
      its options).
  """

  inner_methods = (InnerMethodOption("drafter", "draft_model", options="drafter_options"),)
  k: int = 4
  drafter: Method | None = None

  def __post_init__(self):
    if self.k < 1:
      raise ValueError(f"num_speculative_tokens k={self.k} must be >= 1")
    inner = self.drafter
    if not isinstance(inner, Method):
      raise ValueError(f"drafter={inner!r} must be a Method (build it by name with "
                       "methods.registry.make_method)")
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
           if f.name != "drafter" and f.compare}
    inner = {f"drafter.{n}": scalar(v) for n, v in self.inner.describe().items()}
    return {"method": self.name, **out, **inner}
