"""The suffix structure of ``methods.suffix``: counts, probabilities, drafts, removal and
the global cache's FIFO, against hand-counted examples; option validation."""

import dataclasses

import numpy as np
import pytest

from methods.registry import make_method
from methods.suffix import GlobalCache, SuffixDecoding, SuffixTree
from specjax.method import ProposeContext, RuntimeInfo, VerifyResult

A, B, C, D = 1, 2, 3, 4
SPEC = dict(max_spec_factor=1.0, max_spec_offset=0.0, min_token_prob=0.1)


def _spec(tree, context, budget, *, use_tree=False, **kw):
  return tree.speculate(context, budget, **{**SPEC, **kw}, tree=use_tree)


def test_counts_are_substring_occurrences():
  t = SuffixTree(24)
  t.extend(0, [A, B, A, B, C])
  assert [t.count(s) for s in ([A], [B], [C], [A, B], [B, A], [B, C], [A, B, A, B, C])] == [
      2, 2, 1, 2, 1, 1, 1]
  assert t.count([C, A]) == 0 and t.count([]) == 5
  t.extend(7, [A, B])  # a second sequence adds its own occurrences
  assert t.count([A, B]) == 3 and t.count([A]) == 3 and t.num_sequences == 2


def test_depth_bounds_the_indexed_strings():
  t = SuffixTree(3)
  t.extend(0, [A, B, C, D, A, B, C, D])
  assert t.count([A, B, C]) == 2
  assert t.count([A, B, C, D]) == 0  # longer than the depth: not indexed
  assert t.count([B, C, D]) == 2 and t.count([D, A]) == 1


def test_path_draft_probabilities():
  t = SuffixTree(24)
  t.extend(0, [A, B, A, B, C, A, B, A])
  # m = 1 (node B, count 3: children A 2, C 1): budget floor(1 * 1.0) = 1 -> A, p 2/3.
  # m = 2 (node A B, count 3): A (2 of 3), then under A B A (count 2: child B 1) B with
  # p = 1/3 (the probabilities telescope: count(A B A B) / count(A B)); score 3/3.
  d = _spec(t, [D, A, B], 4)
  assert d.tokens == [A, B] and d.parents == [-1, 0] and d.probs == [2 / 3, 1 / 3]
  assert d.score == 1.0 and (d.score_num, d.score_den) == (3, 3) and d.match_len == 2
  # The offset lets a 1-token match draft 3 tokens: B -> A (2/3) -> B (1/3) -> C (1/3).
  d = _spec(t, [D, B], 4, max_spec_offset=2.0)
  assert d.tokens == [A, B, C] and (d.score_num, d.score_den) == (4, 3) and d.match_len == 1
  # min_token_prob 0.6 stops m = 2 after A (2/3): a tie with m = 1's draft, so the longer
  # match wins; 0.7 stops before the first token.
  d = _spec(t, [D, A, B], 4, min_token_prob=0.6)
  assert d.tokens == [A] and d.match_len == 2
  assert _spec(t, [D, A, B], 4, min_token_prob=0.7).tokens == []
  # Nothing matches: an empty draft.
  d = _spec(t, [D, D], 4)
  assert d.tokens == [] and d.score == 0.0 and d.match_len == 0


def test_most_frequent_child_and_count_ties():
  t = SuffixTree(24)
  t.extend(0, [A, B, A, C, A, C, A, D])
  # m = 1: node A (count 4): children B 1, C 2, D 1 -> C with p 2/4 (budget 1).
  # m = 2: node C A (count 2): children C and D, 1 each: a tie, which goes to the child
  # whose latest occurrence is latest (C A D ends at 7, C A C at 5) -> D, p 1/2. Its
  # score 1/2 ties m = 1's, and the longer match wins.
  d = _spec(t, [B, C, A], 2)
  assert d.tokens == [D] and d.probs == [0.5] and d.match_len == 2
  assert _spec(t, [B, C, A], 1, max_spec_factor=0.0, max_spec_offset=1.0).tokens == [D]
  assert _spec(t, [B, C, A], 0).tokens == []


def test_count_ties_across_sequences_go_to_the_newest():
  t = SuffixTree(24)
  t.extend(3, [A, B])
  t.extend(5, [A, C])
  t.extend(3, [A, D])  # later in time, but sequence 3 is older than 5
  assert _spec(t, [D, A], 1).tokens == [C]


def test_tree_draft_best_first():
  e = 5
  t = SuffixTree(24)
  t.extend(0, [A, B, C, A, B, D, A, B, C, A, e])
  # Context ".. A B C A":
  #   m = 1 (node A, count 4): B 3/4 (budget 1)                        -> score 0.75
  #   m = 2 (node C A, count 2): E 1/2, B 1/2 (E's occurrence is later) -> score 1.0
  #   m = 3 (node B C A, count 2): E 1/2, B 1/2, then D under B (1/2)   -> score 1.5
  d = _spec(t, [A, B, C, A], 4, use_tree=True)
  assert d.match_len == 3
  assert d.tokens == [e, B, D] and d.parents == [-1, -1, 1]
  assert d.probs == [0.5, 0.5, 0.5] and d.score == 1.5
  # Pruning: min_token_prob 0.6 leaves only m = 1's B.
  d = _spec(t, [A, B, C, A], 4, use_tree=True, min_token_prob=0.6)
  assert d.tokens == [B] and d.match_len == 1 and d.probs == [0.75]


def test_remove_restores_counts():
  t = SuffixTree(4)
  t.extend(0, [A, B, A, B])
  t.extend(1, [B, A, C])
  t.remove(0)
  ref = SuffixTree(4)
  ref.extend(1, [B, A, C])
  for s in ([A], [B], [C], [B, A], [A, C], [B, A, C], [A, B]):
    assert t.count(s) == ref.count(s), s
  assert t.count([]) == 3 and 0 not in t
  t.remove(1)
  assert t.num_nodes == 1 and t.count([]) == 0
  with pytest.raises(KeyError):
    t.remove(1)


def test_global_cache_fifo():
  cache = GlobalCache(SuffixTree(8), max_cached_requests=2)
  ids = [cache.new_sequence() for _ in range(2)]
  cache.append(ids[0], [A, B, C])
  cache.append(ids[1], [B, C, D])
  assert cache.tree.count([B, C]) == 2
  third = cache.new_sequence()  # evicts the oldest (ids[0])
  assert list(cache.order) == [ids[1], third] and ids[0] not in cache.tree
  assert cache.tree.count([B, C]) == 1 and cache.tree.count([A]) == 0
  cache.append(ids[0], [A, A])  # an evicted response takes no more tokens
  assert cache.tree.count([A]) == 0
  off = GlobalCache(SuffixTree(8), max_cached_requests=0)
  assert off.new_sequence() is None
  unlimited = GlobalCache(SuffixTree(8), max_cached_requests=-1)
  for _ in range(5):
    unlimited.append(unlimited.new_sequence(), [A])
  assert unlimited.tree.count([A]) == 5


def _ctx(ids, seqs, budgets):
  n = len(ids)
  return ProposeContext(request_ids=ids, token_ids=[np.asarray(s, np.int32) for s in seqs],
                        budgets=np.asarray(budgets, np.int32), page_indices=np.zeros((n, 1)),
                        temperature=np.zeros(n), top_k=np.zeros(n), top_p=np.ones(n),
                        keys=np.zeros((n, 2), np.uint32), new_requests=frozenset(ids))


def _runtime():
  return RuntimeInfo(target=None, draft=None, num_pages=1, page_size=1, max_model_len=64,
                     attention_implementation=None)


def test_method_local_global_and_signals():
  """Local tree = prompt + output; a finished response serves a later request (global),
  and the cache outlives the state (a new ``init_state`` on the same runtime)."""
  method = SuffixDecoding(k=4)
  rt = _runtime()
  st = method.init_state(rt)
  st, d = method.propose(st, _ctx(["a"], [[A, B, C, A, B]], [4]))
  # Local tree of "A B C A B": m = 2 (A B, count 2 incl. the tail) -> C (1/2), A (1/2).
  assert d.num_tokens.tolist() == [2] and d.tokens[0, :2].tolist() == [C, A]
  assert st.signals["a"].source == "local" and st.signals["a"].match_len == 2
  st = method.observe(st, VerifyResult(["a"], np.array([0]), [[D, D, D]], frozenset({"a"})))
  assert "a" not in st.requests
  st2 = method.init_state(rt)  # next generate call
  assert st2.cache is st.cache
  st2, d = method.propose(st2, _ctx(["b"], [[C, D, D]], [4]))
  # Global tree holds the response "D D D": m = 2 (D D, count 2) -> D (1/2).
  assert st2.signals["b"].source == "global" and d.tokens[0, 0] == D
  # Budget 1 and 0 respected.
  _, d = method.propose(st2, _ctx(["c", "e"], [[A, D, D], [C, D, D]], [1, 0]))
  assert d.num_tokens.tolist() == [1, 0]


def test_max_cached_requests_zero_disables_global():
  method = SuffixDecoding(k=4, max_cached_requests=0)
  st = method.init_state(_runtime())
  st, _ = method.propose(st, _ctx(["a"], [[A]], [4]))
  st = method.observe(st, VerifyResult(["a"], np.array([0]), [[D, D, D]], frozenset({"a"})))
  st, d = method.propose(st, _ctx(["b"], [[C, D]], [4]))
  assert d.num_tokens.tolist() == [0] and st.cache.tree.count([]) == 0


def test_tree_mode_draft_has_parents():
  method = SuffixDecoding(k=4, tree=True)
  assert method.capabilities().tree
  st = method.init_state(_runtime())
  # Local tree of the context: m = 4 (A B C A, count 2) gives the best score, 2.0.
  _, d = method.propose(st, _ctx(["a"], [[A, B, C, A, B, D, A, B, C, A]], [4]))
  n = int(d.num_tokens[0])
  assert n == 4 and d.parents is not None
  assert d.tokens[0, :n].tolist() == [B, D, A, B] and d.parents[0, :n].tolist() == [-1, 0, 1, 2]


@pytest.mark.parametrize("option, value, match", [
    ("k", 0, "k=0"),
    ("max_tree_depth", 1, "max_tree_depth=1"),
    ("max_cached_requests", -2, "max_cached_requests=-2"),
    ("max_spec_factor", -1.0, "max_spec_factor=-1.0"),
    ("max_spec_factor", float("nan"), "max_spec_factor=nan"),
    ("max_spec_offset", float("inf"), "max_spec_offset=inf"),
    ("min_token_prob", 1.5, "min_token_prob=1.5"),
    ("tree", "yes", "tree='yes'"),
])
def test_bad_options_refused(option, value, match):
  with pytest.raises(ValueError, match=match) as info:
    SuffixDecoding(**{option: value})
  assert "\n" not in str(info.value)


def test_registry_builds_suffix_with_vllm_defaults():
  m = make_method("suffix", 8)
  assert m.num_speculative_tokens == 8 and hash(m)
  assert (m.max_tree_depth, m.max_cached_requests, m.max_spec_factor, m.max_spec_offset,
          m.min_token_prob, m.tree) == (24, 10000, 1.0, 0.0, 0.1, False)
  assert dataclasses.replace(m, tree=True).capabilities().tree


@pytest.mark.parametrize("depth", [1, 2, 5])
def test_counts_match_brute_force(depth):
  """Every indexed string's count is its occurrence count (<= depth tokens), before and
  after removing one of three random sequences."""
  rng = np.random.default_rng(depth)
  seqs = {i: rng.integers(0, 3, size=int(rng.integers(1, 12))).tolist() for i in range(3)}
  t = SuffixTree(depth)
  for i, s in seqs.items():
    t.extend(i, s)

  def brute(pattern, live):
    n = len(pattern)
    return sum(s[j: j + n] == pattern for i in live for s in [seqs[i]]
               for j in range(len(s) - n + 1))

  def check(live):
    for n in range(1, depth + 2):
      for pattern in {tuple(seqs[i][j: j + n]) for i in live for j in range(len(seqs[i]) - n + 1)}:
        want = brute(list(pattern), live) if n <= depth else 0
        assert t.count(pattern) == want, (pattern, live)

  check([0, 1, 2])
  t.remove(1)
  check([0, 2])
  seqs[3] = rng.integers(0, 3, size=9).tolist()  # reuses the freed node ids
  t.extend(3, seqs[3])
  check([0, 2, 3])
  for i in (0, 2, 3):
    t.remove(i)
  assert t.num_nodes == 1 and t.count([]) == 0
