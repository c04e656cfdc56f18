"""pallas_kernels.verify: every backend against the reference, and the fused sampler's G2.

The Triton kernel runs in interpret mode on CPU (CI) and natively under
``@pytest.mark.gpu``. The fused chain sampler (``specjax.verify.fused_rejection_sample``)
must reproduce the temperature-processed target distribution (chi-square, same setup as
``tests/specjax/test_rejection_sampler_stats.py``) and give the greedy rule's tokens.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from pallas_kernels import verify as pv
from pallas_kernels.verify.triton import vocab_block
from specjax.verify import fused_rejection_sample, rejection_sample
from tests.specjax import test_rejection_sampler_stats as g2


def _inputs(batch, rows, vocab, seed, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  logits = jnp.asarray(3 * rng.standard_normal((batch, rows, vocab)), dtype)
  temperature = jnp.asarray(rng.choice([0.0, 0.6, 1.0, 1.7], batch), jnp.float32)
  tokens = rng.integers(0, vocab, (batch, rows))
  tokens[:, -1] = -1
  tokens[0, 1:] = -1  # a row with a single draft
  seeds = jnp.asarray(rng.integers(0, 2**32, (batch, rows), dtype=np.uint64), jnp.uint32)
  q = jax.nn.softmax(jnp.asarray(2 * rng.standard_normal((batch, rows - 1, vocab)), jnp.float32))
  return logits, temperature, jnp.asarray(tokens, jnp.int32), seeds, q


class _Backend:
  implementation = "pallas_triton"
  interpret = True

  def run(self, *args):
    return pv.verify_rows(*args, implementation=self.implementation, interpret=self.interpret)

  @pytest.mark.parametrize("vocab", [1024, 1536, 3 * 2048])
  @pytest.mark.parametrize("with_q", [True, False], ids=["q", "one_hot"])
  def test_matches_reference_f32(self, vocab, with_q):
    logits, temp, tokens, seeds, q = _inputs(3, 4, vocab, seed=vocab)
    q = q if with_q else None
    want = pv.verify_rows_reference(logits, temp, tokens, seeds, q)
    got = self.run(logits, temp, tokens, seeds, q)
    np.testing.assert_array_equal(got.argmax, want.argmax)
    np.testing.assert_allclose(got.p_token, want.p_token, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(got.q_token, want.q_token, rtol=1e-6, atol=0)
    np.testing.assert_array_equal(got.sample, want.sample)
    assert np.all(np.asarray(got.p_token)[np.asarray(tokens) < 0] == 0)

  def test_bf16_logits(self):
    logits, temp, tokens, seeds, q = _inputs(2, 3, 1024, seed=7, dtype=jnp.bfloat16)
    want = pv.verify_rows_reference(logits, temp, tokens, seeds, q)
    got = self.run(logits, temp, tokens, seeds, q)
    np.testing.assert_array_equal(got.argmax, want.argmax)
    np.testing.assert_allclose(got.p_token, want.p_token, rtol=1e-4, atol=1e-7)
    np.testing.assert_array_equal(got.sample, want.sample)

  def test_two_runs_bitwise_equal(self):
    args = _inputs(2, 3, 1024, seed=3)
    a, b = self.run(*args), self.run(*args)
    for x, y in zip(a, b):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


class TestTritonInterpret(_Backend):
  pass


@pytest.mark.gpu
class TestTritonGPU(_Backend):
  interpret = False


def test_vocab_blocks():
  assert vocab_block(49152) == 2048
  assert vocab_block(151936) == 128
  assert vocab_block(128256) == 256
  assert vocab_block(1000) == 0


def test_dispatch_falls_through_only_on_not_implemented_and_records_backend():
  logits, temp, tokens, seeds, q = _inputs(2, 3, 1000, seed=1)  # no block divides 1000
  with pytest.raises(NotImplementedError, match="V=1000"):
    pv.verify_rows(logits, temp, tokens, seeds, q, implementation="pallas_triton",
                   interpret=True)
  out = pv.verify_rows(logits, temp, tokens, seeds, q,
                       implementation=("pallas_triton", "reference"), interpret=True)
  np.testing.assert_array_equal(out.sample,
                                pv.verify_rows_reference(logits, temp, tokens, seeds, q).sample)
  assert "reference" in pv.implementations_used()
  with pytest.raises(ValueError, match="'cuda'"):
    pv.verify_rows(logits, temp, tokens, seeds, q, implementation="cuda")


def test_bad_shapes_name_the_value():
  logits, temp, tokens, seeds, q = _inputs(2, 3, 1024, seed=1)
  with pytest.raises(ValueError, match=r"q.shape=\(2, 3, 1024\)"):
    pv.verify_rows(logits, temp, tokens, seeds, jnp.zeros((2, 3, 1024)))
  with pytest.raises(ValueError, match="tokens.shape"):
    pv.verify_rows(logits, temp, tokens[:, :2], seeds, q)


def test_hash_noise_is_uniform():
  u = np.asarray(pv.uniform_noise(jnp.uint32(12345), jnp.arange(200_000, dtype=jnp.int32)))
  assert 0 < u.min() and u.max() < 1
  assert stats.kstest(u, "uniform").pvalue > 1e-3
  other = np.asarray(pv.uniform_noise(jnp.uint32(12346), jnp.arange(200_000, dtype=jnp.int32)))
  assert abs(np.corrcoef(u, other)[0, 1]) < 0.01


# ----------------------------------------------------------- fused chain sampler
_fused = jax.jit(fused_rejection_sample)
TEMPERATURES = {"plain": 1.0, "cold": 0.7, "hot": 1.3}


def _run_fused(temperature, with_probs, seed=0):
  """``g2.run_engine_sampler`` with the fused sampler (top-k/top-p off)."""
  n, v = g2.N, g2.V
  d1, d2 = g2._drafts(seed)
  logits = np.stack([np.broadcast_to(g2.LOGITS1, (n, v)), g2.LOGITS2[d1], g2.LOGITS2[d2]], 1)
  drafts = jnp.asarray(np.stack([d1, d2], 1), jnp.int32)
  probs = None
  if with_probs:  # the distribution the drafts were drawn from
    probs = jnp.asarray(np.stack([np.broadcast_to(g2.Q1, (n, v)), g2.Q2[d1]], 1), jnp.float32)
  keys = jax.random.split(jax.random.PRNGKey(2000 + seed), n)
  temp = jnp.full(n, temperature, jnp.float32)
  positions = jnp.full(n, 9, jnp.int32)
  out, acc = _fused(jnp.asarray(logits, jnp.float32), drafts, jnp.full(n, 2, jnp.int32), probs,
                    temp, keys, positions)
  out, acc = np.asarray(out), np.asarray(acc)
  t1 = out[:, 0]
  nxt, _ = _fused(jnp.asarray(g2.LOGITS2[t1][:, None], jnp.float32), jnp.zeros((n, 0), jnp.int32),
                  jnp.zeros(n, jnp.int32), None, temp, keys, positions + 1)
  t2 = np.where(acc >= 1, out[:, 1], np.asarray(nxt)[:, 0])
  return t1, t2, acc


@pytest.mark.parametrize("with_probs", [True, False], ids=["draft_probs", "one_hot"])
@pytest.mark.parametrize("name", list(TEMPERATURES))
def test_fused_sampler_matches_target(name, with_probs):
  temperature = TEMPERATURES[name]
  t1, t2, acc = _run_fused(temperature, with_probs)
  assert 0 < np.mean(acc >= 1) < 1 and np.any(acc == 2)  # accept, reject and bonus ran
  p1, joint = g2.target_joint((temperature, 0, 1.0))
  assert g2.chi_square_p(t1, p1) > g2.P_THRESHOLD
  assert g2.chi_square_p(t1 * g2.V + t2, joint) > g2.P_THRESHOLD


def test_fused_sampler_greedy_rows_equal_rejection_sample():
  n, v = 64, 1024
  rng = np.random.default_rng(11)
  logits = jnp.asarray(rng.standard_normal((n, 4, v)), jnp.float32)
  argmax = np.argmax(np.asarray(logits), -1)
  drafts = argmax[:, :3].copy()
  drafts[::3, 1] = (drafts[::3, 1] + 1) % v  # some rows reject draft 2
  drafts = jnp.asarray(drafts, jnp.int32)
  num_draft = jnp.asarray(rng.integers(0, 4, n), jnp.int32)
  keys = jax.random.split(jax.random.PRNGKey(0), n)
  zeros = jnp.zeros(n, jnp.float32)
  positions = jnp.arange(n, dtype=jnp.int32)
  want = rejection_sample(logits, drafts, num_draft, None, zeros, jnp.zeros(n, jnp.int32),
                          jnp.ones(n, jnp.float32), keys, positions, all_greedy=True)
  for impl, interpret in (("reference", False), ("pallas_triton", True)):
    got = fused_rejection_sample(logits, drafts, num_draft, None, zeros, keys, positions,
                                 implementation=impl, interpret=interpret)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


def test_fused_sampler_kernel_equals_reference_backend():
  """Same seeds, same tokens: the interpret-mode kernel and the jnp reference."""
  logits, temp, tokens, _, q = _inputs(4, 4, 1024, seed=5)
  drafts = jnp.maximum(tokens[:, :3], 0)
  num_draft = jnp.asarray([1, 3, 2, 3], jnp.int32)
  keys = jax.random.split(jax.random.PRNGKey(4), 4)
  positions = jnp.asarray([3, 50, 7, 9], jnp.int32)
  run = functools.partial(fused_rejection_sample, logits, drafts, num_draft, q, temp, keys,
                          positions)
  a, b = run(implementation="reference"), run(implementation="pallas_triton", interpret=True)
  np.testing.assert_array_equal(a[0], b[0])
  np.testing.assert_array_equal(a[1], b[1])
