"""Draft trees: validation, depths, the verify step's mask and positions (numpy on the
host; ``device_tree_arrays`` computes the same in jnp inside a fused step).

A tree draft is ``Draft.tokens i32[B, L]`` with ``Draft.parents i32[B, L]``: node j's
parent is node ``parents[j]`` or, for -1, the root (the pending token, whose KV is not
yet written). Parents come first (``-1 <= parents[j] < j``), so every prefix of the
node list is itself a tree and pruning a tree to a budget keeps its first nodes.

The verify step feeds ``[root, node_0 .. node_{L-1}]`` (step index ``t = j + 1``);
node j's KV goes to slot ``start + t`` but it sits at position ``start + depth(j)``,
where ``start`` is the root's position (= the committed KV length). Worked example:

  parents [-1, -1, 0, 0, 2], tokens [a, b, c, d, e], start 10
  tree:   root -> a -> c -> e,  root -> a -> d,  root -> b
  depths  [1, 1, 2, 2, 3];  step positions [10, 11, 11, 12, 12, 13]
  mask row of e (t = 5): root, a, c, e  -> t in {0, 1, 3, 5}

A chain is the tree ``parents = [-1, 0, 1, ..]`` (``chain_parents``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "chain_parents",
    "device_tree_arrays",
    "node_depths",
    "path_moves",
    "tree_mask",
    "tree_positions",
    "validate_tree",
]


def chain_parents(num_rows: int, length: int) -> np.ndarray:
  """``i32[num_rows, length]`` parents of a chain: ``[-1, 0, 1, .., length - 2]``."""
  return np.broadcast_to(np.arange(-1, length - 1, dtype=np.int32), (num_rows, length)).copy()


def validate_tree(parents: np.ndarray, num_nodes: np.ndarray) -> None:
  """Checks that every real node's parent is the root or an earlier node.

  Args:
    parents: ``i32[B, L]``.
    num_nodes: ``i32[B]`` real nodes per row (``<= L``).

  Raises:
    ValueError: wrong shapes, or ``parents[b, j]`` outside ``[-1, j)`` for a real node.
  """
  parents = np.asarray(parents)
  if parents.ndim != 2 or np.asarray(num_nodes).shape != parents.shape[:1]:
    raise ValueError(f"parents shape={parents.shape} must be [B, L] with num_nodes of "
                     f"shape [B]; got {np.asarray(num_nodes).shape}")
  j = np.arange(parents.shape[1])[None]
  real = j < np.asarray(num_nodes)[:, None]
  bad = real & ((parents < -1) | (parents >= j))
  if bad.any():
    b, node = (int(x[0]) for x in np.nonzero(bad))
    raise ValueError(f"tree parents[{b}, {node}]={int(parents[b, node])} must be in "
                     f"[-1, {node}) (parents before children; -1 = the root)")


def node_depths(parents: np.ndarray, num_nodes: np.ndarray) -> np.ndarray:
  """``i32[B, L]`` depth of each real node (children of the root have depth 1), 0 for
  padding. Assumes ``validate_tree`` passed."""
  batch, length = parents.shape
  depths = np.zeros((batch, length), np.int32)
  rows = np.arange(batch)
  for j in range(length):
    par = parents[:, j]
    d = np.where(par < 0, 1, depths[rows, np.maximum(par, 0)] + 1)
    depths[:, j] = np.where(j < num_nodes, d, 0)
  return depths


def tree_mask(parents: np.ndarray, num_nodes: np.ndarray, num_tokens: int) -> np.ndarray:
  """``bool[B, T, T]`` of the verify step: step token t sees t' iff t' is t's ancestor
  or t itself (the root is token 0). Padding tokens see only themselves."""
  batch, length = parents.shape
  mask = np.zeros((batch, num_tokens, num_tokens), bool)
  idx = np.arange(num_tokens)
  mask[:, idx, idx] = True
  mask[:, :, 0] = True
  for j in range(min(length, num_tokens - 1)):
    real = j < num_nodes
    par = np.maximum(parents[:, j], -1) + 1  # the parent's step index
    inherited = mask[np.arange(batch), par]  # [B, T]
    mask[:, j + 1] = np.where(real[:, None], inherited | (idx == j + 1), mask[:, j + 1])
  return mask


def tree_positions(parents: np.ndarray, num_nodes: np.ndarray, starts: np.ndarray,
                   num_tokens: int) -> np.ndarray:
  """``i32[B, T]`` positions of the verify step: ``starts[b] + depth`` for the root
  (depth 0) and real nodes; padding tokens get their slot position ``starts[b] + t``."""
  batch, length = parents.shape
  offset = np.broadcast_to(np.arange(num_tokens, dtype=np.int32), (batch, num_tokens)).copy()
  depths = node_depths(parents, num_nodes)
  n = min(length, num_tokens - 1)
  real = np.arange(n)[None] < np.asarray(num_nodes)[:, None]
  offset[:, 1: 1 + n] = np.where(real, depths[:, :n], offset[:, 1: 1 + n])
  return (np.asarray(starts, np.int32)[:, None] + offset).astype(np.int32)


def path_moves(accepted_nodes: np.ndarray, num_accepted: np.ndarray, starts: np.ndarray):
  """KV copies that make an accepted tree path contiguous.

  The node accepted at depth i (1-based) was written at slot ``start + node + 1`` and
  belongs at ``start + i``. Example (the module's tree, start 10): path a, d = nodes
  [0, 3]; a is at slot 11 = 10 + 1 (in place), d at slot 14 belongs at 12: one move
  14 -> 12.

  Args:
    accepted_nodes: ``i32[B, L]`` node indices along the accepted path, -1 padded.
    num_accepted: ``i32[B]`` path lengths.
    starts: ``i32[B]`` root positions.

  Returns:
    ``(src i32[B, L], dst i32[B, L], any_move bool)``: positions to copy, -1 where the
    node is already in place or past the path.
  """
  batch, length = accepted_nodes.shape
  depth = np.arange(1, length + 1, dtype=np.int32)[None]
  on_path = depth <= np.asarray(num_accepted)[:, None]
  src = np.asarray(starts, np.int32)[:, None] + accepted_nodes + 1
  dst = np.asarray(starts, np.int32)[:, None] + depth
  move = on_path & (src != dst)
  return (np.where(move, src, -1).astype(np.int32), np.where(move, dst, -1).astype(np.int32),
          bool(move.any()))


def device_tree_arrays(parents: jax.Array, num_nodes: jax.Array, starts: jax.Array,
                       num_tokens: int):
  """``node_depths``, ``tree_mask`` and ``tree_positions`` in jnp (traceable), for tree
  drafts made on the device (a fused proposer's ``DeviceDraft.parents``).

  Args:
    parents: ``i32[B, L]`` (valid for the first ``num_nodes`` nodes of each row).
    num_nodes: ``i32[B]`` real nodes per row.
    starts: ``i32[B]`` root positions.
    num_tokens: T = L + 1, the verify step's width (static).

  Returns:
    ``(depths i32[B, L], mask bool[B, T, T], positions i32[B, T])``, equal to the numpy
    functions' results.
  """
  batch, length = parents.shape
  idx = jnp.arange(num_tokens)
  mask = jnp.broadcast_to((idx[:, None] == idx[None]) | (idx[None] == 0),
                          (batch, num_tokens, num_tokens))
  depths = jnp.zeros((batch, length), jnp.int32)
  rows = jnp.arange(batch)
  for j in range(min(length, num_tokens - 1)):  # static: straight-line code
    real = j < num_nodes
    par = jnp.maximum(parents[:, j], -1)
    d = jnp.where(par < 0, 1, depths[rows, jnp.maximum(par, 0)] + 1)
    depths = depths.at[:, j].set(jnp.where(real, d, 0))
    inherited = mask[rows, par + 1]  # [B, T]
    mask = mask.at[:, j + 1].set(jnp.where(real[:, None], inherited | (idx == j + 1)[None],
                                           mask[:, j + 1]))
  offset = jnp.broadcast_to(idx.astype(jnp.int32), (batch, num_tokens))
  n = min(length, num_tokens - 1)
  real = jnp.arange(n)[None] < num_nodes[:, None]
  offset = offset.at[:, 1:1 + n].set(jnp.where(real, depths[:, :n], offset[:, 1:1 + n]))
  return depths, mask, (starts.astype(jnp.int32)[:, None] + offset).astype(jnp.int32)
