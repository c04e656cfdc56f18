"""G2 for the learned drafters: stochastic SD with EAGLE / EAGLE-3 / MTP / Medusa heads
reproduces the target's sampling distribution.

Many seeded requests share one prompt; the joint distribution of their first two
output tokens (the second one drafted by the head after the first) is compared with the
target's own (temperature, no top-k), computed exactly by an uncached forward. The heads
are random, so both acceptance and rejection paths run (with top-k the random EAGLE heads'
sampled drafts fell outside the target's support and were never accepted, so the full
vocabulary is kept). Power: the same counts reject the distribution at a different
temperature.
"""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx
from test_learned_heads import ENGINE, KINDS, MAX_LEN, _method, target  # noqa: F401

from models.testing import chi_square_pvalue, full_forward
from specjax.config import SamplingParams
from specjax.engine import Engine
from specjax.request import Request

PROMPT = (7, 21, 3, 30, 12)
TEMPERATURE, TOP_K = 1.5, 0  # 0: no top-k
NUM_SAMPLES = 4096
P_THRESHOLD = 1e-3


def _probs(logits, temperature):
  """Temperature then top-k (if set), in numpy (independent of specjax.sampling)."""
  z = logits / temperature
  if TOP_K:
    kth = np.sort(z, axis=-1)[..., -TOP_K][..., None]
    z = np.where(z >= kth, z, -np.inf)
  e = np.exp(z - z.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def _next_logits(model_split, seqs):
  model = nnx.merge(model_split.graphdef, model_split.params)
  tokens = np.zeros((len(seqs), MAX_LEN), np.int32)
  for i, s in enumerate(seqs):
    tokens[i, : len(s)] = s
  logits = np.asarray(full_forward(model, tokens, lengths=[len(s) for s in seqs]).logits)
  return np.stack([logits[i, len(s) - 1] for i, s in enumerate(seqs)])


def _joint(model_split, temperature):
  """``p[x, y]`` of the first two tokens after ``PROMPT``."""
  p1 = _probs(_next_logits(model_split, [list(PROMPT)])[0], temperature)
  p2 = _probs(_next_logits(model_split, [[*PROMPT, x] for x in range(len(p1))]), temperature)
  return p1[:, None] * p2


@pytest.fixture(scope="module")
def joint(target):  # noqa: F811
  return {t: _joint(target, t) for t in (TEMPERATURE, 1.0)}


@pytest.mark.parametrize("kind", [k if k == "medusa" else  # ~50 s each on 2 CPU cores
                                  pytest.param(k, marks=pytest.mark.slow) for k in KINDS])
def test_two_token_distribution_matches_target(target, joint, kind):  # noqa: F811
  requests = [Request(f"d{i}", PROMPT, SamplingParams(temperature=TEMPERATURE, top_k=TOP_K,
                                                      seed=i, max_tokens=2))
              for i in range(NUM_SAMPLES)]
  outputs, metrics = Engine(target, _method(kind), ENGINE).generate(requests)
  accepted = sum(s.num_accepted for s in metrics.steps)
  drafted = sum(s.num_draft_tokens for s in metrics.steps)
  assert 0 < accepted < drafted, (accepted, drafted)  # both paths ran
  expected = joint[TEMPERATURE]
  counts = np.zeros_like(expected)
  for o in outputs:
    counts[tuple(o.output_token_ids)] += 1
  support = expected > 0
  assert counts[~support].sum() == 0  # nothing outside the target's support
  p_value = chi_square_pvalue(counts[support], expected[support], NUM_SAMPLES)
  assert p_value > P_THRESHOLD, (p_value, counts[support], expected[support] * NUM_SAMPLES)
  # Power: the distribution at temperature 1.0 is rejected.
  wrong = joint[1.0]
  assert chi_square_pvalue(counts[support], wrong[support], NUM_SAMPLES) < P_THRESHOLD
