"""Per-row verification statistics over the vocabulary: the pure-jnp reference.

One *row* is one verified position (b, j) of a chain: the target logits there, the draft
token proposed for it (-1 for the bonus position) and, optionally, the draft
distribution q. For each row the op returns what the rejection sampler needs, in one
sweep over V:

- ``argmax``: the greedy target token (first index of the maximum raw logit);
- ``p_token`` = p(x), ``q_token`` = q(x) for the draft token x, where
  p = softmax(logits / temperature) (computed as ``tempered_logits``: finite for every
  temperature > 0) (Leviathan et al. 2023 accept x with probability
  min(1, p(x) / q(x)); q is the one-hot of x when no draft probabilities are given);
- ``sample``: a draw from normalize(max(p - q, 0)) (the recovered token if x is
  rejected), or from p when the row has no draft token or that residual has no mass
  (the bonus token).

The draw is a Gumbel-max race (argmax_v log r_v + g_v, Gumbel noise g) whose noise
comes from a counter-based hash of ``(seed, v)`` (:func:`uniform_noise`), so the
reference and the kernels draw the same token from the same seed without
materializing [V]-sized noise or probability arrays.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["RowStats", "check_inputs", "gumbel_noise", "tempered_logits", "uniform_noise",
           "verify_rows_reference"]

_GOLDEN = 0x9E3779B9


class RowStats(NamedTuple):
  """Outputs of the per-row verification op (all ``[B, T]``)."""

  argmax: jax.Array  # i32: argmax of the raw logits
  p_token: jax.Array  # f32: p(x) (0 where x = -1)
  q_token: jax.Array  # f32: q(x) (0 where x = -1)
  sample: jax.Array  # i32: draw from normalize(max(p - q, 0)), else from p


def _hash32(x: jax.Array) -> jax.Array:
  """``u32 -> u32`` integer mixer (the "lowbias32" finalizer of C. Wellons' hash-prospector)."""
  x = x ^ (x >> 16)
  x = x * jnp.uint32(0x7FEB352D)
  x = x ^ (x >> 15)
  x = x * jnp.uint32(0x846CA68B)
  return x ^ (x >> 16)


def uniform_noise(seed: jax.Array, index: jax.Array) -> jax.Array:
  """Uniform ``f32`` in (0, 1) from ``u32`` seed and ``i32`` vocabulary index (broadcast).

  24 random bits: ``(hash(seed ^ hash(index * golden)) >> 8 + 0.5) / 2**24``.
  """
  mixed = _hash32(seed ^ _hash32(index.astype(jnp.uint32) * jnp.uint32(_GOLDEN)))
  return ((mixed >> 8).astype(jnp.float32) + 0.5) * (1.0 / (1 << 24))


def gumbel_noise(seed: jax.Array, index: jax.Array) -> jax.Array:
  """Standard Gumbel noise ``-log(-log(U))`` from :func:`uniform_noise`."""
  return -jnp.log(-jnp.log(uniform_noise(seed, index)))


def tempered_logits(logits: jax.Array, temperature: jax.Array) -> jax.Array:
  """``(x - max_v x) / t``, exactly 0 at the maximum: ``f32[B, R, V]`` values <= 0.

  Its softmax is softmax(x / t). Shifting the raw logits before dividing keeps it
  finite for every t > 0: ``x / t`` overflows for a denormal t, and at small t the
  difference of two separately rounded huge numbers ``x * (1/t) - max(x * (1/t))`` loses
  all precision (the Triton kernel's p(argmax) came out as 0.16 at t = 1e-7 and inf at
  t = 1e-9). As t -> 0 it tends to the greedy limit: 0 at the argmax (and its ties),
  -inf elsewhere.

  Args:
    logits: ``f32/bf16[B, R, V]``.
    temperature: ``f32[B]``; rows with temperature <= 0 use 1.
  """
  x = logits.astype(jnp.float32)
  t = jnp.where(temperature > 0, temperature, 1.0).astype(jnp.float32)[:, None, None]
  m = jnp.max(x, axis=-1, keepdims=True)
  return jnp.where(x >= m, 0.0, (x - m) / t)


def check_inputs(logits, temperature, tokens, seeds, q) -> None:
  """Raises ValueError unless the shapes follow :func:`verify_rows_reference`'s contract."""
  if logits.ndim != 3:
    raise ValueError(f"logits.shape={logits.shape} must be [B, T, V]")
  batch, num_rows, vocab = logits.shape
  if temperature.shape != (batch,):
    raise ValueError(f"temperature.shape={temperature.shape} must be (B,)=({batch},)")
  for name, a in (("tokens", tokens), ("seeds", seeds)):
    if a.shape != (batch, num_rows):
      raise ValueError(f"{name}.shape={a.shape} must be (B, T)=({batch}, {num_rows})")
  if q is not None and (num_rows < 2 or q.shape != (batch, num_rows - 1, vocab)):
    raise ValueError(f"q.shape={q.shape} must be (B, T-1, V)=({batch}, {num_rows - 1}, {vocab}) "
                     "with T >= 2")


def verify_rows_reference(
    logits: jax.Array,
    temperature: jax.Array,
    tokens: jax.Array,
    seeds: jax.Array,
    q: jax.Array | None = None,
) -> RowStats:
  """Per-row verification statistics (see the module docstring).

  Args:
    logits: ``f32/bf16[B, T, V]`` target logits (T = L + 1 verified positions).
    temperature: ``f32[B]``; rows with temperature <= 0 use 1 for p and the sample
      (the caller reads only ``argmax`` for greedy rows).
    tokens: ``i32[B, T]`` draft token of each position, -1 for none (bonus position).
    seeds: ``u32[B, T]`` noise seed of each position's draw.
    q: optional ``f32[B, T - 1, V]`` draft distributions of positions 0..T-2 (position
      T - 1 never has a draft); None = one-hot of ``tokens``.

  Returns:
    ``RowStats`` of ``[B, T]`` arrays.
  """
  check_inputs(logits, temperature, tokens, seeds, q)
  x = logits.astype(jnp.float32)
  batch, num_rows, vocab = x.shape
  argmax = jnp.argmax(x, axis=-1).astype(jnp.int32)
  p = jax.nn.softmax(tempered_logits(x, temperature), axis=-1)
  has_tok = tokens >= 0
  safe = jnp.maximum(tokens, 0)[..., None]
  p_token = jnp.where(has_tok, jnp.take_along_axis(p, safe, axis=-1)[..., 0], 0.0)
  idx = jnp.arange(vocab, dtype=jnp.int32)
  if q is None:
    qv = (idx == tokens[..., None]).astype(jnp.float32)
  else:
    qv = jnp.concatenate([q.astype(jnp.float32), jnp.zeros((batch, 1, vocab), jnp.float32)], 1)
    qv = jnp.where(has_tok[..., None], qv, 0.0)
  q_token = jnp.where(has_tok, jnp.take_along_axis(qv, safe, axis=-1)[..., 0], 0.0)
  g = gumbel_noise(seeds.astype(jnp.uint32)[..., None], idx)
  residual = jnp.maximum(p - qv, 0.0)
  race_r = jnp.where(residual > 0, jnp.log(residual) + g, -jnp.inf)
  race_p = jnp.where(p > 0, jnp.log(p) + g, -jnp.inf)
  from_residual = jnp.any(residual > 0, axis=-1)
  sample = jnp.where(from_residual, jnp.argmax(race_r, axis=-1), jnp.argmax(race_p, axis=-1))
  return RowStats(argmax, p_token, q_token, sample.astype(jnp.int32))
