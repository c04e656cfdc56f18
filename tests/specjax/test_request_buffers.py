"""``RequestState.page_array`` and ``token_array``: the numpy views stay equal to
``pages`` and ``tokens`` through appends and cuts (the scheduler's random workloads check
``page_array`` after every operation too: ``test_scheduler_properties``)."""

import numpy as np

from specjax.request import Request, RequestState


def _state(n_prompt=5):
  return RequestState(Request("r", tuple(range(1, n_prompt + 1))), np.zeros(2, np.uint32),
                      list(range(1, n_prompt + 1)))


def test_page_array_follows_appends_and_cuts():
  st = _state()
  st.add_pages([4, 9])
  np.testing.assert_array_equal(st.page_array(), [4, 9])
  st.add_pages(list(range(20, 60)))  # grows the buffer past its first size
  np.testing.assert_array_equal(st.page_array(), [4, 9, *range(20, 60)])
  assert st.drop_pages(1) == [9, *range(20, 60)]
  # Cut, then appended back to a longer length with other ids: no stale id survives.
  st.add_pages([7, 7, 3])
  np.testing.assert_array_equal(st.page_array(), [4, 7, 7, 3])
  assert st.page_array().dtype == np.int32
  # Cut, then appended back to the same length with other ids.
  assert st.drop_pages(2) == [7, 3]
  st.add_pages([5, 6])
  np.testing.assert_array_equal(st.page_array(), [4, 7, 5, 6])
  assert st.drop_pages() == [4, 7, 5, 6] and st.page_array().shape == (0,)
  st.pages.append(11)  # a bare append without add_pages is copied too
  np.testing.assert_array_equal(st.page_array(), [11])


def test_token_array_follows_appends_and_replacements():
  st = _state(3)
  np.testing.assert_array_equal(st.token_array(), [1, 2, 3])
  st.tokens.extend(range(10, 200))  # grows past the first buffer
  np.testing.assert_array_equal(st.token_array(), [1, 2, 3, *range(10, 200)])
  st.tokens[:] = [9, 8]  # replaced by a shorter list: copied afresh
  np.testing.assert_array_equal(st.token_array(), [9, 8])
  st.tokens.append(7)
  arr = st.token_array()
  np.testing.assert_array_equal(arr, [9, 8, 7])
  assert arr.dtype == np.int32
