"""Tree drafting with learned heads: EAGLE-2 dynamic trees and Medusa candidate trees.

* Greedy tree SD with random heads equals greedy AR (batches 1 and 3, mixed prompts).
* A one-branch tree (``tree_branching=1``, ``tree_nodes=k``) gives exactly the chain's
  outputs and counters. Sampled tree runs finish and reproduce (losslessness of the
  tree sampler itself: tests/specjax/test_tree_verify.py).
* An oracle EAGLE-3 head that puts the right token second at every level (with a decoy
  under the wrong sibling) and checks the feature window it is handed accepts the full
  path each step: this needs the path's KV moved into place and the path's hidden
  states handed back in commit order.
* Units: Medusa trees are the best prefixes of the heads' cartesian product (brute
  force); every EAGLE-2 node is a top-k child of the head run along its own path (the
  chain ``EagleHead.draft``), and nodes come in rank order.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_learned_heads import ENGINE, LAYERS, MAX_LEN, VOCAB, WORKLOADS, OracleHead, _requests

from methods.eagle3 import Eagle3
from methods.registry import make_method
from models.head_trees import medusa_tree, select_top_nodes
from models.heads import HeadConfig, make_head, restrict_draft_vocab
from models.testing import full_forward, varied_model
from specjax.engine import Engine
from specjax.steps import split_model

jax.config.update("jax_default_matmul_precision", "highest")

K = 3
TREE = dict(tree_nodes=8, tree_branching=2)


@pytest.fixture(scope="module")
def target():
  """The tiny target of ``test_learned_heads`` (attention output and LM head x3)."""
  model = varied_model()
  return split_model(model)


@pytest.fixture(scope="module")
def ar_outputs(target):
  cache = {}

  def get(workload):
    if workload not in cache:
      outs, _ = Engine(target, make_method("ar"), ENGINE).generate(_requests(*WORKLOADS[workload]))
      cache[workload] = [o.output_token_ids for o in outs]
    return cache[workload]

  return get


def _method(kind, **kw):
  return make_method(kind, K, feature_layers=LAYERS[kind], window=MAX_LEN, **kw)


@pytest.mark.parametrize("kind,workload", [
    ("eagle3", "batch3"), ("medusa", "batch3"), ("eagle", "batch1"),
    pytest.param("medusa", "batch1", marks=pytest.mark.slow),  # medusa: batch3 in CI
    pytest.param("eagle", "batch3", marks=pytest.mark.slow),
    pytest.param("eagle3", "batch1", marks=pytest.mark.slow)])
def test_greedy_tree_sd_equals_ar(target, ar_outputs, kind, workload):
  requests = _requests(*WORKLOADS[workload])
  outputs, metrics = Engine(target, _method(kind, **TREE), ENGINE).generate(requests)
  assert [o.output_token_ids for o in outputs] == ar_outputs(workload)
  assert sum(s.num_draft_tokens for s in metrics.steps) > 0
  # Ragged: the verify width is the bucket of the step's largest tree, at most the budget.
  assert all(1 < s.query_bucket <= TREE["tree_nodes"] + 1 for s in metrics.steps
             if s.num_draft_tokens)


@pytest.mark.parametrize("kind", ["eagle3", pytest.param("medusa", marks=pytest.mark.slow)])
def test_fused_tree_equals_host_called_tree(target, kind):
  """Trees drafted inside the fused step (device mask, positions and features written
  after the path fix-ups) commit exactly what the host-called tree path does."""
  requests = _requests(*WORKLOADS["batch3"])
  host_method = _method(kind, fused=False, **TREE)
  fused_method = _method(kind, **TREE)
  assert host_method.capabilities().runs_on == "device"
  assert fused_method.capabilities().runs_on == "fused"
  host = _counters(*Engine(target, host_method, ENGINE).generate(requests))
  fused = _counters(*Engine(target, fused_method, ENGINE).generate(requests))
  assert fused == host
  assert sum(n for _, _, _, n in host[0]) > 0  # some drafts accepted


def _counters(outputs, metrics):
  return ([(o.output_token_ids, o.num_steps, o.num_draft_tokens, o.num_accepted_tokens)
           for o in outputs],
          [(s.num_draft_tokens, s.num_accepted, s.num_emitted, tuple(s.accepted_per_position),
            tuple(s.drafted_per_position)) for s in metrics.steps])


@pytest.mark.parametrize("kind", ["eagle3", "medusa"])
def test_one_branch_tree_equals_chain(target, kind):
  requests = _requests(*WORKLOADS["batch3"])
  chain = _counters(*Engine(target, _method(kind), ENGINE).generate(requests))
  tree = _counters(*Engine(target, _method(kind, tree_nodes=K, tree_branching=1),
                           ENGINE).generate(requests))
  assert chain == tree


def test_stochastic_tree_runs_and_reproduces(target):
  requests = _requests(13, 2, temperature=1.0)
  outputs, metrics = Engine(target, _method("medusa", **TREE), ENGINE).generate(requests)
  for o, r in zip(outputs, requests):
    assert len(o.output_token_ids) == r.sampling.max_tokens
    assert all(0 <= t < VOCAB for t in o.output_token_ids)
  assert sum(s.num_draft_tokens for s in metrics.steps) > 0
  again, _ = Engine(target, _method("medusa", **TREE), ENGINE).generate(requests)
  assert [o.output_token_ids for o in again] == [o.output_token_ids for o in outputs]


# ---------------------------------------------------------------- oracle
class OracleTreeHead(OracleHead):
  """``OracleHead`` (right tokens only for an exactly right window) as a tree: level l
  holds [wrong, right, decoy] where the decoy (the next level's right token) hangs
  under the wrong sibling. Node order is parents first; the right node of level l is
  node 3l + 1, at depth l + 1. The method asks for at most ``3 * depth`` nodes (fewer,
  and a shallower tree, when every row's budget is smaller): the first ``num_nodes``."""

  def draft_tree(self, target, tokens, feats, num_valid, positions, depth, branching,
                 num_nodes):
    assert num_nodes <= 3 * depth
    want, _ = self.draft(target, tokens, feats, num_valid, positions, depth,
                         lambda logits, j: (jnp.argmax(logits, -1).astype(jnp.int32), None))
    nxt = jnp.concatenate([want[:, 1:], jnp.zeros_like(want[:, :1])], 1)
    toks = jnp.stack([(want + 1) % VOCAB, want, nxt], 2).reshape(want.shape[0], -1)
    parents = []
    for level in range(depth):
      above = 3 * level - 2 if level else -1
      parents += [above, above, 3 * level]
    parents = jnp.broadcast_to(jnp.asarray(parents, jnp.int32), toks.shape)
    return toks[:, :num_nodes], parents[:, :num_nodes]


@dataclasses.dataclass(frozen=True, kw_only=True)
class OracleTreeEagle3(Eagle3):
  table: object = dataclasses.field(default=None, compare=False, hash=False, repr=False)

  def build_head(self, runtime):
    return OracleTreeHead(self.head_config(runtime.target.config), *self.table)


def _features(target, seq, layers):
  model = nnx.merge(target.graphdef, target.params)
  tokens = np.zeros((1, MAX_LEN), np.int32)
  tokens[0, : len(seq)] = seq
  out = full_forward(model, tokens, lengths=[len(seq)], hidden_layers=layers)
  return np.concatenate([np.asarray(h) for h in out.hidden], -1)[0, : len(seq)]


def test_oracle_tree_accepts_the_right_branch(target, ar_outputs):
  requests = _requests(*WORKLOADS["batch3"])
  expected = ar_outputs("batch3")
  seqs = np.zeros((len(requests), MAX_LEN + 1), np.int32)
  feats = np.zeros((len(requests), MAX_LEN + 1, 3 * target.config.hidden_size), np.float32)
  for i, (r, out) in enumerate(zip(requests, expected)):
    full = list(r.prompt_token_ids) + out
    seqs[i, : len(full)] = full
    feats[i, : len(full)] = _features(target, full, LAYERS["eagle3"])
  nodes = 3 * K
  method = OracleTreeEagle3(k=K, feature_layers=LAYERS["eagle3"], window=MAX_LEN,
                            tree_nodes=nodes, tree_branching=2, table=(seqs, feats))
  outputs, metrics = Engine(target, method, ENGINE).generate(requests)
  assert [o.output_token_ids for o in outputs] == expected
  for r, o, e in zip(requests, outputs, expected):  # every right node in budget accepted
    p, done, steps, accepted = len(r.prompt_token_ids), 0, 0, 0
    while done < len(e):
      budget = max(0, min(nodes, MAX_LEN - (p + done), r.sampling.max_tokens - done - 1))
      acc = sum(3 * level + 1 < budget for level in range(K))
      emitted = min(acc + 1, len(e) - done)
      accepted, done, steps = accepted + min(acc, emitted), done + emitted, steps + 1
    assert (o.num_steps, o.num_accepted_tokens) == (steps, accepted), r.request_id
  assert max(s.num_accepted for s in metrics.steps) >= K


# ---------------------------------------------------------------- config
def test_tree_options_are_validated():
  with pytest.raises(ValueError, match="tree_nodes=-1 must be >= 0"):
    _method("eagle", tree_nodes=-1)
  with pytest.raises(ValueError, match="tree_branching=0"):
    _method("eagle", tree_nodes=4, tree_branching=0)
  with pytest.raises(ValueError, match="chains only"):
    _method("mtp", tree_nodes=4)
  with pytest.raises(ValueError, match="must be <= 10"):  # 2 + 2 * 2**2 candidates
    _method("eagle3", tree_nodes=11, tree_branching=2)
  with pytest.raises(ValueError, match="must be <= 3"):  # one branch: a chain of k
    _method("medusa", tree_nodes=4, tree_branching=1)
  m = _method("eagle", **TREE)
  caps = m.capabilities()
  assert caps.tree and not caps.emits_draft_probs and m.num_speculative_tokens == 8
  chain = _method("eagle")
  assert not chain.capabilities().tree and chain.num_speculative_tokens == K


# ---------------------------------------------------------------- units
def _paths(tokens, parents):
  out = []
  for j in range(len(tokens)):
    path, i = [], j
    while i >= 0:
      path.append(int(tokens[i]))
      i = int(parents[i])
    out.append(tuple(path[::-1]))
  return out


def test_medusa_tree_is_the_best_prefixes():
  rng = np.random.default_rng(0)
  depth, b, n, v = 3, 3, 10, 12
  logits = jnp.asarray(2.0 * rng.standard_normal((depth, v)), jnp.float32)
  head = type("FakeMedusa", (), {})()
  head.blocks = [lambda h, d=d: jnp.broadcast_to(logits[d], (h.shape[0], v)) for d in range(depth)]
  lm = type("FakeTarget", (), {"lm_logits": staticmethod(lambda x: x)})()
  tokens, parents = medusa_tree(head, lm, jnp.zeros((1, 2, 4)), depth, b, n)
  tokens, parents = np.asarray(tokens)[0], np.asarray(parents)[0]
  assert np.all(parents < np.arange(n))
  lp = np.asarray(jax.nn.log_softmax(logits, -1))
  top = np.argsort(-lp, -1)[:, :b]
  scored = {}
  for d in range(1, depth + 1):
    for path in itertools.product(*[top[i] for i in range(d)]):
      scored[tuple(int(t) for t in path)] = sum(lp[i, t] for i, t in enumerate(path))
  best = sorted(scored, key=lambda p: -scored[p])[:n]
  got = _paths(tokens, parents)
  assert set(got) == set(best)
  assert [scored[p] for p in got] == sorted([scored[p] for p in got], reverse=True)


def test_select_top_nodes_keeps_parents_first():
  # Candidates: 0 (a, -0.1), 1 (b, -0.5), 2 (c under 0, -0.3), 3 (d under 2, -0.3: tie).
  tokens = jnp.asarray([[10, 11, 12, 13]])
  scores = jnp.asarray([[-0.1, -0.5, -0.3, -0.3]])
  parents = jnp.asarray([[-1, -1, 0, 2]])
  t, p = select_top_nodes(tokens, scores, parents, 3)
  np.testing.assert_array_equal(np.asarray(t), [[10, 12, 13]])
  np.testing.assert_array_equal(np.asarray(p), [[-1, 0, 1]])


def test_eagle2_nodes_are_top_children_along_their_paths(target):
  cfg = HeadConfig.for_target("eagle", target.config, feature_layers=(2,), window=8)
  head = make_head(cfg, seed=4)
  tmodel = nnx.merge(target.graphdef, target.params)
  rng = np.random.default_rng(2)
  width, depth, b, n = 8, 3, 2, 7
  tokens = jnp.asarray(rng.integers(0, VOCAB, (1, width)), jnp.int32)
  feats = jnp.asarray(rng.standard_normal((1, width, cfg.feature_dim)), jnp.float32)
  num_valid, positions = jnp.asarray([6]), jnp.asarray([20])
  toks, pars = jax.jit(lambda: head.draft_tree(tmodel, tokens, feats, num_valid, positions,
                                               depth, b, n))()
  toks, pars = np.asarray(toks)[0], np.asarray(pars)[0]
  assert np.all(pars < np.arange(n))
  scores = []
  for path in _paths(toks, pars):
    forced = jnp.asarray(path, jnp.int32)

    def pick(logits, j, forced=forced):
      return jnp.broadcast_to(forced[j], (1,)), logits

    _, logits = head.draft(tmodel, tokens, feats, num_valid, positions, len(path), pick)
    lp = np.asarray(jax.nn.log_softmax(logits[0], -1))
    for j, t in enumerate(path):  # each node is a top-b child of the head along its path
      assert t in np.argsort(-lp[j])[:b], (path, j)
    scores.append(sum(lp[j, t] for j, t in enumerate(path)))
  assert all(a >= c - 1e-5 for a, c in zip(scores, scores[1:]))  # rank order
  assert len(set(_paths(toks, pars))) == n


def test_restricted_vocab_head_drafts_the_best_kept_tokens(target):
  """FR-Spec pruning (``restrict_draft_vocab``): with every id kept the head drafts what
  it drafted before (chain and tree); with a subset its logits are the original's on
  the subset (-inf elsewhere) and every tree node is a kept id."""
  cfg = HeadConfig.for_target("eagle3", target.config, feature_layers=LAYERS["eagle3"],
                              window=8)
  head = make_head(cfg, seed=4)
  tmodel = nnx.merge(target.graphdef, target.params)
  lm_weight = np.asarray(jax.vmap(tmodel.lm_logits)(jnp.eye(cfg.hidden_size)))  # [D, V]
  rng = np.random.default_rng(3)
  width = 8
  tokens = jnp.asarray(rng.integers(0, VOCAB, (1, width)), jnp.int32)
  feats = jnp.asarray(rng.standard_normal((1, width, cfg.feature_dim)), jnp.float32)
  num_valid, positions = jnp.asarray([6]), jnp.asarray([20])

  def pick(logits, j):
    return jnp.argmax(logits, -1).astype(jnp.int32), logits

  def run(h):
    chain, logits = jax.jit(lambda: h.draft(tmodel, tokens, feats, num_valid, positions, 3,
                                            pick))()
    tree = jax.jit(lambda: h.draft_tree(tmodel, tokens, feats, num_valid, positions, 3, 2, 6))()
    return np.asarray(chain), np.asarray(logits), [np.asarray(a) for a in tree]

  chain, logits, tree = run(head)
  full = restrict_draft_vocab(head, lm_weight, np.arange(VOCAB))
  f_chain, f_logits, f_tree = run(full)
  np.testing.assert_array_equal(f_chain, chain)
  np.testing.assert_allclose(f_logits, logits, rtol=1e-5, atol=1e-5)
  for a, b in zip(f_tree, tree):
    np.testing.assert_array_equal(a, b)

  kept = np.sort(rng.permutation(VOCAB)[: VOCAB // 3])
  small = restrict_draft_vocab(head, lm_weight, kept)
  assert small.cfg.draft_vocab_size == len(kept)
  s_chain, s_logits, (s_tokens, _) = run(small)
  # Step 0 sees the same window: its logits are the original's on the kept ids.
  np.testing.assert_allclose(s_logits[0, 0, kept], logits[0, 0, kept], rtol=1e-5, atol=1e-5)
  assert np.all(np.isneginf(np.delete(s_logits[0, 0], kept)))
  assert s_chain[0, 0] == kept[np.argmax(logits[0, 0, kept])]
  assert np.isin(s_tokens, kept).all() and np.isin(s_chain, kept).all()
  with pytest.raises(ValueError, match="sorted and distinct"):
    restrict_draft_vocab(head, lm_weight, kept[::-1])
  with pytest.raises(ValueError, match="target's LM head"):
    restrict_draft_vocab(small, lm_weight, kept)
