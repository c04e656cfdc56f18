"""Tree verification (``specjax.verify.tree_rejection_sample``) is lossless.

* A chain given as a one-branch tree gets exactly the chain sampler's outputs (greedy
  and stochastic rows, with and without draft probabilities).
* Greedy: the accepted path follows the target argmax through any sibling order;
  decoys under a rejected node are never accepted.
* G2 for trees: the root has three children and each of those two children. Drafts are
  drawn i.i.d. from the draft q (with probabilities) or fixed top tokens (one-hot q);
  over many request keys the first token and the first two tokens must follow the
  processed target distribution (chi-square, p > 1e-3, the fixtures and helpers of
  ``test_rejection_sampler_stats``). A classic multi-candidate bug (every sibling
  tested against the unchanged target p) must fail the same test.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_rejection_sampler_stats import (
    CONFIGS,
    LOGITS1,
    LOGITS2,
    P_THRESHOLD,
    Q1,
    Q2,
    V,
    _categorical,
    chi_square_p,
    target_joint,
)

from specjax.tree import chain_parents
from specjax.verify import rejection_sample, tree_rejection_sample

N = 40_000
_chain = jax.jit(functools.partial(rejection_sample, all_greedy=False))
_tree = jax.jit(functools.partial(tree_rejection_sample, all_greedy=False))

# root -> c0, c1, c2; c_i -> two children each (nodes 3 + 2i, 4 + 2i).
PARENTS = np.array([-1, -1, -1, 0, 0, 1, 1, 2, 2], np.int32)
FIXED_CHILDREN = np.argsort(-Q1, kind="stable")[:3]  # one-hot mode: the draft's top 3


def _params(n, temperature, top_k, top_p):
  return (jnp.full(n, temperature, jnp.float32), jnp.full(n, top_k, jnp.int32),
          jnp.full(n, top_p, jnp.float32))


@pytest.mark.parametrize("with_probs", [True, False], ids=["draft_probs", "one_hot"])
def test_one_branch_tree_equals_chain(with_probs):
  n, length = 512, 3
  rng = np.random.default_rng(1)
  logits = jnp.asarray(2.0 * rng.standard_normal((n, length + 1, V)), jnp.float32)
  probs = rng.dirichlet(np.ones(V), (n, length))
  drafts = np.stack([_categorical(rng, probs[:, j]) for j in range(length)], 1).astype(np.int32)
  num = rng.integers(0, length + 1, n).astype(np.int32)
  drafts = np.where(np.arange(length)[None] < num[:, None], drafts, -1)
  temperature = jnp.asarray(np.where(np.arange(n) % 5 == 0, 0.0, 0.9), jnp.float32)
  args = (temperature, jnp.full(n, 4, jnp.int32), jnp.full(n, 0.95, jnp.float32),
          jax.random.split(jax.random.PRNGKey(7), n), jnp.arange(n, dtype=jnp.int32) % 13)
  q = jnp.asarray(probs, jnp.float32) if with_probs else None
  out_c, acc_c = _chain(logits, jnp.asarray(drafts), jnp.asarray(num), q, *args)
  out_t, acc_t, path = _tree(logits, jnp.asarray(drafts), jnp.asarray(chain_parents(n, length)),
                             jnp.asarray(num), q, *args)
  np.testing.assert_array_equal(np.asarray(out_c), np.asarray(out_t))
  np.testing.assert_array_equal(np.asarray(acc_c), np.asarray(acc_t))
  acc = np.asarray(acc_t)
  want_path = np.where(np.arange(length)[None] < acc[:, None], np.arange(length)[None], -1)
  np.testing.assert_array_equal(np.asarray(path), want_path)
  assert 0 < np.mean(acc) < np.mean(num)  # accepts and rejects both happened


def test_greedy_follows_argmax_through_siblings():
  # Root argmax 5; its children carry [3, 5, 5]: node 1 is the first match (not the first
  # child). Node 1 (step row 2) predicts 2; the decoy node 3 (token 2) hangs under the
  # rejected node 0, node 4 (token 2) under node 1. Node 4 (row 5) predicts 0, so its
  # child node 5 (token 1) is rejected and 0 is the recovered token.
  parents = np.array([[-1, -1, -1, 0, 1, 4]], np.int32)
  tokens = np.array([[3, 5, 5, 2, 2, 1]], np.int32)
  argmax = [5, 4, 2, 2, 0, 0, 3]  # per step row (root, nodes 0..5)
  logits = np.zeros((1, 7, V), np.float32)
  for row, tok in enumerate(argmax):
    logits[0, row, tok] = 5.0
  out, acc, path = tree_rejection_sample(
      jnp.asarray(logits), jnp.asarray(tokens), jnp.asarray(parents), jnp.asarray([6]), None,
      *_params(1, 0.0, 0, 1.0), jax.random.PRNGKey(0)[None], jnp.asarray([4]), all_greedy=True)
  assert int(acc[0]) == 2
  np.testing.assert_array_equal(np.asarray(path)[0], [1, 4, -1, -1, -1, -1])
  np.testing.assert_array_equal(np.asarray(out)[0], [5, 2, 0, -1, -1, -1, -1])


def _tree_drafts(rng, with_probs):
  """``(tokens i32[N, 9], probs f32[N, 9, V] or None)`` for ``PARENTS``."""
  if with_probs:
    kids = np.stack([_categorical(rng, np.broadcast_to(Q1, (N, V))) for _ in range(3)], 1)
    grand = np.stack([_categorical(rng, Q2[kids[:, i]]) for i in (0, 0, 1, 1, 2, 2)], 1)
    probs = np.concatenate([np.broadcast_to(Q1, (N, 3, V)),
                            np.stack([Q2[kids[:, i]] for i in (0, 0, 1, 1, 2, 2)], 1)], 1)
  else:
    kids = np.broadcast_to(FIXED_CHILDREN, (N, 3))
    top2 = np.argsort(-Q2, axis=-1, kind="stable")[:, :2]  # [V, 2]
    grand = np.concatenate([top2[kids[:, i]] for i in range(3)], 1)
    probs = None
  return np.concatenate([kids, grand], 1).astype(np.int32), probs


def run_tree_sampler(config, *, with_probs, seed=0):
  """First two tokens per key, as the engine produces them (one tree step, then a
  plain decode step for rows that accepted nothing)."""
  rng = np.random.default_rng(seed)
  tokens, probs = _tree_drafts(rng, with_probs)
  kid_rows = LOGITS2[tokens[:, :3]]  # [N, 3, V]: target after each child
  grand_rows = LOGITS2[tokens[:, 3:]]  # bonus rows (their values are not checked)
  logits = np.concatenate([np.broadcast_to(LOGITS1, (N, 1, V)), kid_rows, grand_rows], 1)
  keys = jax.random.split(jax.random.PRNGKey(2000 + seed), N)
  params = _params(N, *config)
  positions = jnp.full(N, 9, jnp.int32)
  out, acc, _ = _tree(jnp.asarray(logits, jnp.float32), jnp.asarray(tokens),
                      jnp.asarray(np.broadcast_to(PARENTS, (N, len(PARENTS)))),
                      jnp.full(N, len(PARENTS), jnp.int32),
                      None if probs is None else jnp.asarray(probs, jnp.float32),
                      *params, keys, positions)
  out, acc = np.asarray(out), np.asarray(acc)
  t1 = out[:, 0]
  nxt, _ = _chain(jnp.asarray(LOGITS2[t1][:, None], jnp.float32), jnp.zeros((N, 0), jnp.int32),
                  jnp.zeros(N, jnp.int32), None, *params, keys, positions + 1)
  t2 = np.where(acc >= 1, out[:, 1], np.asarray(nxt)[:, 0])
  return t1, t2, acc


@pytest.mark.parametrize("with_probs", [True, False], ids=["draft_probs", "one_hot"])
@pytest.mark.parametrize("config", ["plain", "temperature_top_k", "top_k_top_p"])
def test_tree_sampler_matches_target(config, with_probs):
  cfg = CONFIGS[config]
  t1, t2, acc = run_tree_sampler(cfg, with_probs=with_probs)
  assert 0 < np.mean(acc >= 1) < 1 and np.any(acc == 2)  # reject, accept and bonus paths
  p1, joint = target_joint(cfg)
  assert chi_square_p(t1, p1) > P_THRESHOLD
  assert chi_square_p(t1 * V + t2, joint) > P_THRESHOLD


def no_residual_siblings(config, seed=0):
  """The bug: each sibling is tested against the unchanged p (not the residual left
  by the earlier siblings); after all are rejected, sample from the last residual."""
  rng = np.random.default_rng(seed)
  tokens, _ = _tree_drafts(rng, True)
  p1, _ = target_joint(config)
  t1 = np.full(N, -1)
  for i in range(3):
    x = tokens[:, i]
    ok = (t1 < 0) & (rng.random(N) * Q1[x] < p1[x])
    t1 = np.where(ok, x, t1)
  residual = np.maximum(p1 - Q1, 0)
  residual /= residual.sum()
  return np.where(t1 >= 0, t1, _categorical(rng, np.broadcast_to(residual, (N, V))))


def test_wrong_tree_sampler_fails_the_same_test():
  cfg = CONFIGS["plain"]
  p1, _ = target_joint(cfg)
  assert chi_square_p(no_residual_siblings(cfg), p1) < P_THRESHOLD
  t1, _, _ = run_tree_sampler(cfg, with_probs=True)
  assert chi_square_p(t1, p1) > P_THRESHOLD
