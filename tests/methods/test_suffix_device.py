"""The device suffix drafter (``methods.suffix_device``) against its host oracle
(``methods.suffix.SuffixTree``): the same path drafts for random local histories and
for a global cache built by the same sequence of slot admissions, commits and releases."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from methods.suffix import GlobalCache, SuffixDecoding, SuffixDraft, SuffixTree
from methods.suffix_device import (
    global_corpus,
    init_suffix_state,
    release_slots,
    reset_slots,
    spec_caps,
    suffix_draft_device,
)


def _host(tree_local, cache, seq, budget, depth, factor, offset, min_prob, use_global):
  """What ``SuffixDecoding.speculate`` drafts for one row."""
  if budget <= 0:
    return []
  args = (budget, factor, offset, min_prob, False)
  best = tree_local.speculate(seq, *args)
  if use_global:
    other = cache.tree.speculate(seq, *args)
    if not best.better_or_equal(other):
      best = other
  return best.tokens


@pytest.mark.parametrize("depth, k, vocab, factor, offset, min_prob", [
    (4, 3, 3, 1.0, 0.0, 0.1),  # vLLM's rule at a small depth
    (6, 4, 2, 1.0, 1.0, 0.0),  # every continuation kept; longer paths than the match
    (8, 5, 4, 0.5, 0.0, 0.3),
])
def test_local_drafts_equal_host(depth, k, vocab, factor, offset, min_prob):
  rng = np.random.default_rng(depth)
  rows, m = 4, 48
  caps = spec_caps(depth, factor, offset)
  draft = jax.jit(functools.partial(suffix_draft_device, k=k, depth=depth, caps=caps,
                                    min_token_prob=min_prob, vocab_size=vocab))
  for _ in range(12):
    lens = rng.integers(1, m + 1, rows).astype(np.int32)
    toks = rng.integers(0, vocab, (rows, m)).astype(np.int32)
    budgets = rng.integers(-1, k + 1, rows).astype(np.int32)
    got, num = map(np.asarray, draft(toks, lens, budgets))
    for b in range(rows):
      tree = SuffixTree(depth)
      seq = list(toks[b, :lens[b]])
      tree.extend(0, seq)
      want = _host(tree, None, seq, min(k, budgets[b]), depth, factor, offset, min_prob, False)
      assert list(got[b, :num[b]]) == want, (seq, budgets[b])
      assert (got[b, num[b]:] == -1).all()


def test_worked_example_ties_go_to_the_latest_occurrence():
  # The host module's example: ``a b a b c``, context ``.. a b`` drafts ``c``.
  a, b, c = 1, 2, 3
  toks = np.asarray([[a, b, a, b, c, a, b]], np.int32)
  got, num = suffix_draft_device(toks, np.asarray([7], np.int32), np.asarray([4], np.int32),
                                 k=4, depth=24, caps=spec_caps(24, 1.0, 0.0),
                                 min_token_prob=0.1, vocab_size=4)
  tree = SuffixTree(24)
  tree.extend(0, [a, b, a, b, c, a, b])
  host = tree.speculate([a, b, a, b, c, a, b], 4, 1.0, 0.0, 0.1, False)
  assert list(np.asarray(got)[0, : int(num[0])]) == host.tokens
  fresh = SuffixTree(24)
  fresh.extend(0, [a, b, a, b, c])
  d = fresh.speculate([9, a, b], 4, 1.0, 0.0, 0.1, False)
  assert d.tokens == [c] and d.match_len == 2 and (d.score_num, d.score_den) == (1, 2)


@pytest.mark.parametrize("max_cached", [-1, 2])
def test_global_drafts_equal_host(max_cached):
  """Slots admit requests, commit tokens and release them (finished responses move to
  the archive); after every event the device drafts equal the host's local + global
  trees', with the same response ids and FIFO."""
  depth, k, vocab, slots_n, m, archive = 5, 3, 3, 3, 32, 256
  rng = np.random.default_rng(7)
  caps = spec_caps(depth, 1.0, 0.0)
  draft = jax.jit(functools.partial(suffix_draft_device, k=k, depth=depth, caps=caps,
                                    min_token_prob=0.1, vocab_size=vocab))
  corpus = jax.jit(functools.partial(global_corpus, max_cached_requests=max_cached))
  state = init_suffix_state(slots_n, archive)
  cache = GlobalCache(SuffixTree(depth), max_cached)
  slot_tokens = np.zeros((slots_n, m), np.int32)
  slot_len = np.zeros(slots_n, np.int32)
  live = {}  # slot -> (local tree, host response id)
  for _ in range(40):
    free = [s for s in range(slots_n) if s not in live]
    if free and rng.random() < 0.4:  # admit a request (prompt + first token)
      s = free[0]
      n = int(rng.integers(2, 8))
      slot_tokens[s, :n] = rng.integers(0, vocab, n)
      slot_len[s] = n
      tree = SuffixTree(depth)
      tree.extend(0, slot_tokens[s, :n])
      live[s] = (tree, cache.new_sequence())
      state = reset_slots(state, jnp.asarray([s, -1], jnp.int32),
                          jnp.asarray([n, 0], jnp.int32), max_cached)
    elif live and rng.random() < 0.25:  # release (finish) a request
      s = sorted(live)[int(rng.integers(len(live)))]
      del live[s]
      state = release_slots(state, jnp.asarray(slot_tokens), jnp.asarray([s], jnp.int32),
                            jnp.asarray([slot_len[s]], jnp.int32))
    else:  # every live slot commits 1-3 tokens (in slot order, as a step's rows)
      for s in sorted(live):
        add = min(int(rng.integers(1, 4)), m - slot_len[s])
        new = rng.integers(0, vocab, add)
        slot_tokens[s, slot_len[s]: slot_len[s] + add] = new
        slot_len[s] += add
        live[s][0].extend(0, new)
        cache.append(live[s][1], new)
    if not live:
      continue
    rows = sorted(live)
    budgets = np.full(len(rows), k, np.int32)
    g = corpus(state, jnp.asarray(slot_tokens), jnp.asarray(slot_len))
    got, num = map(np.asarray, draft(slot_tokens[rows], slot_len[rows], budgets, g))
    for i, s in enumerate(rows):
      seq = list(slot_tokens[s, :slot_len[s]])
      want = _host(live[s][0], cache, seq, k, depth, 1.0, 0.0, 0.1, True)
      assert list(got[i, :num[i]]) == want, (s, seq)


def test_release_wraps_to_the_archive_start():
  state = init_suffix_state(2, 8)
  slot_tokens = jnp.asarray([[9, 9, 1, 2, 3, 4], [9, 5, 6, 7, 8, 0]], jnp.int32)
  state = reset_slots(state, jnp.asarray([0, 1], jnp.int32), jnp.asarray([2, 1], jnp.int32), -1)
  state = release_slots(state, slot_tokens, jnp.asarray([0], jnp.int32), jnp.asarray([6]))
  assert list(np.asarray(state.archive_tokens)) == [1, 2, 3, 4, -1, -1, -1, -1]
  state = release_slots(state, slot_tokens, jnp.asarray([1], jnp.int32), jnp.asarray([5]))
  # 4 tokens + separator do not fit after position 5: written from 0 over the oldest.
  assert list(np.asarray(state.archive_tokens)) == [5, 6, 7, 8, -1, -1, -1, -1]
  assert list(np.asarray(state.archive_seq))[:4] == [1] * 4
  assert list(np.asarray(state.slot_seq)) == [-1, -1]


def test_method_runs_fused_off_the_cpu_and_host_for_trees():
  auto = "host" if jax.default_backend() == "cpu" else "fused"
  assert SuffixDecoding().capabilities().runs_on == auto
  assert SuffixDecoding().describe()["runs_on"] == auto
  assert SuffixDecoding(device=True).capabilities().runs_on == "fused"
  assert SuffixDecoding(device=False).capabilities().runs_on == "host"
  assert SuffixDecoding(tree=True, device=True).capabilities().runs_on == "host"
  with pytest.raises(ValueError, match="device_cache_tokens"):
    SuffixDecoding(device_cache_tokens=0)
  assert SuffixDraft().better_or_equal(SuffixDraft())
  assert SuffixDecoding().archive_tokens(32) == 256
  assert SuffixDecoding().archive_tokens(4096) == 8192
  assert SuffixDecoding(device_cache_tokens=100).archive_tokens(4096) == 100


@pytest.mark.parametrize("seq, depth, k, offset, min_prob", [
    # Counts near 20,000 on a 12-token path: sum(count) * c0 passes 2^32 (u32 products
    # of whole fractions overflowed here; whole parts and remainders do not).
    ([0] * 20000, 24, 16, 0.0, 0.1),
    # min_token_prob one f32 rounding step above a count ratio of 1/4.
    ([0, 1, 0, 2, 0, 3, 0], 4, 2, 1.0, 0.2500000001),
])
def test_large_counts_and_f32_thresholds_equal_host(seq, depth, k, offset, min_prob):
  tree = SuffixTree(depth)
  tree.extend(0, seq)
  want = tree.speculate(seq, k, 1.0, offset, min_prob, False).tokens
  got, num = suffix_draft_device(np.asarray([seq], np.int32), np.asarray([len(seq)], np.int32),
                                 np.asarray([k], np.int32), k=k, depth=depth,
                                 caps=spec_caps(depth, 1.0, offset), min_token_prob=min_prob,
                                 vocab_size=4)
  assert list(np.asarray(got)[0, : int(num[0])]) == want
