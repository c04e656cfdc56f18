"""Logit processing (temperature, top-k, top-p) and per-request keyed sampling.

Randomness is per request and position: ``fold_in(fold_in(request_key, position), stream)``
(stream 0: acceptance uniforms, 1: token samples, 2: drafter samples), never a global
stream, so a seeded request's output does not depend on its batch partners.

Token samples (stream 1) are a Gumbel-max race (``race_sample``) with the hash noise of
``pallas_kernels.verify``; a drafter with draft probabilities q samples its tokens from
stream 2 (``draft_sample``), or, with its ``coupled_sampling`` option, by the same race
over q with the noise the verifier will use for the target's token at that position.

Greedy rows are those with ``temperature < SAMPLING_EPS`` (``is_greedy``; 0 included), in
every sampler and drafter alike.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.verify import gumbel_noise, tempered_logits
from specjax.config import SAMPLING_EPS

__all__ = ["SAMPLING_EPS", "draft_sample", "is_greedy", "processed_probs", "position_keys",
           "race_sample", "sample_from_probs", "sample_seeds", "request_key", "STREAM_ACCEPT",
           "STREAM_SAMPLE", "STREAM_DRAFT"]

STREAM_ACCEPT, STREAM_SAMPLE, STREAM_DRAFT = 0, 1, 2


def request_key(seed: int) -> jax.Array:
  """Raw ``u32[2]`` key of a request's seed."""
  return jax.random.PRNGKey(seed)


def is_greedy(temperature):
  """``temperature < SAMPLING_EPS`` elementwise (jax or numpy arrays): the greedy rows."""
  if isinstance(temperature, np.ndarray):
    return temperature < np.float32(SAMPLING_EPS)
  return temperature < SAMPLING_EPS


def position_keys(keys: jax.Array, positions: jax.Array, stream: int) -> jax.Array:
  """``keys u32[B, 2]``, ``positions i32[B]`` -> ``u32[B, 2]`` keys for one position."""
  fold = jax.vmap(lambda k, p: jax.random.fold_in(jax.random.fold_in(k, p), stream))
  return fold(keys, positions)


def processed_probs(
    logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array
) -> jax.Array:
  """Sampling distribution after temperature, top-k, then top-p (vLLM order).

  Args:
    logits: ``f32[B, R, V]``.
    temperature: ``f32[B]``; below ``SAMPLING_EPS`` (0 included) gives the one-hot of
      the argmax (greedy).
    top_k: ``i32[B]``; 0 keeps all V.
    top_p: ``f32[B]`` in (0, 1]; 1 keeps all V.

  Returns:
    ``f32[B, R, V]`` probabilities summing to 1 over V.
  """
  logits = logits.astype(jnp.float32)
  vocab = logits.shape[-1]
  greedy = is_greedy(temperature)
  scaled = tempered_logits(logits, jnp.where(greedy, 1.0, temperature))  # <= 0, max 0
  sorted_desc = -jnp.sort(-scaled, axis=-1)
  k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)[:, None, None]
  idx = jnp.arange(vocab)[None, None, :]
  sorted_k = jnp.where(idx < k, sorted_desc, -jnp.inf)
  p_sorted = jax.nn.softmax(sorted_k, axis=-1)
  mass_before = jnp.cumsum(p_sorted, axis=-1) - p_sorted
  # top_p = 1 keeps everything even where the f32 cumsum reaches 1 before the tail.
  keep = ((mass_before < top_p[:, None, None]) | (top_p >= 1)[:, None, None]) & (idx < k)
  keep = keep.at[..., 0].set(True)
  num_keep = jnp.sum(keep, axis=-1, keepdims=True)
  cutoff = jnp.take_along_axis(sorted_desc, num_keep - 1, axis=-1)
  probs = jax.nn.softmax(jnp.where(scaled >= cutoff, scaled, -jnp.inf), axis=-1)
  one_hot = jax.nn.one_hot(jnp.argmax(logits, axis=-1), vocab, dtype=jnp.float32)
  return jnp.where(greedy[:, None, None], one_hot, probs)


def sample_from_probs(probs: jax.Array, keys: jax.Array) -> jax.Array:
  """One token per row: ``probs f32[B, V]``, ``keys u32[B, 2]`` -> ``i32[B]``.

  Inverse-CDF sampling; a token of zero probability is never drawn.
  """
  u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys)
  cdf = jnp.cumsum(probs, axis=-1)
  total = cdf[:, -1]
  idx = jnp.sum(cdf <= (u * total)[:, None], axis=-1)
  # Guard against float round-off landing on a zero-probability tail token.
  idx = jnp.minimum(idx, probs.shape[-1] - 1)
  nonzero = probs > 0
  last_nonzero = probs.shape[-1] - 1 - jnp.argmax(nonzero[:, ::-1], axis=-1)
  idx = jnp.where(jnp.take_along_axis(nonzero, idx[:, None], axis=1)[:, 0], idx, last_nonzero)
  return idx.astype(jnp.int32)


def sample_seeds(keys: jax.Array, positions: jax.Array) -> jax.Array:
  """``u32[B]`` noise seeds of the token drawn at ``positions i32[B]`` (stream SAMPLE) for
  request ``keys u32[B, 2]``."""
  return jax.vmap(lambda k: jax.random.bits(k, (), jnp.uint32))(
      position_keys(keys, positions, STREAM_SAMPLE))


def race_sample(weights: jax.Array, keys: jax.Array, positions: jax.Array) -> jax.Array:
  """One token per row from ``weights f32[B, V]`` (>= 0, unnormalized, some > 0): the
  Gumbel-max race ``argmax_v log w_v + g_v`` with the hash noise g of
  ``pallas_kernels.verify`` seeded by ``sample_seeds(keys, positions)`` (first index
  wins ties), so it draws exactly the fused sampler's token from the same weights and
  seed. Every token the verifiers of ``specjax.verify`` emit is drawn this way."""
  seeds = sample_seeds(keys, positions)[:, None]
  g = gumbel_noise(seeds, jnp.arange(weights.shape[-1], dtype=jnp.int32)[None])
  race = jnp.where(weights > 0, jnp.log(jnp.where(weights > 0, weights, 1.0)) + g, -jnp.inf)
  return jnp.argmax(race, axis=-1).astype(jnp.int32)


def draft_sample(probs: jax.Array, keys: jax.Array, positions: jax.Array, *,
                 coupled: bool) -> jax.Array:
  """A drafter's token per row from its processed distribution ``probs f32[B, V]`` (q)
  for the draft at absolute position ``positions i32[B]`` (the verifier's position of
  that draft's target token); ``keys u32[B, 2]`` the request keys.

  ``coupled`` False: inverse-CDF ``sample_from_probs`` with the row's draft-stream key
  (stream DRAFT), independent of the verifier's noise; the draft goes to the verifier
  with its q (Leviathan et al.'s min(1, p/q) rule). True (a method's ``coupled_sampling``
  option): ``race_sample`` over q with the SAME Gumbel noise g the verifier races p with
  at that position, so the draft is ``argmax(log q + g)`` and the target's token
  ``argmax(log p + g)`` (a Gumbel coupling of q and p); such a draft goes to the verifier
  without q and is accepted iff equal to the target's token (``specjax.verify``'s coupled
  rule). Greedy rows (q one-hot) get the argmax either way.
  """
  if coupled:
    return race_sample(probs, keys, positions)
  return sample_from_probs(probs, position_keys(keys, positions, STREAM_DRAFT))
