"""Host tree helpers (``specjax.tree``) on the module docstring's worked example."""

import numpy as np
import pytest

from specjax.tree import (
    chain_parents,
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
