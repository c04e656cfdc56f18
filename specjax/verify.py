"""The shared lossless rejection sampler (chain drafts).

Greedy: accept the longest draft prefix equal to the target argmax, then emit the
target argmax (recovered token at the first mismatch, bonus token if all match).
Stochastic (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding"; Chen et al. 2023, "Accelerating LLM Decoding with Speculative Sampling"):
accept draft d_j with probability min(1, p_j(d_j) / q_j(d_j)), where p and q are the
target and draft distributions after the same temperature/top-k/top-p; q(d) = 0
rejects. At the first rejection sample the recovered token from
normalize(max(0, p_j - q_j)); if every draft is accepted sample the bonus token from
p_L. Without draft probabilities q is the one-hot of the draft token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.sampling import (
    STREAM_ACCEPT,
    STREAM_SAMPLE,
    position_keys,
    processed_probs,
    sample_from_probs,
)

__all__ = ["rejection_sample", "greedy_verify"]


def _leading_run(ok: jax.Array) -> jax.Array:
  """Length of the leading run of True along the last axis: ``bool[B, L] -> i32[B]``."""
  return jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)


def _assemble(draft_tokens, num_accepted, last_token):
  """``output[j] = draft[j]`` for j < a, ``output[a] = last_token``, then -1."""
  batch, length = draft_tokens.shape
  j = jnp.arange(length + 1)[None, :]
  padded = jnp.concatenate([draft_tokens, jnp.full((batch, 1), -1, jnp.int32)], axis=1)
  out = jnp.where(j < num_accepted[:, None], padded, -1)
  return jnp.where(j == num_accepted[:, None], last_token[:, None], out).astype(jnp.int32)


def greedy_verify(target_logits, draft_tokens, num_draft):
  """Greedy chain verification.

  Args:
    target_logits: ``f32[B, L+1, V]``; row j predicts the token after draft j-1.
    draft_tokens: ``i32[B, L]`` (-1 padded).
    num_draft: ``i32[B]`` real drafts per row (0 = plain decode).

  Returns:
    ``(output_tokens i32[B, L+1] -1 padded, num_accepted i32[B])``.
  """
  length = draft_tokens.shape[1]
  argmax = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)
  ok = (draft_tokens == argmax[:, :length]) & (jnp.arange(length)[None] < num_draft[:, None])
  accepted = _leading_run(ok)
  last = jnp.take_along_axis(argmax, accepted[:, None], axis=1)[:, 0]
  return _assemble(draft_tokens, accepted, last), accepted


def rejection_sample(
    target_logits: jax.Array,
    draft_tokens: jax.Array,
    num_draft: jax.Array,
    draft_probs: jax.Array | None,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    keys: jax.Array,
    positions: jax.Array,
    *,
    all_greedy: bool,
):
  """Lossless verification of chain drafts.

  Args:
    target_logits: ``f32[B, L+1, V]``.
    draft_tokens: ``i32[B, L]``, -1 padded.
    num_draft: ``i32[B]``.
    draft_probs: ``f32[B, L, V]`` draft distributions q (after the same sampling
      processing as the target), or None (q = one-hot of the draft token).
    temperature, top_k, top_p: ``[B]`` per-request sampling parameters.
    keys: ``u32[B, 2]`` request keys.
    positions: ``i32[B]`` absolute sequence position of the token predicted by
      ``target_logits[:, 0]`` (positions advance by one per row j).
    all_greedy: static; True skips the stochastic path entirely.

  Returns:
    ``(output_tokens i32[B, L+1] -1 padded, num_accepted i32[B])``; the emitted tokens of
    row b are ``output_tokens[b, :num_accepted[b] + 1]``.
  """
  greedy_out, greedy_acc = greedy_verify(target_logits, draft_tokens, num_draft)
  if all_greedy:
    return greedy_out, greedy_acc
  batch, length = draft_tokens.shape
  vocab = target_logits.shape[-1]
  p = processed_probs(target_logits, temperature, top_k, top_p)  # [B, L+1, V]
  safe_draft = jnp.maximum(draft_tokens, 0)
  if draft_probs is None:
    q = jax.nn.one_hot(safe_draft, vocab, dtype=jnp.float32)
  else:
    q = draft_probs.astype(jnp.float32)
  p_d = jnp.take_along_axis(p[:, :length], safe_draft[..., None], axis=-1)[..., 0]
  q_d = jnp.take_along_axis(q, safe_draft[..., None], axis=-1)[..., 0]
  pos = positions[:, None] + jnp.arange(length)[None]  # [B, L]
  u_keys = jax.vmap(lambda k, ps: position_keys(jnp.broadcast_to(k, (length, 2)), ps,
                                                STREAM_ACCEPT))(keys, pos)
  u = jax.vmap(jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32)))(u_keys)
  ok = (q_d > 0) & (u * q_d < p_d) & (jnp.arange(length)[None] < num_draft[:, None])
  accepted = _leading_run(ok)
  p_a = jnp.take_along_axis(p, accepted[:, None, None], axis=1)[:, 0]  # [B, V]
  q_pad = jnp.concatenate([q, jnp.zeros((batch, 1, vocab), q.dtype)], axis=1)
  q_a = jnp.take_along_axis(q_pad, accepted[:, None, None], axis=1)[:, 0]
  rejected = accepted < num_draft
  residual = jnp.maximum(p_a - jnp.where(rejected[:, None], q_a, 0.0), 0.0)
  mass = jnp.sum(residual, axis=-1, keepdims=True)
  dist = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), p_a)
  last = sample_from_probs(dist, position_keys(keys, positions + accepted, STREAM_SAMPLE))
  out = _assemble(draft_tokens, accepted, last)
  greedy_row = (temperature == 0)[:, None]
  out = jnp.where(greedy_row, greedy_out, out)
  accepted = jnp.where(greedy_row[:, 0], greedy_acc, accepted)
  return out, accepted
