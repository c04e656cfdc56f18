"""Input validation and layout helpers shared by the paged-attention kernels.

Every kernel works on one ``(b, k)`` pair at a time: the ``G = N / K`` query heads of
KV head ``k`` for all ``T`` query tokens of row ``b`` are stacked into one tile of
``rows`` query rows, row ``r = t * G + g`` (padded with zero rows up to the kernel's
tile height). Worked example: Llama-8B verify with ``L = 3`` has ``T = 4``, ``N = 32``,
``K = 8`` so ``G = 4`` and 16 real rows; query head ``n = 13`` at token ``t = 2`` is
``k = 13 // 4 = 3``, ``g = 1`` and lands in row ``2 * 4 + 1 = 9`` of tile ``(b, 3)``.

A tree mask travels as one i32 bit word per query token: bit ``j`` of
``tree_bits[b, t]`` is ``tree_mask[b, t, j]``, so ``T <= 31``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = [
    "MAX_TREE_TOKENS",
    "check_inputs",
    "check_slot_window",
    "from_row_tiles",
    "row_tree_bits",
    "to_row_tiles",
    "tree_bits",
]

MAX_TREE_TOKENS = 31  # bits of a non-negative i32 word


def check_inputs(q, kv_pages, page_indices, kv_lens, q_lens, sliding_window, tree_mask,
                 positions=None) -> None:
  """Static (shape and dtype) validation; raises ``ValueError`` for caller errors."""
  if q.ndim != 4:
    raise ValueError(f"{q.shape=} must be [B, T, N, H]")
  batch, num_tokens, num_heads, head_dim = q.shape
  if kv_pages.ndim != 4 or kv_pages.shape[2] % 2 or kv_pages.shape[3] != head_dim:
    raise ValueError(f"{kv_pages.shape=} must be [num_pages, page_size, 2*K, {head_dim}]")
  num_kv_heads = kv_pages.shape[2] // 2
  if num_heads % num_kv_heads:
    raise ValueError(f"{num_heads=} must be a multiple of {num_kv_heads=}")
  if page_indices.ndim != 2 or page_indices.shape[0] != batch:
    raise ValueError(f"{page_indices.shape=} must be [{batch}, pages_per_seq]")
  for name, x in (("page_indices", page_indices), ("kv_lens", kv_lens), ("q_lens", q_lens)):
    if not jnp.issubdtype(x.dtype, jnp.integer):
      raise ValueError(f"{name}.dtype={x.dtype} must be an integer type")
  if kv_lens.shape != (batch,) or q_lens.shape != (batch,):
    raise ValueError(f"{kv_lens.shape=} and {q_lens.shape=} must be ({batch},)")
  if sliding_window is not None and int(sliding_window) < 1:
    raise ValueError(f"{sliding_window=} must be None or >= 1")
  if tree_mask is not None and tree_mask.shape != (batch, num_tokens, num_tokens):
    raise ValueError(f"{tree_mask.shape=} must be ({batch}, {num_tokens}, {num_tokens})")
  if positions is not None and positions.shape != (batch, num_tokens):
    raise ValueError(f"{positions.shape=} must be ({batch}, {num_tokens})")


def check_slot_window(name: str, sliding_window, positions) -> None:
  """Kernels measure the sliding window from KV slots; explicit query positions (tree
  verification, where a token's position is its depth, not its slot) with a window are
  left to the reference.

  Raises:
    NotImplementedError: both ``sliding_window`` and ``positions`` are set.
  """
  if sliding_window is not None and positions is not None:
    raise NotImplementedError(f"{name} measures the sliding window from KV slots; explicit "
                              "query positions with a window need the reference")


def to_row_tiles(q: jax.Array, num_kv_heads: int, rows: int) -> jax.Array:
  """``[B, T, N, H] -> [B, K, rows, H]`` with row ``t * G + g``, zero padded."""
  batch, num_tokens, num_heads, head_dim = q.shape
  group = num_heads // num_kv_heads
  x = q.reshape(batch, num_tokens, num_kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)
  x = x.reshape(batch, num_kv_heads, num_tokens * group, head_dim)
  return jnp.pad(x, ((0, 0), (0, 0), (0, rows - num_tokens * group), (0, 0)))


def from_row_tiles(o: jax.Array, num_tokens: int, num_heads: int) -> jax.Array:
  """Inverse of :func:`to_row_tiles`: ``[B, K, rows, H] -> [B, T, N, H]``."""
  batch, num_kv_heads, _, head_dim = o.shape
  group = num_heads // num_kv_heads
  o = o[:, :, : num_tokens * group].reshape(batch, num_kv_heads, num_tokens, group, head_dim)
  return o.transpose(0, 2, 1, 3, 4).reshape(batch, num_tokens, num_heads, head_dim)


def tree_bits(tree_mask: jax.Array) -> jax.Array:
  """``bool[B, T, T] -> i32[B, T]``: bit ``j`` of word ``[b, i]`` is ``tree_mask[b, i, j]``."""
  num_tokens = tree_mask.shape[-1]
  if num_tokens > MAX_TREE_TOKENS:
    raise NotImplementedError(f"tree masks need T <= {MAX_TREE_TOKENS}; got {num_tokens=}")
  weights = jnp.left_shift(jnp.int32(1), jnp.arange(num_tokens, dtype=jnp.int32))
  return jnp.sum(jnp.where(tree_mask, weights, 0), axis=-1, dtype=jnp.int32)


def row_tree_bits(tree_mask: jax.Array, group: int, rows: int) -> jax.Array:
  """Per query row bit words ``i32[B, rows]`` (row ``t * G + g`` gets token ``t``'s word)."""
  bits = jnp.repeat(tree_bits(tree_mask), group, axis=1)  # [B, T*G]
  return jnp.pad(bits, ((0, 0), (0, rows - bits.shape[1])))
