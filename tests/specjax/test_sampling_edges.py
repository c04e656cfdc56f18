"""Sampling edge cases: tiny temperatures, sampler agreement, non-finite parameters.

* A positive temperature below ``SAMPLING_EPS`` (1e-5, vLLM's ``_SAMPLING_EPS``) is greedy
  in every sampler (chain, fused with each backend, tree): exactly the greedy verifier's
  tokens, never NaN; ``processed_probs`` gives the argmax one-hot.
* Just above it, p = softmax(x / t) is accurate (vs float64) in ``processed_probs`` and
  in both ``pallas_kernels.verify`` backends: no cancellation of huge ``x / t`` values.
* G3 at the sampler level: a row with no draft, and a chain-shaped tree, get the same
  tokens from the tree sampler as from the chain samplers (jnp and fused), so a request
  does not depend on which sampler a batch partner's draft routes the step through.
* ``SamplingParams`` refuses NaN / inf temperature and top_p with a one-line error.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.verify import verify_rows
from specjax.config import SAMPLING_EPS, SamplingParams
from specjax.sampling import processed_probs
from specjax.tree import chain_parents
from specjax.verify import (
    fused_rejection_sample,
    greedy_verify,
    rejection_sample,
    tree_rejection_sample,
)

V, L = 128, 3  # V = 128: one Triton vocabulary block


def _sampler(name):
  """``(logits, drafts, num, q, temperature, top_k, top_p, keys, positions) -> (out, acc)``."""
  if name == "jnp":
    return functools.partial(rejection_sample, all_greedy=False)
  if name == "tree":
    def tree(logits, drafts, num, q, *args):
      parents = jnp.asarray(chain_parents(*drafts.shape))
      return tree_rejection_sample(logits, drafts, parents, num, q, *args, all_greedy=False)[:2]
    return tree
  impl = {"fused_reference": "reference", "fused_triton": "pallas_triton"}[name]

  def fused(logits, drafts, num, q, temperature, top_k, top_p, keys, positions):
    del top_k, top_p
    return fused_rejection_sample(logits, drafts, num, q, temperature, keys, positions,
                                  implementation=impl, interpret=True)
  return fused


SAMPLERS = ["jnp", "fused_reference", "fused_triton", "tree"]


def _case(batch=6, seed=0):
  """Logits, drafts (argmax chain, right then wrong, wrong, none, ..), draft probs."""
  rng = np.random.default_rng(seed)
  logits = (3.0 * rng.standard_normal((batch, L + 1, V))).astype(np.float32)
  argmax = logits.argmax(-1)
  drafts = argmax[:, :L].copy()
  drafts[1, 1] = (drafts[1, 1] + 1) % V
  drafts[2, 0] = (drafts[2, 0] + 5) % V
  num = np.array([L, L, L, 0, 2, 1][:batch], np.int32)
  drafts = np.where(np.arange(L)[None] < num[:, None], drafts, -1).astype(np.int32)
  q = rng.dirichlet(np.ones(V), (batch, L)).astype(np.float32)
  return jnp.asarray(logits), jnp.asarray(drafts), jnp.asarray(num), jnp.asarray(q)


@pytest.mark.parametrize("temperature", [9e-6, 1e-9, 1e-20])
@pytest.mark.parametrize("with_probs", [True, False], ids=["draft_probs", "one_hot"])
@pytest.mark.parametrize("sampler", SAMPLERS)
def test_tiny_temperature_is_greedy(sampler, with_probs, temperature):
  logits, drafts, num, q = _case()
  batch = drafts.shape[0]
  temp = jnp.full(batch, temperature, jnp.float32)
  args = (temp, jnp.zeros(batch, jnp.int32), jnp.ones(batch, jnp.float32),
          jax.random.split(jax.random.PRNGKey(1), batch), jnp.arange(batch, dtype=jnp.int32) + 4)
  out, acc = _sampler(sampler)(logits, drafts, num, q if with_probs else None, *args)
  want_out, want_acc = greedy_verify(logits, drafts, num)
  np.testing.assert_array_equal(np.asarray(acc), np.asarray(want_acc))
  np.testing.assert_array_equal(np.asarray(out), np.asarray(want_out))


@pytest.mark.parametrize("temperature", [1e-6, 1e-9, 1e-30])
def test_tiny_temperature_probs_are_argmax_one_hot(temperature):
  logits = _case()[0]
  batch = logits.shape[0]
  p = processed_probs(logits, jnp.full(batch, temperature, jnp.float32),
                      jnp.full(batch, 5, jnp.int32), jnp.full(batch, 0.9, jnp.float32))
  assert SamplingParams(temperature=temperature).greedy
  assert not SamplingParams(temperature=SAMPLING_EPS).greedy
  np.testing.assert_array_equal(np.asarray(p), np.asarray(
      jax.nn.one_hot(jnp.argmax(logits, -1), V, dtype=jnp.float32)))


def _near_tie_logits():
  """Large logits whose top two differ by ~t: p is far from one-hot at t = 1e-4."""
  rng = np.random.default_rng(3)
  x = (20.0 + rng.standard_normal((2, 2, V))).astype(np.float32)
  top = x.max(-1, keepdims=True)
  x[..., 7] = top[..., 0] + np.float32(3e-4)
  x[..., 9] = top[..., 0] + np.float32(2e-4)
  return x


def _softmax64(x, t):
  z = x.astype(np.float64) / t
  e = np.exp(z - z.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize("impl", ["processed_probs", "reference", "pallas_triton"])
def test_small_temperature_probs_are_accurate(impl):
  t = 1e-4  # above SAMPLING_EPS: a sampled row
  x = _near_tie_logits()
  want = _softmax64(x, t)
  assert 0.2 < want[..., 9].min() and want[..., 7].max() < 0.8
  temp = jnp.full(2, t, jnp.float32)
  if impl == "processed_probs":
    p = np.asarray(processed_probs(jnp.asarray(x), temp, jnp.zeros(2, jnp.int32),
                                   jnp.ones(2, jnp.float32)))
    got, ref = p[..., [7, 9]], want[..., [7, 9]]
  else:
    tokens = jnp.asarray([[7, 9], [9, 7]], jnp.int32)
    stats = verify_rows(jnp.asarray(x), temp, tokens, jnp.zeros((2, 2), jnp.uint32),
                        implementation=impl, interpret=True)
    got = np.asarray(stats.p_token)
    ref = np.take_along_axis(want, np.asarray(tokens)[..., None], -1)[..., 0]
  np.testing.assert_allclose(got, ref, rtol=1e-4)


@pytest.mark.parametrize("with_probs", [True, False], ids=["draft_probs", "one_hot"])
def test_no_draft_row_and_chain_tree_match_chain_samplers(with_probs):
  """Temperature-only rows: the tree sampler (chain-shaped trees; rows with 0 nodes)
  gives exactly the jnp and the fused chain samplers' tokens, and a row with no draft
  also equals a draft-free chain step (L = 0: the engine's step when nobody drafts)."""
  n, length = 256, 3
  rng = np.random.default_rng(5)
  logits = jnp.asarray(2.0 * rng.standard_normal((n, length + 1, V)), jnp.float32)
  probs = rng.dirichlet(np.ones(V), (n, length)).astype(np.float32)
  num = rng.integers(0, length + 1, n).astype(np.int32)
  num[: n // 4] = 0
  drafts = np.where(np.arange(length)[None] < num[:, None],
                    rng.integers(0, V, (n, length)), -1).astype(np.int32)
  q = jnp.asarray(probs) if with_probs else None
  args = (jnp.asarray(rng.uniform(0.5, 1.5, n), jnp.float32), jnp.zeros(n, jnp.int32),
          jnp.ones(n, jnp.float32), jax.random.split(jax.random.PRNGKey(11), n),
          jnp.asarray(rng.integers(0, 20, n), jnp.int32))
  drafts, num = jnp.asarray(drafts), jnp.asarray(num)
  results = {s: tuple(map(np.asarray, _sampler(s)(logits, drafts, num, q, *args)))
             for s in SAMPLERS}
  for name in ("jnp", "fused_reference", "fused_triton"):
    np.testing.assert_array_equal(results[name][1], results["tree"][1], err_msg=name)
    np.testing.assert_array_equal(results[name][0], results["tree"][0], err_msg=name)
  empty = jnp.full((n, 0), -1, jnp.int32)
  zero = jnp.zeros(n, jnp.int32)
  alone = {s: np.asarray(_sampler(s)(logits[:, :1], empty, zero, None, *args)[0])[:, 0]
           for s in ("jnp", "fused_reference")}
  no_draft = np.asarray(num) == 0
  for name, tokens in alone.items():
    np.testing.assert_array_equal(tokens[no_draft], results["tree"][0][no_draft, 0],
                                  err_msg=name)
  acc = results["tree"][1]
  assert 0 < acc.mean() < np.asarray(num).mean() or not with_probs


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), 1e39])
def test_non_finite_temperature_and_top_p_are_refused(value):
  with pytest.raises(ValueError, match=re.escape(f"temperature={value} must be a finite number >= 0")):
    SamplingParams(temperature=value)
  with pytest.raises(ValueError, match=re.escape(f"top_p={value} must be a finite number in (0, 1]")):
    SamplingParams(top_p=value)
