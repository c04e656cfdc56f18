"""The engine with ``verify_implementation`` set: the fused chain sampler
(``specjax.verify.fused_rejection_sample`` over ``pallas_kernels.verify``).

G1: greedy SD equals the uncached greedy reference token for token. G2: the first two
tokens of many seeded draft-model requests at temperature 1.5 follow the target's own
tempered distribution (chi-square; the draft's distribution fails the same test).
Bad input: top-k/top-p requests are refused with a clear error. The default
``verify_implementation="auto"`` picks the fused sampler only for temperature-only steps.
"""

import numpy as np
import pytest
from e2e_lib import ENGINE_CONFIG, K, check_counters, full_logits, make_requests

from models.testing import chi_square_pvalue
from pallas_kernels.verify import implementations_used
from specjax.config import SamplingParams
from specjax.request import Request

FUSED = ENGINE_CONFIG.replace(verify_implementation=("pallas_triton", "reference"))


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_greedy_fused_equals_reference(make_engine, reference, method):
  requests = make_requests(21, 6)
  outputs, metrics = make_engine(method, FUSED).generate(requests)
  assert [o.output_token_ids for o in outputs] == reference(requests)
  check_counters(metrics, outputs, K)
  # On CPU the Triton kernel needs interpret mode, so the dispatcher fell through to
  # the jnp reference of the same op, and recorded it.
  assert "reference" in implementations_used()


DIST_PROMPT = (7, 21, 3, 30, 12)
TEMPERATURE = 1.5
NUM_SAMPLES = 1024


def _joint(model):
  def probs(logits):
    z = logits / TEMPERATURE
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)

  p1 = probs(full_logits(model, [list(DIST_PROMPT)])[0])
  p2 = probs(full_logits(model, [[*DIST_PROMPT, x] for x in range(len(p1))]))
  return p1[:, None] * p2


def test_fused_two_token_distribution_matches_target(make_engine, target, draft):
  requests = [Request(f"f{i}", DIST_PROMPT,
                      SamplingParams(temperature=TEMPERATURE, seed=i, max_tokens=2))
              for i in range(NUM_SAMPLES)]
  outputs, metrics = make_engine("draft_model", FUSED).generate(requests)
  check_counters(metrics, outputs, K)
  accepted = sum(s.num_accepted for s in metrics.steps)
  drafted = sum(s.num_draft_tokens for s in metrics.steps)
  assert 0 < accepted < drafted
  counts = np.zeros_like(_joint(target))
  for o in outputs:
    counts[tuple(o.output_token_ids)] += 1
  expected = _joint(target)
  assert chi_square_pvalue(counts.ravel(), expected.ravel(), NUM_SAMPLES) > 1e-3
  assert chi_square_pvalue(counts.ravel(), _joint(draft).ravel(), NUM_SAMPLES) < 1e-3


def test_fused_refuses_top_k_top_p_and_unknown_names(make_engine):
  req = Request("tk", DIST_PROMPT, SamplingParams(temperature=1.0, top_k=3, max_tokens=2))
  with pytest.raises(ValueError, match="top_k=3"):
    make_engine("draft_model", FUSED).generate([req])
  with pytest.raises(ValueError, match="verify_implementation='cuda'"):
    ENGINE_CONFIG.replace(verify_implementation="cuda")


def test_auto_uses_fused_for_temperature_only_steps(make_engine, monkeypatch):
  """verify_implementation="auto" (the default): the fused sampler for sampled chain
  steps whose requests use temperature only, not for all-greedy steps, and in a step with
  a top-k request that request's row from the jnp sampler while the temperature-only
  rows keep the fused sampler's tokens (the same as without the top-k partner)."""
  import specjax.engine as engine_mod

  calls = []
  real = engine_mod.engine_step

  def spy(*a, **kw):
    if kw["plan"].sampler.startswith("fused"):
      calls.append(kw["plan"].fused_implementation)
    return real(*a, **kw)

  monkeypatch.setattr(engine_mod, "engine_step", spy)
  assert ENGINE_CONFIG.verify_implementation == "auto"
  engine = make_engine("draft_model", ENGINE_CONFIG)
  engine.generate(make_requests(3, 2))  # greedy
  assert calls == []
  temp_only = [Request(f"t{i}", DIST_PROMPT, SamplingParams(temperature=1.0, seed=i,
                                                            max_tokens=6)) for i in range(2)]
  engine.generate(temp_only)
  assert calls and set(calls) == {("reference",)}
  alone = [o.output_token_ids for o in engine.generate(temp_only)[0]]
  top_k = Request("k", DIST_PROMPT, SamplingParams(temperature=1.0, top_k=3, seed=9, max_tokens=6))
  mixed, _ = engine.generate([*temp_only, top_k])  # no refusal
  assert [o.output_token_ids for o in mixed[:2]] == alone
  k_alone = engine.generate([top_k])[0][0].output_token_ids  # the jnp sampler alone
  assert mixed[2].output_token_ids == k_alone
