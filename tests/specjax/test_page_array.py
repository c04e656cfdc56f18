"""``RequestState.page_array``: the numpy view of a row's page ids stays equal to
``pages`` through appends and cuts (the scheduler's random workloads check the same
after every operation: ``test_scheduler_properties``)."""

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
