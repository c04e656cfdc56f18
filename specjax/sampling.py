"""Logit processing (temperature, top-k, top-p) and per-request keyed sampling.

Randomness is per request and position: ``fold_in(fold_in(request_key, position), stream)``
(stream 0: acceptance uniforms, 1: token samples, 2: drafter samples), never a global
stream, so a seeded request's output does not depend on its batch partners.

Greedy rows are those with ``temperature < SAMPLING_EPS`` (``is_greedy``; 0 included), in
every sampler and drafter alike.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.verify import tempered_logits
from specjax.config import SAMPLING_EPS

__all__ = ["SAMPLING_EPS", "is_greedy", "processed_probs", "position_keys", "sample_from_probs",
           "request_key", "STREAM_ACCEPT", "STREAM_SAMPLE", "STREAM_DRAFT"]

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
