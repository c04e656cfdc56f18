"""Pure-jnp reference for ragged paged attention (f32 logits, slow is fine).

Layout (owned by this op, see :func:`kv_cache_shape`): one array per layer,
``[num_pages, page_size, 2*K, H]`` with key head ``k`` at index ``2*k`` and value
head ``k`` at ``2*k + 1`` on the head axis.

Batch convention ("padded ragged"): queries are ``[B, T, N, H]``; row ``b`` has
``q_lens[b]`` real query tokens at ``t < q_lens[b]`` and the rest is padding.
``kv_lens[b]`` is the KV length *after* this step's tokens were written, so query
token ``t`` of row ``b`` sits at absolute position ``kv_lens[b] - q_lens[b] + t``.
Worked example: a verify step with L = 3 drafts on a 10-token context has
``q_lens = 4`` and ``kv_lens = 14``; its queries sit at positions 10, 11, 12, 13.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["copy_kv", "kv_cache_shape", "write_kv", "paged_attention_reference",
           "query_positions"]


def kv_cache_shape(num_pages: int, page_size: int, num_kv_heads: int, head_dim: int):
  """Shape of one layer's paged KV array: ``(num_pages, page_size, 2*K, H)``."""
  return (num_pages, page_size, 2 * num_kv_heads, head_dim)


def query_positions(kv_lens: jax.Array, q_lens: jax.Array, num_query_tokens: int) -> jax.Array:
  """Absolute positions ``i32[B, T]`` of each query token (padding gets positions past the end)."""
  t = jnp.arange(num_query_tokens, dtype=jnp.int32)[None, :]
  return (kv_lens - q_lens)[:, None] + t


def write_kv(
    kv_pages: jax.Array,
    k: jax.Array,
    v: jax.Array,
    page_indices: jax.Array,
    kv_lens: jax.Array,
    q_lens: jax.Array,
) -> jax.Array:
  """Scatters this step's keys/values into their pages.

  Args:
    kv_pages: ``[num_pages, page_size, 2*K, H]``.
    k, v: ``[B, T, K, H]`` for the step's query tokens.
    page_indices: ``i32[B, pages_per_seq]``, -1 padded.
    kv_lens, q_lens: ``i32[B]`` (see module docstring).

  Returns:
    The updated ``kv_pages``. Padding tokens (``t >= q_lens[b]``) and tokens whose page
    is -1 are dropped (``mode="drop"``), never written.
  """
  num_pages, page_size = kv_pages.shape[:2]
  batch, num_tokens, num_kv_heads, head_dim = k.shape
  pages_per_seq = page_indices.shape[1]
  pos = query_positions(kv_lens, q_lens, num_tokens)  # [B, T]
  valid = jnp.arange(num_tokens)[None, :] < q_lens[:, None]
  logical_page = pos // page_size
  valid &= (logical_page < pages_per_seq) & (pos >= 0)
  page = jnp.take_along_axis(page_indices, jnp.clip(logical_page, 0, pages_per_seq - 1), axis=1)
  valid &= page >= 0
  # Invalid writes go to page index num_pages (out of bounds) and are dropped.
  page = jnp.where(valid, page, num_pages)
  slot = pos % page_size
  kv = jnp.stack([k, v], axis=3).reshape(batch, num_tokens, 2 * num_kv_heads, head_dim)
  return kv_pages.at[page, slot].set(kv.astype(kv_pages.dtype), mode="drop")


def _slots(page_indices, positions, num_pages: int, page_size: int):
  """``(page, slot)`` of each position; -1 positions and -1 pages map to page
  ``num_pages`` (out of bounds: dropped by writes, clamped by reads)."""
  pages_per_seq = page_indices.shape[1]
  logical = positions // page_size
  ok = (positions >= 0) & (logical < pages_per_seq)
  page = jnp.take_along_axis(page_indices, jnp.clip(logical, 0, pages_per_seq - 1), axis=1)
  ok &= page >= 0
  return jnp.where(ok, page, num_pages), positions % page_size


def copy_kv(
    kv_pages: jax.Array,
    page_indices: jax.Array,
    src_positions: jax.Array,
    dst_positions: jax.Array,
) -> jax.Array:
  """Copies each row's KV at ``src_positions`` to ``dst_positions`` (all reads first).

  Used after tree verification to make the accepted path contiguous. Example: page_size
  4, row pages [7, 2], src [5, 6] -> dst [3, 4] copies page 2 slot 1 to page 7 slot 3
  and page 2 slot 2 to page 2 slot 0.

  Args:
    kv_pages: ``[num_pages, page_size, 2*K, H]``.
    page_indices: ``i32[B, pages_per_seq]``, -1 padded.
    src_positions, dst_positions: ``i32[B, M]`` sequence positions; -1 pairs are skipped.

  Returns:
    The updated ``kv_pages``. Pairs whose source or destination is -1 (or on a -1
    page) are not written.
  """
  num_pages, page_size = kv_pages.shape[:2]
  src_page, src_slot = _slots(page_indices, src_positions, num_pages, page_size)
  dst_page, dst_slot = _slots(page_indices, dst_positions, num_pages, page_size)
  dst_page = jnp.where(src_page < num_pages, dst_page, num_pages)
  values = kv_pages[jnp.minimum(src_page, num_pages - 1), src_slot]  # [B, M, 2K, H]
  return kv_pages.at[dst_page, dst_slot].set(values, mode="drop")


def paged_attention_reference(
    q: jax.Array,
    kv_pages: jax.Array,
    page_indices: jax.Array,
    kv_lens: jax.Array,
    q_lens: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    tree_mask: jax.Array | None = None,
    positions: jax.Array | None = None,
) -> jax.Array:
  """Causal attention of ``q`` over each row's paged KV, logits in f32.

  Args:
    q: ``[B, T, N, H]``.
    kv_pages: ``[num_pages, page_size, 2*K, H]`` (already holding this step's KV).
    page_indices: ``i32[B, pages_per_seq]``; -1 pages are never read unmasked.
    kv_lens, q_lens: ``i32[B]``.
    sm_scale: multiplier on ``q·k``.
    sliding_window: if set, query at position p sees keys at positions ``> p - window``
      (Gemma 3 local layers).
    tree_mask: optional ``bool[B, T, T]``: ``tree_mask[b, i, j]`` says query token ``i``
      may see query token ``j`` of the same step (its tree ancestors and itself). The
      committed prefix (positions before the step's first token) is always visible.
    positions: optional ``i32[B, T]`` absolute positions of the query tokens when they
      differ from their KV slots (tree verification: a node at slot ``start + t`` sits
      at position ``start + depth``). Only the sliding window reads them: a query at
      position p sees keys at positions ``> p - window``, where a key of this step is at
      its token's position and a committed key at its slot. Causality and the tree mask
      stay slot-based (tree nodes are stored parents first).

  Returns:
    ``[B, T, N, H]`` in ``q.dtype``. Padding query rows are zeros.
  """
  batch, num_tokens, num_heads, head_dim = q.shape
  page_size = kv_pages.shape[1]
  num_kv_heads = kv_pages.shape[2] // 2
  group = num_heads // num_kv_heads
  pages_per_seq = page_indices.shape[1]
  kv = kv_pages[jnp.maximum(page_indices, 0)]  # [B, P, page_size, 2K, H]
  kv = kv.reshape(batch, pages_per_seq * page_size, num_kv_heads, 2, head_dim)
  keys, values = kv[..., 0, :], kv[..., 1, :]  # [B, S, K, H]
  q_pos = query_positions(kv_lens, q_lens, num_tokens)  # [B, T]
  k_pos = jnp.arange(pages_per_seq * page_size, dtype=jnp.int32)[None, :]  # [1, S]
  page_ok = jnp.repeat(page_indices >= 0, page_size, axis=1)  # [B, S]
  mask = (k_pos[:, None, :] <= q_pos[:, :, None]) & (k_pos[:, None, :] < kv_lens[:, None, None])
  mask &= page_ok[:, None, :]
  if sliding_window is not None and positions is None:
    mask &= k_pos[:, None, :] > q_pos[:, :, None] - sliding_window
  elif sliding_window is not None:
    # Example: start 10, node at slot 13 with depth 1 -> position 11; with window 4 it
    # sees committed slots 8, 9 and its step ancestors (positions 10, 11).
    rel = k_pos - (kv_lens - q_lens)[:, None]  # [B, S] index among the step's tokens
    in_step = (rel >= 0) & (rel < num_tokens)
    step_pos = jnp.take_along_axis(positions, jnp.clip(rel, 0, num_tokens - 1), axis=1)
    k_true = jnp.where(in_step, step_pos, k_pos)  # [B, S]
    mask &= k_true[:, None, :] > positions[:, :, None] - sliding_window
  if tree_mask is not None:
    start = (kv_lens - q_lens)[:, None, None]  # first position of this step
    rel = k_pos[:, None, :] - start  # [B, 1, S] index of the key among the step's tokens
    in_step = (rel >= 0) & (rel < num_tokens)
    allowed = jnp.take_along_axis(
        tree_mask, jnp.broadcast_to(jnp.clip(rel, 0, num_tokens - 1), mask.shape), axis=2
    )
    mask &= jnp.where(in_step, allowed, True)
  # Zero every slot that is not a written key (padding pages and slots at or past
  # kv_lens, e.g. the NaN-filled tail of a row's last page): masked probabilities are 0,
  # but 0 * NaN would still poison the weighted sum over values.
  written = page_ok & (k_pos < kv_lens[:, None])  # [B, S]
  values = jnp.where(written[:, :, None, None], values, 0)
  keys = jnp.where(written[:, :, None, None], keys, 0)
  qg = q.reshape(batch, num_tokens, num_kv_heads, group, head_dim).astype(jnp.float32)
  logits = jnp.einsum("BTKGH,BSKH->BKGTS", qg, keys.astype(jnp.float32)) * sm_scale
  logits = jnp.where(mask[:, None, None], logits, -jnp.inf)
  row_ok = jnp.any(mask, axis=-1)[:, None, None, :, None]
  probs = jax.nn.softmax(jnp.where(row_ok, logits, 0.0), axis=-1)
  probs = jnp.where(row_ok & mask[:, None, None], probs, 0.0)
  out = jnp.einsum("BKGTS,BSKH->BTKGH", probs, values.astype(jnp.float32))
  return out.reshape(batch, num_tokens, num_heads, head_dim).astype(q.dtype)
