"""Explicit query positions (tree verification) in paged attention.

The reference measures the sliding window from them; slot positions give the plain
result. The Pallas kernels measure the window from KV slots, so explicit positions
with a window are a ``NotImplementedError`` (the dispatcher falls through to the
reference); without a window they are accepted and change nothing. ``copy_kv`` moves
a row's positions within its pages. (Model-level: tests/models/test_tree_forward.py.)
"""

import jax.numpy as jnp
import numpy as np
import pytest
from test_paged_attention import make_inputs

from pallas_kernels.paged_attention import (
    _backend,
    copy_kv,
    paged_attention,
    paged_attention_reference,
    query_positions,
)

KV_LENS, Q_LENS, T = [37, 20], [4, 3], 4


def _inputs():
  return make_inputs(3, kv_lens=KV_LENS, q_lens=Q_LENS, num_tokens=T, num_heads=4,
                     num_kv_heads=2, tree=True)


def test_slot_positions_change_nothing():
  x = _inputs()
  slots = query_positions(x["kv_lens"], x["q_lens"], T)
  for window in (None, 5):
    want = paged_attention_reference(**x, sm_scale=0.1, sliding_window=window)
    got = paged_attention_reference(**x, sm_scale=0.1, sliding_window=window, positions=slots)
    for b, n in enumerate(Q_LENS):
      np.testing.assert_array_equal(np.asarray(got)[b, :n], np.asarray(want)[b, :n])


def test_window_is_measured_in_positions():
  x = _inputs()
  slots = np.asarray(query_positions(x["kv_lens"], x["q_lens"], T))
  shifted = slots - 2  # every query 2 positions earlier than its slot
  full = paged_attention_reference(**x, sm_scale=0.1, sliding_window=None)
  windowed = paged_attention_reference(**x, sm_scale=0.1, sliding_window=3,
                                       positions=jnp.asarray(shifted))
  plain = paged_attention_reference(**x, sm_scale=0.1, sliding_window=3)
  assert not np.allclose(np.asarray(windowed)[0, :4], np.asarray(plain)[0, :4])
  assert not np.allclose(np.asarray(windowed)[0, :4], np.asarray(full)[0, :4])


@pytest.mark.parametrize("name", ["pallas_triton", "pallas_tpu", "pallas_gpu"])
def test_kernels_refuse_positions_with_a_window(name):
  x = _inputs()
  pos = query_positions(x["kv_lens"], x["q_lens"], T)
  with pytest.raises(NotImplementedError, match="sliding window from KV slots"):
    _backend(name)(**x, sm_scale=0.1, sliding_window=3, positions=pos, interpret=True)
  got = paged_attention(**x, sm_scale=0.1, sliding_window=3, positions=pos,
                        implementation=(name, "reference"))
  want = paged_attention_reference(**x, sm_scale=0.1, sliding_window=3, positions=pos)
  np.testing.assert_array_equal(np.asarray(got)[0, :4], np.asarray(want)[0, :4])


def test_copy_kv_moves_positions():
  x = _inputs()
  pages = x["kv_pages"]
  src = jnp.asarray([[35, 36, -1], [19, -1, -1]])
  dst = jnp.asarray([[33, 34, 30], [17, 18, -1]])
  out = np.asarray(copy_kv(pages, x["page_indices"], src, dst))
  table, page = np.asarray(x["page_indices"]), pages.shape[1]
  at = lambda arr, b, p: arr[table[b, p // page], p % page]
  np.testing.assert_array_equal(at(out, 0, 33), at(np.asarray(pages), 0, 35))
  np.testing.assert_array_equal(at(out, 0, 34), at(np.asarray(pages), 0, 36))
  np.testing.assert_array_equal(at(out, 1, 17), at(np.asarray(pages), 1, 19))
  np.testing.assert_array_equal(at(out, 0, 30), at(np.asarray(pages), 0, 30))  # -1 source
  np.testing.assert_array_equal(at(out, 1, 18), at(np.asarray(pages), 1, 18))
