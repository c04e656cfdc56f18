"""Full-f32 matmul of a few rows as a ``pl.pallas_call`` lowered through Pallas' Triton backend.

Implementation name ``"pallas_triton"``; contract of
``pallas_kernels.small_matmul.reference.small_matmul_reference``. For decode and verify
steps (M <= 16 rows of activations against a per-layer weight) XLA's full-f32 GEMM
kernels on the H200 were ~2x its TF32 ones (``docs/gpu/device_resident_loop``). Here
the rows are padded to 16 (Triton's smallest dot tile), the grid runs one program per
``block_n`` output columns, and each program streams its ``[D, block_n]`` weight slab once
in ``block_k`` chunks through ``tl.dot`` with IEEE f32 inputs (no TF32), accumulating in
f32. Runs on CUDA GPUs and, with ``interpret=True``, on CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.small_matmul.reference import check_inputs

try:  # Absent from some jaxlib builds; the module must still import on CPU.
  from jax.experimental.pallas import triton as pltriton
except ImportError:  # pragma: no cover - depends on the jaxlib build
  pltriton = None

__all__ = ["MAX_ROWS", "block_size", "small_matmul_triton"]

MAX_ROWS = 16  # rows are padded to this (Triton's smallest dot tile)
_HIGHEST = (lax.Precision.HIGHEST, lax.Precision.HIGHEST)


def block_size(n: int, largest: int) -> int:
  """Largest power of two in [16, ``largest``] dividing ``n`` (576 -> 64 for largest 64,
  192 -> 64, 1536 -> 64; 200 -> 0: none)."""
  b = largest
  while b >= 16 and n % b:
    b //= 2
  return b if b >= 16 else 0


def _kernel(x_ref, w_ref, o_ref, *, num_k: int):
  def body(i, acc):
    return acc + jnp.dot(x_ref[i], w_ref[i], precision=_HIGHEST,
                         preferred_element_type=jnp.float32)

  o_ref[...] = lax.fori_loop(0, num_k, body, jnp.zeros(o_ref.shape, jnp.float32))


@functools.partial(jax.jit, static_argnames=("block_k", "block_n", "interpret"))
def _call(x, w, *, block_k: int, block_n: int, interpret: bool):
  rows, depth = x.shape
  num_k = depth // block_k
  n = w.shape[1]
  xp = jnp.zeros((MAX_ROWS, depth), jnp.float32).at[:rows].set(x)
  xp = xp.reshape(MAX_ROWS, num_k, block_k).transpose(1, 0, 2)  # [num_k, 16, block_k]
  wk = w.reshape(num_k, block_k, n)
  compiler_params = pltriton.CompilerParams(num_warps=4) if pltriton is not None else None
  out = pl.pallas_call(
      functools.partial(_kernel, num_k=num_k),
      grid=(n // block_n,),
      in_specs=[pl.BlockSpec((num_k, MAX_ROWS, block_k), lambda j: (0, 0, 0)),
                pl.BlockSpec((num_k, block_k, block_n), lambda j: (0, 0, j))],
      out_specs=pl.BlockSpec((MAX_ROWS, block_n), lambda j: (0, j)),
      out_shape=jax.ShapeDtypeStruct((MAX_ROWS, n), jnp.float32),
      compiler_params=compiler_params,
      interpret=interpret,
      name="small_matmul",
  )(xp, wk)
  return out[:rows]


def small_matmul_triton(x: jax.Array, w: jax.Array, *, block_n: int = 32,
                        interpret: bool = False) -> jax.Array:
  """``x f32[M, D] @ w f32[D, N] -> f32[M, N]``, full f32, for ``M <= 16``.

  Raises:
    ValueError: bad shapes or dtypes (``check_inputs``).
    NotImplementedError: ``M > 16``, or D / N without a power-of-two block in [16, 64] /
      [16, ``block_n``] (the caller picks another implementation).
  """
  check_inputs(x, w)
  rows, depth = x.shape
  if rows > MAX_ROWS:
    raise NotImplementedError(f"pallas_triton small_matmul takes <= {MAX_ROWS} rows, got {rows}")
  block_k, bn = block_size(depth, 64), block_size(w.shape[1], block_n)
  if not block_k or not bn:
    raise NotImplementedError(f"pallas_triton small_matmul needs D={depth} and N={w.shape[1]} "
                              "divisible by a power of two >= 16")
  if pltriton is None and not interpret:
    raise NotImplementedError("this jaxlib has no Pallas Triton backend")
  return _call(x, w, block_k=block_k, block_n=bn, interpret=interpret)
