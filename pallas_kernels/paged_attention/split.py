"""Split-KV (flash-decoding) for the GPU paged-attention kernels: block ranges and combine.

Algorithm: Dao, Haziza, Massa, Sizov (2023), "Flash-Decoding for long-context inference".
When ``B * K`` CTAs cannot fill the GPU, each ``(b, k)`` tile's KV blocks are split over
``S`` CTAs (grid ``(B, K, S)``). Split ``s`` runs the usual online softmax over its own
blocks and writes its normalized partial output ``o_s = sum_j p_j v_j / l_s`` and its
log-sum-exp ``lse_s = m_s + log(l_s)`` (natural log, f32; ``-inf`` where it saw no
visible key). :func:`combine` merges them exactly (up to f32 rounding):
``o = sum_s exp(lse_s - M) o_s / sum_s exp(lse_s - M)`` with ``M = max_s lse_s``.

The combine is a small jnp function (one XLA fusion), not a second kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["combine", "split_range"]


def split_range(split: jax.Array, num_splits: int, first: jax.Array, num_blocks: jax.Array):
  """Blocks ``[split_first, split_first + split_blocks)`` of split ``split`` (i32 scalars).

  The row's ``num_blocks`` blocks starting at ``first`` are cut into ``num_splits`` runs
  of ``ceil(num_blocks / num_splits)`` blocks; trailing splits may get fewer or none.
  Worked example: 5 blocks from block 2, 3 splits: 2 per split, so splits cover blocks
  2..3, 4..5 and 6 (one block).
  """
  per_split = lax.div(num_blocks + (num_splits - 1), jnp.int32(num_splits))
  begin = split * per_split
  split_blocks = jnp.clip(num_blocks - begin, 0, per_split)
  return first + begin, split_blocks


def combine(o_parts: jax.Array, lse_parts: jax.Array) -> jax.Array:
  """Merges split partials: ``f32[B, K, S, R, H]``, ``f32[B, K, S, R]`` -> ``f32[B, K, R, H]``.

  Rows that no split saw a key for (``lse = -inf`` everywhere: padding query rows, empty
  sequences) come out as zeros. Partials of empty splits must be finite (the kernels
  write zeros), since their weight is exactly 0.
  """
  m = jnp.max(lse_parts, axis=2, keepdims=True)
  m = jnp.where(m == -jnp.inf, 0.0, m)
  w = jnp.exp(lse_parts - m)  # [B, K, S, R]; 0 for empty splits
  den = jnp.sum(w, axis=2)
  num = jnp.sum(w[..., None] * o_parts, axis=2)
  return num / jnp.where(den > 0, den, 1.0)[..., None]
