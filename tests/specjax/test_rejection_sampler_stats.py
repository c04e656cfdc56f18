"""G2 (unit level): the rejection sampler is lossless.

Fixed target logits (the second token's logits depend on the first token, like a real
model) and a draft distribution that differs from the target; drafts are sampled from
the draft q. Over many request keys, the first emitted token and the two-token prefix
(emitted in one step when draft 1 is accepted, else sampled in the next step, as the
engine does) must follow the *processed* target distribution (temperature, top-k,
top-p), computed here by independent numpy code. Chi-square with fixed seeds and a
p-value threshold of 1e-3; deliberately wrong samplers (always accept; on rejection
resample from p instead of the residual) must fail the same test, which shows power.

Coupled drafts (``draft_sample(coupled=True)``: the Gumbel race over q with the
verifier's noise, verified without q) follow the same law, and accept as the Gumbel
coupling does: at most sum(min(p, q)) and at least that over 2 - itself (Daliri et al.
2024), far above the sum(p q) of an independent sample verified without q.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from specjax.sampling import draft_sample
from specjax.verify import rejection_sample

V = 6
N = 40_000
P_THRESHOLD = 1e-3
_rng = np.random.default_rng(0)
LOGITS1 = 1.5 * _rng.standard_normal(V)  # target logits of token 1
LOGITS2 = 1.5 * _rng.standard_normal((V, V))  # target logits of token 2 given token 1
Q1 = _rng.dirichlet(np.ones(V))  # draft q of token 1
Q1[2] = 0.0  # a token the draft never proposes
Q1 /= Q1.sum()
Q2 = _rng.dirichlet(np.ones(V), size=V)  # draft q of token 2 given token 1

CONFIGS = {  # (temperature, top_k, top_p)
    "plain": (1.0, 0, 1.0),
    "temperature_top_k": (0.7, 3, 1.0),
    "temperature_top_p": (1.3, 0, 0.8),
    "top_k_top_p": (1.0, 4, 0.7),
}

_sampler = jax.jit(functools.partial(rejection_sample, all_greedy=False))


def processed(logits, temperature, top_k, top_p):
  """Numpy reference of vLLM's processing: temperature, top-k, then top-p on the rest."""
  z = np.asarray(logits, np.float64) / temperature
  order = np.argsort(-z, kind="stable")
  keep = np.zeros(len(z), bool)
  keep[order[: top_k or len(z)]] = True
  p = np.where(keep, np.exp(z - z.max()), 0.0)
  p /= p.sum()
  if top_p < 1:
    sorted_p = p[order]
    mass_before = np.cumsum(sorted_p) - sorted_p
    keep[order[mass_before >= top_p]] = False
    p = np.where(keep, p, 0.0)
    p /= p.sum()
  return p


def target_joint(config):
  p1 = processed(LOGITS1, *config)
  p2 = np.stack([processed(LOGITS2[x], *config) for x in range(V)])
  return p1, p1[:, None] * p2


def _categorical(rng, probs):
  """One draw per row of ``probs [N, V]``."""
  u = rng.random(len(probs))[:, None]
  return np.minimum((np.cumsum(probs, -1) < u).sum(-1), V - 1)


def _drafts(seed):
  rng = np.random.default_rng(seed)
  d1 = _categorical(rng, np.broadcast_to(Q1, (N, V)))
  d2 = _categorical(rng, Q2[d1])
  return d1, d2


def run_engine_sampler(config, *, with_probs, seed=0):
  """Two tokens per key, exactly as the engine would produce them."""
  temperature, top_k, top_p = config
  d1, d2 = _drafts(seed)
  logits = np.stack([np.broadcast_to(LOGITS1, (N, V)), LOGITS2[d1], LOGITS2[d2]], 1)
  drafts = np.stack([d1, d2], 1).astype(np.int32)
  probs = np.stack([np.broadcast_to(Q1, (N, V)), Q2[d1]], 1) if with_probs else None
  keys = jax.random.split(jax.random.PRNGKey(1000 + seed), N)
  params = (jnp.full(N, temperature, jnp.float32), jnp.full(N, top_k, jnp.int32),
            jnp.full(N, top_p, jnp.float32))
  positions = jnp.full(N, 9, jnp.int32)
  out, acc = _sampler(jnp.asarray(logits, jnp.float32), jnp.asarray(drafts),
                      jnp.full(N, 2, jnp.int32),
                      None if probs is None else jnp.asarray(probs, jnp.float32),
                      *params, keys, positions)
  out, acc = np.asarray(out), np.asarray(acc)
  t1 = out[:, 0]
  # Rows that rejected draft 1 sample token 2 in the next step (plain decode, no drafts).
  nxt, _ = _sampler(jnp.asarray(LOGITS2[t1][:, None], jnp.float32), jnp.zeros((N, 0), jnp.int32),
                    jnp.zeros(N, jnp.int32), None, *params, keys, positions + 1)
  t2 = np.where(acc >= 1, out[:, 1], np.asarray(nxt)[:, 0])
  return t1, t2, acc


def always_accept(config, seed=0):
  d1, d2 = _drafts(seed)
  return d1, d2


def resample_from_p(config, seed=0):
  """A classic bug: accept with min(1, p/q), but on rejection sample from p, not p - q."""
  rng = np.random.default_rng(99 + seed)
  d1, d2 = _drafts(seed)
  p1, _ = target_joint(config)
  p2 = np.stack([processed(LOGITS2[x], *config) for x in range(V)])
  ok1 = rng.random(N) * Q1[d1] < p1[d1]
  t1 = np.where(ok1, d1, _categorical(rng, np.broadcast_to(p1, (N, V))))
  ok2 = ok1 & (rng.random(N) * Q2[d1, d2] < p2[d1, d2])
  t2 = np.where(ok2, d2, _categorical(rng, p2[t1]))
  return t1, t2


def chi_square_p(samples, probs):
  """p-value of counts of ``samples`` (flat cell ids) against ``probs``; zero cells must be empty."""
  counts = np.bincount(samples, minlength=probs.size).astype(float)
  support = probs.reshape(-1) > 0
  if counts[~support].sum() > 0:
    return 0.0
  expected = probs.reshape(-1)[support] * len(samples)
  assert expected.min() >= 5, "chi-square needs >= 5 expected counts per cell"
  return stats.chisquare(counts[support], expected).pvalue


@pytest.mark.parametrize("with_probs", [True, False], ids=["draft_probs", "one_hot"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_rejection_sampler_matches_target(config, with_probs):
  cfg = CONFIGS[config]
  t1, t2, acc = run_engine_sampler(cfg, with_probs=with_probs)
  assert 0 < np.mean(acc >= 1) < 1 and np.any(acc == 2)  # accept, reject and bonus paths ran
  p1, joint = target_joint(cfg)
  assert chi_square_p(t1, p1) > P_THRESHOLD
  assert chi_square_p(t1 * V + t2, joint) > P_THRESHOLD


@pytest.mark.parametrize("wrong", [always_accept, resample_from_p])
def test_wrong_samplers_fail_the_same_test(wrong):
  cfg = CONFIGS["plain"]
  t1, t2 = wrong(cfg)
  p1, joint = target_joint(cfg)
  assert chi_square_p(t1 * V + t2, joint) < P_THRESHOLD
  # And the real sampler passes on the same drafts.
  r1, r2, _ = run_engine_sampler(cfg, with_probs=True)
  assert chi_square_p(r1 * V + r2, joint) > P_THRESHOLD


def test_rows_are_independent_of_batch_order():
  """Row outputs depend on their own key, logits and drafts only (not on partners)."""
  cfg = CONFIGS["top_k_top_p"]
  n = 64
  rng = np.random.default_rng(5)
  logits = jnp.asarray(rng.standard_normal((n, 3, V)), jnp.float32)
  drafts = jnp.asarray(rng.integers(0, V, (n, 2)), jnp.int32)
  probs = jnp.asarray(rng.dirichlet(np.ones(V), (n, 2)), jnp.float32)
  keys = jax.random.split(jax.random.PRNGKey(3), n)
  temperature = jnp.asarray(np.where(np.arange(n) % 4 == 0, 0.0, cfg[0]), jnp.float32)
  args = (temperature, jnp.full(n, cfg[1], jnp.int32), jnp.full(n, cfg[2], jnp.float32), keys,
          jnp.arange(n, dtype=jnp.int32))
  out, acc = _sampler(logits, drafts, jnp.full(n, 2, jnp.int32), probs, *args)
  perm = rng.permutation(n)
  out_p, acc_p = _sampler(logits[perm], drafts[perm], jnp.full(n, 2, jnp.int32), probs[perm],
                          *(a[perm] for a in args))
  np.testing.assert_array_equal(np.asarray(out)[perm], np.asarray(out_p))
  np.testing.assert_array_equal(np.asarray(acc)[perm], np.asarray(acc_p))
  # Greedy rows (temperature 0) follow the argmax rule.
  greedy = np.asarray(temperature) == 0
  argmax = np.argmax(np.asarray(logits), -1)
  d = np.asarray(drafts)
  for b in np.flatnonzero(greedy):
    a = 0
    while a < 2 and d[b, a] == argmax[b, a]:
      a += 1
    assert int(acc[b]) == a and int(out[b, a]) == argmax[b, a]


_draft_sample = jax.jit(functools.partial(draft_sample, coupled=True))


@pytest.mark.parametrize("config", ["plain", "temperature_top_p"])
def test_coupled_drafts_match_target_and_accept_as_a_gumbel_coupling(config):
  cfg = CONFIGS[config]
  temperature, top_k, top_p = cfg
  q1 = processed(np.log(Q1 + 1e-30), *cfg)  # the drafter's processed q
  q2 = np.stack([processed(np.log(Q2[x]), *cfg) for x in range(V)])
  keys = jax.random.split(jax.random.PRNGKey(7), N)
  positions = jnp.full(N, 9, jnp.int32)
  d1 = np.asarray(_draft_sample(jnp.asarray(np.broadcast_to(q1, (N, V)), jnp.float32), keys,
                                positions))
  d2 = np.asarray(_draft_sample(jnp.asarray(q2[d1], jnp.float32), keys, positions + 1))
  assert np.all(q1[d1] > 0)  # drafts are samples of q
  logits = np.stack([np.broadcast_to(LOGITS1, (N, V)), LOGITS2[d1], LOGITS2[d2]], 1)
  params = (jnp.full(N, temperature, jnp.float32), jnp.full(N, top_k, jnp.int32),
            jnp.full(N, top_p, jnp.float32))
  out, acc = _sampler(jnp.asarray(logits, jnp.float32), jnp.asarray(np.stack([d1, d2], 1),
                                                                    jnp.int32),
                      jnp.full(N, 2, jnp.int32), None, *params, keys, positions)
  out, acc = np.asarray(out), np.asarray(acc)
  nxt, _ = _sampler(jnp.asarray(LOGITS2[out[:, 0]][:, None], jnp.float32),
                    jnp.zeros((N, 0), jnp.int32), jnp.zeros(N, jnp.int32), None, *params, keys,
                    positions + 1)
  t1, t2 = out[:, 0], np.where(acc >= 1, out[:, 1], np.asarray(nxt)[:, 0])
  p1, joint = target_joint(cfg)
  assert chi_square_p(t1, p1) > P_THRESHOLD
  assert chi_square_p(t1 * V + t2, joint) > P_THRESHOLD
  # Acceptance of draft 1 against the bounds (4 standard errors of the mean of N draws).
  rate, tol = np.mean(acc >= 1), 4 * np.sqrt(0.25 / N)
  optimal = np.minimum(p1, q1).sum()
  assert optimal / (2 - optimal) - tol <= rate <= optimal + tol, (rate, optimal)
  assert rate > (p1 * q1).sum() + tol, (rate, (p1 * q1).sum())
