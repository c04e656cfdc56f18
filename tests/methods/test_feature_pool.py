"""``methods.learned``'s device feature pool: writes land at the rows' KV positions and
the window gather returns the host path's right-aligned layout (literal example)."""

import jax.numpy as jnp
import numpy as np

from methods.learned import feature_window, write_features

PAGE = 4


def test_write_then_window_literal():
  # Two rows; row 0 owns pages [2, 0], row 1 owns page [1] (pool of 3 pages x 4).
  feats = jnp.zeros((3 * PAGE, 1), jnp.float32)
  table = jnp.asarray([[2, 0], [1, -1]], jnp.int32)
  # Prefill: row 0 positions 0..4 (q 5, kv 5), row 1 positions 0..1; feature = 10*row + pos.
  hidden = jnp.asarray([[[0.], [1.], [2.], [3.], [4.], [9.]],
                        [[10.], [11.], [99.], [99.], [99.], [99.]]])
  feats = write_features(feats, table, jnp.asarray([5, 2]), jnp.asarray([5, 2]), (hidden,),
                         page_size=PAGE)
  pool = np.asarray(feats)[:, 0]
  # Row 0: positions 0-3 on page 2 (rows 8-11), position 4 on page 0 (row 0); row 1 on page 1.
  assert pool.tolist() == [4, 0, 0, 0, 10, 11, 0, 0, 0, 1, 2, 3]
  # A verify write at row 0 positions 5..6 (kv 7, q 2) and an inactive row 1 (q 0).
  step = jnp.asarray([[[5.], [6.]], [[77.], [77.]]])
  feats = write_features(feats, table, jnp.asarray([7, 0]), jnp.asarray([2, 0]), (step,),
                         page_size=PAGE)
  assert np.asarray(feats)[:3, 0].tolist() == [4, 5, 6]
  # Window 4 of row 0 with 7 committed tokens (pending x_6): features f_2..f_5 paired
  # with tokens x_3..x_6; row 1 with 2 tokens: one real slot (f_0, x_1), the rest zeros.
  tokens = jnp.asarray([[100, 101, 102, 103, 104, 105, 106, 0],
                        [200, 201, 0, 0, 0, 0, 0, 0]], jnp.int32)
  toks, f, num_valid, pos = feature_window(feats, table, tokens, jnp.asarray([7, 2]), 4,
                                           page_size=PAGE)
  assert np.asarray(toks).tolist() == [[103, 104, 105, 106], [0, 0, 0, 201]]
  assert np.asarray(f)[..., 0].tolist() == [[2, 3, 4, 5], [0, 0, 0, 10]]
  assert np.asarray(num_valid).tolist() == [4, 1] and np.asarray(pos).tolist() == [5, 0]
