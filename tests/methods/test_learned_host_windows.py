"""``methods.learned``'s host-called path keeps its feature windows on the device
(``append_windows`` / ``gather_windows``, a per-request slot pool): the head gets the
window the earlier host-numpy window gave it (every feature row kept, right-aligned,
zeros before the first), which is also the device path's ``feature_window`` of the
same features, through slot reuse, restarts (preemption), one-token prompts and growth
of the pool.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import methods.learned as learned
from methods.eagle3 import Eagle3
from methods.learned import append_windows, feature_window, gather_windows, write_features
from models.testing import random_model, tiny_config
from specjax.method import PrefillResult, ProposeContext, RuntimeInfo, VerifyResult
from specjax.steps import split_model

jax.config.update("jax_default_matmul_precision", "highest")

WINDOW = 4
PAGE = 4
PAGES_PER_SEQ = 4  # the device-path pool: request i owns pages 4i .. 4i + 3


def test_append_windows_literal():
  # Slots of 3 rows x 1 feature; row 0 -> slot 1 appends 2 of its 3 hidden rows, row 1
  # -> slot 0 restarts with 1 row, row 2 is padding (-1, writes nothing).
  windows = jnp.asarray([[[7.], [8.], [9.]], [[1.], [2.], [3.]], [[5.], [5.], [5.]]])
  hidden = jnp.asarray([[[4.], [6.], [99.]], [[10.], [99.], [99.]], [[77.], [77.], [77.]]])
  out = append_windows(windows, jnp.asarray([1, 0, -1]), (hidden,), jnp.asarray([2, 1, 3]),
                       jnp.asarray([False, True, False]))
  assert np.asarray(out)[..., 0].tolist() == [[0, 0, 10], [3, 4, 6], [5, 5, 5]]
  got = gather_windows(out, jnp.asarray([2, -1, 1]))
  assert got.dtype == jnp.float32
  assert np.asarray(got)[..., 0].tolist() == [[5, 5, 5], [0, 0, 0], [3, 4, 6]]


@pytest.fixture(scope="module")
def target():
  return split_model(random_model(tiny_config("llama"), seed=0))


class _Scenario:
  """Drives one method's host path and keeps two references of every feature row: the
  earlier host layout (a list of rows per request) and a paged device ``FeaturePool``."""

  def __init__(self, target, method, monkeypatch):
    self.cfg = target.config
    runtime = RuntimeInfo(target=target, draft=None, num_pages=64, page_size=PAGE,
                          max_model_len=PAGE * PAGES_PER_SEQ, attention_implementation=None,
                          max_num_seqs=1)  # capacity 1: the slot pool must grow
    self.method, self.state = method, method.init_state(runtime)
    self.rng = np.random.default_rng(0)
    self.seqs, self.rows, self.index = {}, {}, {}
    self.pool = jnp.zeros((64 * PAGE, 3 * self.cfg.hidden_size), jnp.float32)
    self.calls = []
    real = learned.head_draft_step

    def spy(*args, **kw):
      self.calls.append([np.asarray(a) for a in args[4:8]])  # tokens, feats, valid, positions
      return real(*args, **kw)

    monkeypatch.setattr(learned, "head_draft_step", spy)

  def _table(self, rids, batch):
    table = np.full((batch, PAGES_PER_SEQ), -1, np.int32)
    for b, rid in enumerate(rids):
      table[b] = PAGES_PER_SEQ * self.index[rid] + np.arange(PAGES_PER_SEQ)
    return table

  def _hidden(self, batch, width):
    return tuple(jnp.asarray(self.rng.standard_normal((batch, width, self.cfg.hidden_size)),
                             jnp.float32) for _ in range(3))

  def _record(self, rids, starts, nums, hidden):
    """Both references take row b's ``nums[b]`` rows at positions ``starts[b] ..``."""
    feats = np.concatenate([np.asarray(h) for h in hidden], -1)
    for b, rid in enumerate(rids):
      if starts[b] == 0:
        self.rows[rid] = []
      self.rows[rid] += list(feats[b, : nums[b]])
    batch = hidden[0].shape[0]
    kv = np.zeros(batch, np.int32)
    q = np.zeros(batch, np.int32)
    kv[: len(rids)], q[: len(rids)] = np.add(starts, nums), nums
    self.pool = write_features(self.pool, self._table(rids, batch), kv, q, hidden,
                               page_size=PAGE)

  def prefill(self, rids, lens, batch=4, width=8):
    """Prefill of each request's whole prompt (``lens`` tokens, the last pending): a new
    request, or one restarted after preemption (its tokens so far)."""
    for rid, n in zip(rids, lens):
      self.index.setdefault(rid, len(self.index))
      if rid not in self.seqs:
        self.seqs[rid] = list(self.rng.integers(0, self.cfg.vocab_size, n))
      assert len(self.seqs[rid]) == n
    hidden = self._hidden(batch, width)
    nums = [n - 1 for n in lens]
    self.state = self.method.observe_prefill(self.state, PrefillResult(
        list(rids), np.zeros(len(rids), np.int32), np.asarray(nums, np.int32), hidden))
    self._record(rids, [0] * len(rids), nums, hidden)

  def propose(self, rids, batch=4):
    """One greedy ``propose``: checks the head's inputs against both references."""
    for rid in rids:
      self.index.setdefault(rid, len(self.index))
      self.seqs.setdefault(rid, [int(self.rng.integers(0, self.cfg.vocab_size))])
    f32 = np.zeros(batch, np.float32)
    ctx = ProposeContext(list(rids), [np.asarray(self.seqs[r], np.int32) for r in rids],
                         np.full(len(rids), 3, np.int32), self._table(rids, batch), f32,
                         np.zeros(batch, np.int32), np.ones(batch, np.float32),
                         np.zeros((batch, 2), np.uint32))
    before = len(self.calls)
    self.state, draft = self.method.propose(self.state, ctx)
    assert len(self.calls) == before + 1
    toks, feats, valid, positions = self.calls[-1]
    assert feats.dtype == np.float32 and feats.shape == (batch, WINDOW, 3 * self.cfg.hidden_size)
    tokens = np.zeros((batch, PAGE * PAGES_PER_SEQ), np.int32)
    lens = np.zeros(batch, np.int32)
    for b, rid in enumerate(rids):
      tokens[b, : len(self.seqs[rid])], lens[b] = self.seqs[rid], len(self.seqs[rid])
    dev = [np.asarray(a) for a in feature_window(self.pool, self._table(rids, batch), tokens,
                                                 lens, WINDOW, page_size=PAGE)]
    for b, rid in enumerate(rids):
      rows, seq = self.rows.get(rid, []), self.seqs[rid]
      n = min(len(rows), WINDOW)
      want = np.zeros_like(feats[b])
      if n:
        want[WINDOW - n:] = np.stack(rows[-n:])
      np.testing.assert_array_equal(feats[b], want, err_msg=rid)  # the earlier host window
      if not n:  # a one-token prompt: nothing drafted
        assert draft.num_tokens[b] == 0 and not feats[b].any()
        continue
      assert toks[b, WINDOW - n:].tolist() == seq[len(seq) - n:], rid
      assert (valid[b], positions[b]) == (n, len(seq) - 2), rid
      for got, d in zip((toks, feats, valid, positions), dev):  # the device path's window
        np.testing.assert_array_equal(got[b], d[b], err_msg=rid)
    return draft

  def observe(self, rids, emitted, finished=(), batch=4, width=4):
    """One verify step: ``emitted[b]`` tokens committed for ``rids[b]``."""
    hidden = self._hidden(batch, width)
    out = [list(self.rng.integers(0, self.cfg.vocab_size, e)) for e in emitted]
    starts = [len(self.seqs[r]) - 1 for r in rids]
    self.state = self.method.observe(self.state, VerifyResult(
        list(rids), np.zeros(len(rids), np.int32), out, frozenset(finished), hidden))
    self._record(rids, starts, emitted, hidden)
    for rid, toks in zip(rids, out):
      self.seqs[rid] += toks


def test_host_windows_match_the_earlier_host_layout_and_the_device_path(target, monkeypatch):
  method = Eagle3(k=3, feature_layers=(1, 2, 2), window=WINDOW, fused=False)
  s = _Scenario(target, method, monkeypatch)
  s.prefill(["r0", "r1"], [6, 3])
  s.propose(["r0", "r1"])
  s.observe(["r0", "r1"], [3, 1])
  s.propose(["r0", "r1"])  # r0 has 8 features: its window holds the last 4
  slot_r0 = s.state.slots["r0"]
  s.observe(["r0", "r1"], [2, 4], finished={"r0"})
  assert "r0" not in s.state.slots and "r0" not in s.state.num_feats
  # r2 takes r0's freed slot (restarted from zeros); r1 is preempted and recomputed.
  s.prefill(["r2", "r1"], [3, len(s.seqs["r1"])])
  assert s.state.slots["r2"] == slot_r0
  s.propose(["r1", "r2", "r3"])  # r3: a one-token prompt, no prefill, no feature yet
  s.observe(["r1", "r2", "r3"], [2, 1, 3])  # r3 takes a third slot: the pool grows
  assert s.state.windows.shape[0] >= 3 and len(set(s.state.slots.values())) == 3
  assert s.state.windows.dtype == jnp.dtype(target.config.dtype)
  s.propose(["r1", "r2", "r3"])
  s.observe(["r1", "r2", "r3"], [1, 1, 1], finished={"r1", "r2", "r3"})
  assert not s.state.slots and len(s.state.free) == s.state.windows.shape[0]


def test_fused_runs_allocate_no_host_windows(target):
  """``init_state`` also runs for fused runs: the slot pool is only made on first use."""
  runtime = RuntimeInfo(target=target, draft=None, num_pages=8, page_size=PAGE,
                        max_model_len=32, attention_implementation=None, max_num_seqs=4)
  state = Eagle3(k=3, feature_layers=(1, 2, 2), window=WINDOW).init_state(runtime)
  assert state.windows is None and state.capacity == 4
