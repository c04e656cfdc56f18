"""Stochastic decoding through the engine.

G3: a seeded request gives the same tokens alone, next to different batch partners (at
different rows, greedy and stochastic, shorter and longer), and after other runs of
the same engine (stale KV pages, draft-model state).

G2 (engine level): the first two tokens of many seeded draft-model SD requests follow
the target's own sampling distribution (temperature + top-k), computed exactly from the
uncached forward; the same counts are far from the draft's distribution (power).
"""

import numpy as np
import pytest
from e2e_lib import K, check_counters, full_logits, make_requests

from models.testing import chi_square_pvalue
from specjax.config import SamplingParams
from specjax.request import Request

SEEDED = Request("seeded", (7, 21, 3, 30, 12, 44, 8),
                 SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12))


def _partners(seed, n):
  greedy = make_requests(seed, (n + 1) // 2, prefix=f"g{seed}-")
  sampled = make_requests(seed + 100, n // 2, prefix=f"s{seed}-", temperature=0.8, top_k=5,
                          seed=seed)
  return greedy + sampled


@pytest.mark.parametrize(
    "method", ["draft_model", pytest.param("ngram", marks=pytest.mark.slow)])  # slow: +compiles
def test_seeded_request_is_reproducible(make_engine, method):
  engine = make_engine(method)
  alone, _ = engine.generate([SEEDED])
  tokens = alone[0].output_token_ids
  assert len(tokens) == 12
  # Partners at both sides of the row, different batch buckets (4 and 8).
  batches = [
      [*_partners(1, 2), SEEDED],
      [SEEDED, *_partners(2, 7)],
      _partners(3, 3)[:2] + [SEEDED] + _partners(3, 3)[2:],
  ]
  for batch in batches:
    outputs, metrics = engine.generate(batch)
    by_id = {o.request_id: o for o in outputs}
    assert by_id["seeded"].output_token_ids == tokens
    check_counters(metrics, outputs, K)
  again, _ = engine.generate([SEEDED])  # after other runs of the same engine
  assert again[0].output_token_ids == tokens
  fresh, _ = make_engine(method).generate([SEEDED])
  assert fresh[0].output_token_ids == tokens
  # The seed matters (else the test above would be vacuous).
  other = Request("seeded", SEEDED.prompt_token_ids,
                  SamplingParams(temperature=1.0, top_p=0.9, seed=4321, max_tokens=12))
  assert engine.generate([other])[0][0].output_token_ids != tokens


def test_unseeded_request_samples_anew_per_submission(make_engine):
  """An unseeded request draws fresh randomness each time it is submitted (its key came
  from (engine seed, request id) before, so resubmitting returned the identical sample),
  while a seeded one reproduces exactly."""
  reqs = [Request(f"unseeded{i}", SEEDED.prompt_token_ids,
                  SamplingParams(temperature=1.0, max_tokens=12)) for i in range(6)]
  engine = make_engine("draft_model")
  first = [o.output_token_ids for o in engine.generate(reqs)[0]]
  again = [o.output_token_ids for o in engine.generate(reqs)[0]]
  assert sum(a == b for a, b in zip(first, again)) <= 1, (first, again)
  seeded = [engine.generate([SEEDED])[0][0].output_token_ids for _ in range(2)]
  assert seeded[0] == seeded[1]


# ---------------------------------------------------------------- G2 engine level
DIST_PROMPT = (7, 21, 3, 30, 12)
TEMPERATURE, TOP_K = 1.5, 3
NUM_SAMPLES = 1024
P_THRESHOLD = 1e-3


def _probs(logits):
  """Processed target distribution in numpy: temperature, then top-k (independent code)."""
  z = logits / TEMPERATURE
  kth = np.sort(z, axis=-1)[..., -TOP_K][..., None]
  z = np.where(z >= kth, z, -np.inf)
  e = np.exp(z - z.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def _joint(model):
  """``p[x, y]`` of the first two tokens after ``DIST_PROMPT`` (exact, uncached)."""
  p1 = _probs(full_logits(model, [list(DIST_PROMPT)])[0])
  p2 = _probs(full_logits(model, [[*DIST_PROMPT, x] for x in range(len(p1))]))
  return p1[:, None] * p2


def test_two_token_distribution_matches_target(make_engine, target, draft):
  requests = [Request(f"d{i}", DIST_PROMPT,
                      SamplingParams(temperature=TEMPERATURE, top_k=TOP_K, seed=i, max_tokens=2))
              for i in range(NUM_SAMPLES)]
  outputs, metrics = make_engine("draft_model").generate(requests)
  check_counters(metrics, outputs, K)
  accepted = sum(s.num_accepted for s in metrics.steps)
  drafted = sum(s.num_draft_tokens for s in metrics.steps)
  assert 0 < accepted < drafted  # both acceptance and rejection paths ran
  expected = _joint(target)
  counts = np.zeros_like(expected)
  for o in outputs:
    counts[tuple(o.output_token_ids)] += 1
  support = expected > 0
  assert counts[~support].sum() == 0  # nothing outside the target's top-k support
  p_value = chi_square_pvalue(counts[support], expected[support], NUM_SAMPLES)
  assert p_value > P_THRESHOLD, (p_value, counts[support], expected[support] * NUM_SAMPLES)
  # Power: the draft's own distribution is rejected by the same test on the same counts.
  q = _joint(draft)
  q_support = q > 0
  assert counts[~q_support].sum() > 0 or (
      chi_square_pvalue(counts[q_support], q[q_support], NUM_SAMPLES) < P_THRESHOLD)
