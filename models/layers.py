"""Building blocks shared by the decoders: RMSNorm, RoPE, activations, projections."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["SMALL_F32_MATMULS", "rms_norm", "rope_inv_freq", "apply_rope", "activation",
           "project", "rows_reduce", "set_small_f32_matmul", "set_two_row_decode",
           "small_f32_matmul", "two_row_decode"]

_TWO_ROW_DECODE = [True]
# How full-f32 GPU projections of at most max_rows rows run (set_small_f32_matmul).
SMALL_F32_MATMULS = ("reduce", "reduce_rows", "reduce_leading", "pallas_triton", "dot")
# rows_reduce's forms of the sum, by implementation name.
_REDUCE_FORMS = {"reduce": "middle", "reduce_rows": "rows", "reduce_leading": "leading"}
_SMALL_F32 = {"implementation": "reduce", "max_rows": 4}
_SMALL_F32_MAX_WEIGHT = 1 << 22  # elements: the per-layer weights, not an LM head
_FULL_F32 = ("highest", "float32")


def set_two_row_decode(enabled: bool) -> None:
  """Turns ``project``'s two-row GPU decode on (the default) or off, for the functions
  traced after the call (a benchmark knob: ``benchmarks.engine_loop --two_row_decode``)."""
  _TWO_ROW_DECODE[0] = bool(enabled)


def two_row_decode() -> bool:
  """Whether ``project`` computes one-row GPU projections as two rows (``set_two_row_decode``)."""
  return _TWO_ROW_DECODE[0]


def set_small_f32_matmul(implementation: str | None = None, max_rows: int | None = None) -> None:
  """Sets how ``project`` computes full-f32 GPU projections of at most ``max_rows`` rows
  (a per-layer-sized weight), for functions traced after the call: "reduce"
  (``rows_reduce``, the default, 4 rows), "reduce_rows" / "reduce_leading" (its other
  forms, ``rows_reduce(form=...)``), "pallas_triton"
  (``pallas_kernels.small_matmul``, at most 16 rows; shapes it does not take run XLA's
  dot, recorded in ``pallas_kernels.small_matmul.implementations_used``) or "dot" (XLA's
  own GEMM kernels). A benchmark knob: ``benchmarks.engine_loop --small_f32_matmul``.

  Raises:
    ValueError: an unknown implementation, ``max_rows`` < 0, or > 16 for "pallas_triton".
  """
  impl = _SMALL_F32["implementation"] if implementation is None else implementation
  rows = _SMALL_F32["max_rows"] if max_rows is None else int(max_rows)
  if impl not in SMALL_F32_MATMULS:
    raise ValueError(f"implementation={impl!r} must be one of {SMALL_F32_MATMULS}")
  if rows < 0 or (impl == "pallas_triton" and rows > 16):
    raise ValueError(f"max_rows={rows} must be >= 0 (and <= 16 for 'pallas_triton')")
  _SMALL_F32.update(implementation=impl, max_rows=rows)


def small_f32_matmul() -> tuple[str, int]:
  """``set_small_f32_matmul``'s current ``(implementation, max_rows)``."""
  return _SMALL_F32["implementation"], _SMALL_F32["max_rows"]


def _full_f32(precision) -> bool:
  """Whether a dot at ``precision`` (None: JAX's current default) is full f32."""
  if precision is None:
    precision = jax.config.jax_default_matmul_precision
  if isinstance(precision, (tuple, list)):
    return all(_full_f32(p) for p in precision)
  return precision is not None and str(precision).lower().removeprefix("precision.") in _FULL_F32


def _as_matrix(spec: str, x: jax.Array, w: jax.Array):
  """``(x f32[M, D], w f32[D, N], out_shape)`` of a projection ``spec`` (see
  ``rows_reduce`` for the form it must have).

  Raises:
    ValueError: a spec of another form.
  """
  ins, out = spec.replace(" ", "").split("->")
  xs, ws = ins.split(",")
  c = xs[-1]
  others = ws.replace(c, "")
  if ws.count(c) != 1 or c in out or out != xs[:-1] + others:
    raise ValueError(f"spec={spec!r} must contract x's last axis with one axis of w and "
                     "output x's leading axes, then w's other axes")
  d = x.shape[-1]
  axis = ws.index(c)
  w2 = jnp.moveaxis(w, axis, 0).reshape(d, -1).astype(jnp.float32)
  w_other = tuple(n for i, n in enumerate(w.shape) if i != axis)
  return x.reshape(-1, d).astype(jnp.float32), w2, (*x.shape[:-1], *w_other)


def rows_reduce(spec: str, x: jax.Array, w: jax.Array, form: str = "middle") -> jax.Array:
  """``jnp.einsum(spec, x, w)`` as an f32 multiply + sum over the contracted axis.

  ``spec`` must contract x's last axis with one axis of ``w`` and put x's leading axes,
  then w's other axes in their order, in the output (e.g. ``"BTD,DNH->BTNH"``,
  ``"...D,DV->...V"``). Shapes: ``x [..., D]``, ``w`` with D on that axis; returns
  ``f32[..., *w_other]``.

  ``form`` is how the M x D x N product is laid out for XLA's reduction emitters (same
  sums, other kernels): "middle" ``[M, D, N]`` summed over D (one fusion; on the H200 a
  4-row SmolLM2 MLP projection became a Triton block-level fusion of ~16 us against ~4.4
  for one row, ``docs/gpu/device_resident_loop``), "rows" M sibling ``[D, N]`` column
  sums (one per row, for XLA to fuse into one multi-output kernel), "leading"
  ``[D, M, N]`` summed over its leading axis.

  Raises:
    ValueError: a spec of another form, or an unknown ``form``.
  """
  x2, w2, shape = _as_matrix(spec, x, w)
  if form == "middle":
    out = jnp.sum(x2[:, :, None] * w2[None], axis=1)
  elif form == "rows":
    out = jnp.stack([jnp.sum(x2[r][:, None] * w2, axis=0) for r in range(x2.shape[0])])
  elif form == "leading":
    out = jnp.sum(x2.T[:, :, None] * w2[:, None, :], axis=0)
  else:
    raise ValueError(f"form={form!r} must be 'middle', 'rows' or 'leading'")
  return out.reshape(shape)


def _small_matmul(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
  """``rows_reduce``'s contract through ``pallas_kernels.small_matmul`` (Pallas Triton;
  XLA's dot for shapes the kernel does not take, recorded by the dispatcher)."""
  from pallas_kernels.small_matmul import small_matmul  # noqa: PLC0415

  x2, w2, shape = _as_matrix(spec, x, w)
  return small_matmul(x2, w2, implementation=("pallas_triton", "reference")).reshape(shape)


def project(spec: str, x: jax.Array, w: jax.Array, **kwargs) -> jax.Array:
  """``jnp.einsum(spec, x, w, **kwargs)`` for a weight projection of ``x: [..., D]``.

  On GPU a one-row ``x`` (every leading dim 1: batch-1 decode) is computed as two rows
  (the row repeated) and the first row kept. XLA GPU lowers one-row dots to GEMV kernels
  whose step was far slower than the two-row GEMM at the same weight traffic: on the H200,
  the Llama-3.1-8B-shape bf16 step at batch 1, context 512 took 8.41 ms pipelined with
  one query row and 4.74 ms with two (``experiments.bench_step``, session 4). Other
  backends get the plain einsum (on XLA CPU two rows cost more than one).

  On GPU a full-f32 projection (f32 ``x`` and ``w`` at "highest" / "float32" precision,
  from ``precision=`` or ``jax.default_matmul_precision``) of at most ``max_rows`` rows
  and a per-layer-sized weight (<= 2**22 elements) runs as ``set_small_f32_matmul`` says;
  by default a multiply + reduce (``rows_reduce``): XLA lowers such dots to f32 FMA GEMM kernels
  (or cuBLAS SGEMM + split-K) that took ~2x the TF32 kernels' time at SmolLM2-135M size.
  On the H200 (SmolLM2 f32 engine step at "highest", context 512, one run each) the
  reduce took the batch-1 AR step from 2.247 to 1.872 ms and the batch-4 one from 2.120
  to 2.001 ms, but made 5- and 20-row verify steps slower (1.852 -> 2.026, 2.343 ->
  2.807 ms), hence the default of 4 rows (``docs/gpu/device_resident_loop``).
  """
  rows = math.prod(x.shape[:-1]) if x.ndim >= 2 else 0
  impl = _SMALL_F32["implementation"]
  if (impl != "dot" and jax.default_backend() == "gpu" and 0 < rows <= _SMALL_F32["max_rows"]
      and x.dtype == jnp.float32 and w.dtype == jnp.float32
      and w.size <= _SMALL_F32_MAX_WEIGHT and _full_f32(kwargs.get("precision"))):
    if impl == "pallas_triton":
      return _small_matmul(spec, x, w)
    return rows_reduce(spec, x, w, _REDUCE_FORMS[impl])
  if (x.ndim < 2 or math.prod(x.shape[:-1]) != 1 or jax.default_backend() != "gpu"
      or not _TWO_ROW_DECODE[0]):
    return jnp.einsum(spec, x, w, **kwargs)
  return jnp.einsum(spec, jnp.concatenate([x, x], axis=0), w, **kwargs)[:1]


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, plus_one: bool) -> jax.Array:
  """RMSNorm over the last axis, computed in f32; scale is ``w`` or ``1 + w`` (Gemma)."""
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  w = weight.astype(jnp.float32)
  y = y * (1.0 + w if plus_one else w)
  return y.astype(x.dtype)


def rope_inv_freq(
    head_dim: int, theta: float, scaling: tuple[tuple[str, float | str], ...] | None
) -> jax.Array:
  """Inverse frequencies ``f32[H/2]`` with optional HF-style RoPE scaling.

  Args:
    head_dim: H (even).
    theta: RoPE base.
    scaling: ``None`` or the items of an HF ``rope_parameters`` dict. ``rope_type``
      "llama3" (Llama 3.1; the default when ``rope_type`` is absent) needs ``factor``,
      ``low_freq_factor``, ``high_freq_factor`` and ``original_max_position_embeddings``;
      "linear" (Gemma 3 global layers) needs ``factor``.

  Returns:
    ``f32[H/2]``.

  Raises:
    ValueError: unsupported ``rope_type``.
  """
  inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
  s = dict(scaling or ())
  rope_type = s.get("rope_type", "llama3")
  if scaling and rope_type == "linear":
    inv = inv / float(s["factor"])
  elif scaling and rope_type == "llama3":
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = 2 * math.pi / inv
    smooth = (old / wavelen - low) / (high - low)
    scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    inv = np.where(is_mid, mid, scaled)
  elif scaling:
    raise ValueError(f"{rope_type=} must be 'llama3' or 'linear'")
  return jnp.asarray(inv, dtype=jnp.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
  """Rotate-half (NeoX/HF) RoPE. ``x``: ``[B, T, heads, H]``; ``positions``: ``i32[B, T]``."""
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, H/2]
  cos = jnp.cos(angles)[:, :, None, :]
  sin = jnp.sin(angles)[:, :, None, :]
  x32 = x.astype(jnp.float32)
  x1, x2 = jnp.split(x32, 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def activation(name: str, x: jax.Array) -> jax.Array:
  if name == "silu":
    return jax.nn.silu(x)
  if name == "gelu_tanh":
    return jax.nn.gelu(x, approximate=True)
  raise ValueError(f"activation {name=} must be 'silu' or 'gelu_tanh'")
