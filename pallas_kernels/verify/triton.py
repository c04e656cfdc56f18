"""Per-row verification statistics as a ``pl.pallas_call`` lowered through Pallas' Triton backend.

Implementation name ``"pallas_triton"``; same contract as
``pallas_kernels.verify.reference.verify_rows_reference``. Grid ``(B, T)``: one program
per verified row streams that row's logits (and q) in blocks of ``block`` entries twice
— pass 1 keeps the running raw-logit max and argmax, the sum of exp((x - max) / t)
(online softmax, finite for every temperature > 0) and
the draft token's logit and q; pass 2 runs the Gumbel-max races for the residual and
for p with the hash noise of ``reference.uniform_noise`` — so no [R, V] probability,
residual or noise array is ever written. Runs on CUDA GPUs and, with
``interpret=True``, on CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.verify.reference import RowStats, check_inputs, gumbel_noise

try:  # Absent from some jaxlib builds; the module must still import on CPU.
  from jax.experimental.pallas import triton as pltriton
except ImportError:  # pragma: no cover - depends on the jaxlib build
  pltriton = None

__all__ = ["verify_rows_triton", "vocab_block"]

MIN_BLOCK, MAX_BLOCK = 128, 2048


def vocab_block(vocab: int) -> int:
  """Largest power of two in [128, 2048] dividing ``vocab`` (49152 -> 2048,
  151936 -> 128, 128256 -> 256); 0 if none."""
  b = MAX_BLOCK
  while b >= MIN_BLOCK and vocab % b:
    b //= 2
  return b if b >= MIN_BLOCK else 0


def _first_max(values, index, best, best_idx):
  """Running (max, first index of the max) update with one block."""
  m = jnp.max(values)
  i = jnp.min(jnp.where(values == m, index, jnp.iinfo(jnp.int32).max))
  take = m > best
  return jnp.where(take, m, best), jnp.where(take, i, best_idx)


def _kernel(temp_ref, tok_ref, seed_ref, logits_ref, *rest, has_q: bool, num_blocks: int,
            block: int):
  if has_q:
    q_ref, argmax_ref, p_ref, qtok_ref, sample_ref = rest
  else:
    argmax_ref, p_ref, qtok_ref, sample_ref = rest
  b, j = pl.program_id(0), pl.program_id(1)
  t = temp_ref[b]
  inv_t = 1.0 / jnp.where(t > 0, t, 1.0)
  tok = tok_ref[b, j]
  seed = seed_ref[b, j]
  lane = lax.broadcasted_iota(jnp.int32, (block,), 0)
  neg_inf = jnp.float32(-jnp.inf)

  def q_block(i, index):
    if has_q:
      return jnp.where(tok >= 0, q_ref[i].astype(jnp.float32), 0.0)
    return jnp.where(index == tok, 1.0, 0.0).astype(jnp.float32)

  def gap(a, top):
    # (a - top) / t, exactly 0 at the row maximum: softmax(x / t) = exp(gap(x, max)) / z
    # stays finite for every t > 0 (reference.tempered_logits; no huge x / t products).
    return jnp.where(a >= top, 0.0, (a - top) * inv_t)

  def pass1(i, carry):
    best, z, best_idx, x_tok, q_tok = carry  # best: running max of the raw logits
    x = logits_ref[i].astype(jnp.float32)
    index = i * block + lane
    top = jnp.maximum(best, jnp.max(x))
    z = z * jnp.exp(gap(best, top)) + jnp.sum(jnp.exp(gap(x, top)))
    best, best_idx = _first_max(x, index, best, best_idx)
    hit = index == tok
    x_tok = x_tok + jnp.sum(jnp.where(hit, x, 0.0))
    q_tok = q_tok + jnp.sum(jnp.where(hit, q_block(i, index), 0.0))
    return best, z, best_idx, x_tok, q_tok

  zero = jnp.float32(0)
  top, z, best_idx, x_tok, q_tok = lax.fori_loop(
      0, num_blocks, pass1, (neg_inf, zero, jnp.int32(0), zero, zero))

  def pass2(i, carry):
    best_r, idx_r, best_p, idx_p = carry
    index = i * block + lane
    p = jnp.exp(gap(logits_ref[i].astype(jnp.float32), top)) / z
    residual = jnp.maximum(p - q_block(i, index), 0.0)
    g = gumbel_noise(seed, index)
    race_r = jnp.where(residual > 0, jnp.log(residual) + g, neg_inf)
    race_p = jnp.where(p > 0, jnp.log(p) + g, neg_inf)
    best_r, idx_r = _first_max(race_r, index, best_r, idx_r)
    best_p, idx_p = _first_max(race_p, index, best_p, idx_p)
    return best_r, idx_r, best_p, idx_p

  best_r, idx_r, _, idx_p = lax.fori_loop(
      0, num_blocks, pass2, (neg_inf, jnp.int32(0), neg_inf, jnp.int32(0)))
  has_tok = tok >= 0
  argmax_ref[0, 0] = best_idx
  p_ref[0, 0] = jnp.where(has_tok, jnp.exp(gap(x_tok, top)) / z, 0.0)
  qtok_ref[0, 0] = jnp.where(has_tok, q_tok, 0.0)
  sample_ref[0, 0] = jnp.where(best_r > neg_inf, idx_r, idx_p)


@functools.partial(jax.jit, static_argnames=("block", "interpret"))
def _call(logits, temperature, tokens, seeds, q, *, block: int, interpret: bool):
  batch, num_rows, vocab = logits.shape
  num_blocks = vocab // block
  has_q = q is not None
  operands = [temperature.astype(jnp.float32), tokens.astype(jnp.int32),
              seeds.astype(jnp.uint32), logits.reshape(batch, num_rows, num_blocks, block)]
  in_specs = [pl.BlockSpec((batch,), lambda b, j: (0,)),
              pl.BlockSpec((batch, num_rows), lambda b, j: (0, 0)),
              pl.BlockSpec((batch, num_rows), lambda b, j: (0, 0)),
              pl.BlockSpec((None, None, num_blocks, block), lambda b, j: (b, j, 0, 0))]
  if has_q:
    # The last position has no draft: it reads q's last row, which the kernel ignores
    # (its token is -1), so q is never padded or copied.
    last = q.shape[1] - 1
    operands.append(q.reshape(batch, q.shape[1], num_blocks, block))
    in_specs.append(pl.BlockSpec((None, None, num_blocks, block),
                                 lambda b, j: (b, jnp.minimum(j, last), 0, 0)))
  out = pl.BlockSpec((1, 1), lambda b, j: (b, j))
  kernel = functools.partial(_kernel, has_q=has_q, num_blocks=num_blocks, block=block)
  compiler_params = pltriton.CompilerParams(num_warps=4) if pltriton is not None else None
  shape = (batch, num_rows)
  argmax, p_token, q_token, sample = pl.pallas_call(
      kernel,
      grid=shape,
      in_specs=in_specs,
      out_specs=(out, out, out, out),
      out_shape=(jax.ShapeDtypeStruct(shape, jnp.int32), jax.ShapeDtypeStruct(shape, jnp.float32),
                 jax.ShapeDtypeStruct(shape, jnp.float32), jax.ShapeDtypeStruct(shape, jnp.int32)),
      compiler_params=compiler_params,
      interpret=interpret,
      name=f"verify_rows_triton_b{block}",
  )(*operands)
  return RowStats(argmax, p_token, q_token, sample)


def verify_rows_triton(
    logits: jax.Array,
    temperature: jax.Array,
    tokens: jax.Array,
    seeds: jax.Array,
    q: jax.Array | None = None,
    *,
    interpret: bool = False,
) -> RowStats:
  """Triton-lowered per-row verification; same contract as ``verify_rows_reference``.

  Raises:
    ValueError: mismatched shapes.
    NotImplementedError: no CUDA backend (and not ``interpret``), Triton unavailable,
      or a vocabulary with no power-of-two block in [128, 2048] dividing it.
  """
  check_inputs(logits, temperature, tokens, seeds, q)
  vocab = logits.shape[-1]
  if not interpret:
    if pltriton is None:
      raise NotImplementedError("jax.experimental.pallas.triton is not importable")
    if jax.default_backend() != "gpu":
      raise NotImplementedError(f"pallas_triton needs a GPU; backend={jax.default_backend()}")
  block = vocab_block(vocab)
  if not block:
    raise NotImplementedError(f"pallas_triton needs V divisible by a power of two in "
                              f"[{MIN_BLOCK}, {MAX_BLOCK}]; got V={vocab}")
  return _call(logits, temperature, tokens, seeds, q, block=block, interpret=bool(interpret))
