"""Full-f32 matmul of a few rows: the pure-jnp reference of ``pallas_kernels.small_matmul``."""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["check_inputs", "small_matmul_reference"]


def check_inputs(x: jax.Array, w: jax.Array) -> None:
  """Raises ValueError unless ``x f32[M, D]`` and ``w f32[D, N]``."""
  if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
    raise ValueError(f"x {x.shape} and w {w.shape} must be [M, D] and [D, N]")
  if x.dtype != jnp.float32 or w.dtype != jnp.float32:
    raise ValueError(f"x and w must be float32, got {x.dtype} and {w.dtype}")


def small_matmul_reference(x: jax.Array, w: jax.Array) -> jax.Array:
  """``x f32[M, D] @ w f32[D, N] -> f32[M, N]`` at full f32 precision (XLA dot)."""
  check_inputs(x, w)
  return jnp.dot(x, w, precision=jax.lax.Precision.HIGHEST)
