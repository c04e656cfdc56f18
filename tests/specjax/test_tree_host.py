"""Tree helpers (``specjax.tree``) on the module docstring's worked example; the device
(jnp) arrays equal the host's on random trees."""

import numpy as np
import pytest

from specjax.tree import (
    chain_parents,
    device_tree_arrays,
    node_depths,
    path_moves,
    tree_mask,
    tree_positions,
    validate_tree,
)

PARENTS = np.array([[-1, -1, 0, 0, 2]], np.int32)  # root -> a -> c -> e, a -> d, root -> b
NUM = np.array([5], np.int32)


def test_worked_example():
  np.testing.assert_array_equal(node_depths(PARENTS, NUM), [[1, 1, 2, 2, 3]])
  np.testing.assert_array_equal(tree_positions(PARENTS, NUM, np.array([10]), 7),
                                [[10, 11, 11, 12, 12, 13, 16]])  # last: padding slot
  mask = tree_mask(PARENTS, NUM, 6)[0]
  assert np.flatnonzero(mask[5]).tolist() == [0, 1, 3, 5]  # e sees root, a, c, e
  assert np.flatnonzero(mask[2]).tolist() == [0, 2]  # b sees root, b
  src, dst, any_move = path_moves(np.array([[0, 3, -1, -1, -1]]), np.array([2]), np.array([10]))
  assert any_move
  np.testing.assert_array_equal(src, [[-1, 14, -1, -1, -1]])
  np.testing.assert_array_equal(dst, [[-1, 12, -1, -1, -1]])


def test_chain_is_causal_and_in_place():
  parents = chain_parents(2, 4)
  num = np.array([4, 2], np.int32)
  np.testing.assert_array_equal(parents[0], [-1, 0, 1, 2])
  mask = tree_mask(parents, num, 5)
  np.testing.assert_array_equal(mask[0], np.tril(np.ones((5, 5), bool)))
  np.testing.assert_array_equal(tree_positions(parents, num, np.array([3, 7]), 5),
                                [[3, 4, 5, 6, 7], [7, 8, 9, 10, 11]])
  nodes = np.array([[0, 1, 2, 3], [0, 1, -1, -1]])
  assert not path_moves(nodes, np.array([4, 2]), np.array([3, 7]))[2]


@pytest.mark.parametrize("bad", [[-1, 1, 0], [-1, 0, -2], [-1, 0, 5]])
def test_validate_tree_rejects_bad_parents(bad):
  validate_tree(np.array([[-1, 0, 1]]), np.array([3]))
  with pytest.raises(ValueError, match="must be in"):
    validate_tree(np.array([bad]), np.array([3]))
  validate_tree(np.array([bad]), np.array([1]))  # only real nodes are checked


def test_device_tree_arrays_equal_the_host_ones():
  rng = np.random.default_rng(0)
  batch, length = 6, 7
  # Random parents-first trees, ragged node counts (0 .. L), zeros past them.
  parents = np.zeros((batch, length), np.int32)
  num = rng.integers(0, length + 1, batch).astype(np.int32)
  num[0] = length
  for b in range(batch):
    for j in range(num[b]):
      parents[b, j] = rng.integers(-1, j)
  starts = rng.integers(0, 50, batch).astype(np.int32)
  for width in (length + 1, 4):  # T = L + 1, and a verify narrower than the tree
    depths, mask, pos = device_tree_arrays(parents[:, :width - 1], num.clip(0, width - 1),
                                           starts, width)
    ref_num = num.clip(0, width - 1)
    np.testing.assert_array_equal(depths, node_depths(parents[:, :width - 1], ref_num))
    np.testing.assert_array_equal(mask, tree_mask(parents[:, :width - 1], ref_num, width))
    np.testing.assert_array_equal(pos, tree_positions(parents[:, :width - 1], ref_num, starts,
                                                      width))
