"""``AttentionMetadata``: the batch description the paged-attention kernels (and the model
calls that run them) read. Owned by the kernel it describes."""

from __future__ import annotations

import dataclasses

import jax

__all__ = ["AttentionMetadata"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
  """What a device step knows about the batch (see ``pallas_kernels.paged_attention``).

  Attributes:
    page_indices: ``i32[B, pages_per_seq]``, -1 padded.
    kv_lens: ``i32[B]`` KV length after this step's tokens are written (0 for padding rows).
    q_lens: ``i32[B]`` real query tokens of each row (0 for padding rows).
    tree_mask: optional ``bool[B, T, T]`` among the step's tokens (tree verification):
      ``tree_mask[b, i, j]`` lets token i see token j (its ancestors and itself).
    positions: optional ``i32[B, T]`` absolute (RoPE) positions of the query tokens;
      None means their KV slots ``kv_lens - q_lens + t``. Tree verification writes node
      t at slot ``start + t`` but places it at position ``start + depth(t)``, e.g. a
      root x with children a, b and a's child c at start 10: slots 10..13, positions
      [10, 11, 11, 12].
  """

  page_indices: jax.Array
  kv_lens: jax.Array
  q_lens: jax.Array
  tree_mask: jax.Array | None = None
  positions: jax.Array | None = None
