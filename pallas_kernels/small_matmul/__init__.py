"""Full-f32 matmuls of a few rows (decode / verify projections): public function and
implementation dispatch.

``small_matmul(x, w)`` is ``x f32[M, D] @ w f32[D, N]`` at full f32 precision for small M.
``implementation`` is "reference" (XLA's dot at HIGHEST), "pallas_triton" or a sequence
tried in order; only ``NotImplementedError`` moves on to the next one, and the backend
that ran is recorded (:func:`implementations_used`).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax

from pallas_kernels.small_matmul.reference import small_matmul_reference

__all__ = ["IMPLEMENTATIONS", "implementations_used", "small_matmul", "small_matmul_reference"]

IMPLEMENTATIONS = ("reference", "pallas_triton")

_USED: set[str] = set()


def implementations_used() -> tuple[str, ...]:
  """Backends that served ``small_matmul`` calls in this process, sorted."""
  return tuple(sorted(_USED))


def small_matmul(x: jax.Array, w: jax.Array, *,
                 implementation: str | Sequence[str] = "reference",
                 interpret: bool = False) -> jax.Array:
  """``x f32[M, D] @ w f32[D, N] -> f32[M, N]`` at full f32 precision.

  Args:
    x, w: float32 ``[M, D]`` and ``[D, N]``.
    implementation: name or names tried in order (``IMPLEMENTATIONS``).
    interpret: run Pallas backends in interpret mode (CPU tests).

  Raises:
    ValueError: an unknown implementation name (allowed: ``IMPLEMENTATIONS``), bad
      shapes or dtypes.
    NotImplementedError: no listed implementation accepted the call (each one's reason).
  """
  names = (implementation,) if isinstance(implementation, str) else tuple(implementation)
  for name in names:
    if name not in IMPLEMENTATIONS:
      raise ValueError(f"implementation={name!r} must be one of {IMPLEMENTATIONS}")
  reasons = []
  for name in names:
    try:
      if name == "reference":
        out = small_matmul_reference(x, w)
      else:
        from pallas_kernels.small_matmul.triton import small_matmul_triton  # noqa: PLC0415

        out = small_matmul_triton(x, w, interpret=interpret)
    except NotImplementedError as e:
      reasons.append(f"{name}: {e}")
      continue
    _USED.add(name)
    return out
  raise NotImplementedError("no small_matmul implementation accepted the call: "
                            + "; ".join(reasons))
