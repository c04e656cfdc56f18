"""``methods.ngram_device.ngram_lookup_device`` against the host oracle
``methods.ngram.ngram_lookup``: hand cases, then random rows over a small vocabulary."""

import functools

import jax
import numpy as np
import pytest

from methods.ngram import ngram_lookup
from methods.ngram_device import ngram_lookup_device


def _oracle(seq, budget, *, k, n_min, n_max):
  """The host drafts for one row, with budgets applied as ``NGram.propose`` does."""
  if budget <= 0:
    return np.zeros(0, np.int32)
  return ngram_lookup(np.asarray(seq, np.int32), n_min, n_max, min(k, budget))


def _check(seqs, budgets, *, k, n_min, n_max, capacity=None, garbage=None, seed=0):
  """Packs ``seqs`` into one ``[B, M]`` history (garbage after each row), runs the jitted
  device lookup once and compares every row with the oracle."""
  rng = np.random.default_rng(seed)
  capacity = capacity or max(1, max(len(s) for s in seqs))
  if garbage is None:
    history = rng.integers(-1, 5, (len(seqs), capacity), dtype=np.int32)
  else:
    history = np.full((len(seqs), capacity), garbage, np.int32)
  for b, s in enumerate(seqs):
    history[b, : len(s)] = s
  num_tokens = np.array([len(s) for s in seqs], np.int32)
  fn = jax.jit(functools.partial(ngram_lookup_device, k=k, n_min=n_min, n_max=n_max))
  drafts, num = jax.device_get(fn(history, num_tokens, np.asarray(budgets, np.int32)))
  assert drafts.shape == (len(seqs), k) and drafts.dtype == np.int32
  assert num.shape == (len(seqs),) and num.dtype == np.int32
  for b, s in enumerate(seqs):
    want = _oracle(s, int(budgets[b]), k=k, n_min=n_min, n_max=n_max)
    assert num[b] == len(want), (b, list(s), budgets[b], drafts[b], want)
    np.testing.assert_array_equal(drafts[b, : num[b]], want, err_msg=f"row {b}: {list(s)}")
    assert (drafts[b, num[b]:] == -1).all(), (b, drafts[b])
  return drafts, num


def test_docstring_example():
  drafts, num = _check([[5, 6, 7, 9, 5, 6]], [3], k=3, n_min=2, n_max=2)
  assert num.tolist() == [3] and drafts.tolist() == [[7, 9, 5]]


@pytest.mark.parametrize("garbage", [-1, None])
def test_hand_cases(garbage):
  seqs = [
      [5, 6, 7, 9, 5, 6],  # docstring example: n = 2 at index 0
      [1, 2, 3, 1],  # n = 1 match at index 0
      [1, 1, 1, 1, 1],  # overlapping self-repeat: the largest n leaves one token
      [1, 1],
      [1, 2],  # no match
      [7],  # len 1: no n fits
      [],  # inactive row
      [3, 4, 5, 3, 4, 9, 3, 4, 5],  # n = 3 wins over the later n = 2 match
      [2, 9, 2, 8, 2],  # the LATEST n = 1 match (index 2) is used
      [4, 4, 4, 4, 4, 4, 4, 4],  # long self-repeat with n = n_max
  ]
  for budget in (-2, 0, 1, 2, 100):
    _check(seqs, [budget] * len(seqs), k=4, n_min=1, n_max=3, capacity=12, garbage=garbage)
  # k larger than what is left after the match, and per-row budgets.
  _check(seqs, list(range(-1, len(seqs) - 1)), k=8, n_min=1, n_max=4, capacity=10,
         garbage=garbage)
  # n_min = 2 rejects the n = 1-only rows; n_max larger than any row.
  _check(seqs, [5] * len(seqs), k=3, n_min=2, n_max=16, capacity=9, garbage=garbage)


def test_expected_values():
  seqs = [[1, 1, 1, 1, 1], [1, 2, 3, 1], [2, 9, 2, 8, 2], [1, 2], [], [7]]
  drafts, num = _check(seqs, [4] * len(seqs), k=4, n_min=1, n_max=4, capacity=6)
  assert num.tolist() == [1, 3, 2, 0, 0, 0]
  assert drafts[:3].tolist() == [[1, -1, -1, -1], [2, 3, 1, -1], [8, 2, -1, -1]]


def test_capacity_one_and_full_rows():
  _check([[3], []], [4, 4], k=2, n_min=1, n_max=3, capacity=1)
  _check([[1, 2, 1, 2, 1, 2]], [9], k=5, n_min=1, n_max=3, capacity=6)  # len == M


@pytest.mark.parametrize(
    "k,n_min,n_max,vocab",
    [(4, 2, 4, 3), (1, 1, 1, 2), (5, 3, 3, 4), (7, 1, 5, 6), (3, 2, 2, 3), (6, 1, 3, 5)],
)
def test_random_rows_match_host(k, n_min, n_max, vocab):
  rng = np.random.default_rng(k * 100 + n_min * 10 + n_max)
  rows, capacity = 300, 48
  lengths = rng.integers(0, capacity + 1, rows)
  lengths[:20] = rng.integers(0, 4, 20)  # plenty of very short rows
  seqs = [rng.integers(0, vocab, n).tolist() for n in lengths]
  budgets = rng.integers(-2, k + 3, rows)
  _check(seqs, budgets, k=k, n_min=n_min, n_max=n_max, capacity=capacity, seed=vocab)


def test_rejects_bad_static_args():
  args = (np.zeros((1, 4), np.int32), np.ones(1, np.int32), np.ones(1, np.int32))
  with pytest.raises(ValueError):
    ngram_lookup_device(*args, k=0, n_min=1, n_max=2)
  with pytest.raises(ValueError):
    ngram_lookup_device(*args, k=2, n_min=3, n_max=2)
