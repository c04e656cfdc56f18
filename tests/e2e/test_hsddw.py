"""HSDDW (``methods.hsddw``): greedy == AR, stops inside accepted runs, counters, the
threshold update by hand, seeded partner independence and the target distribution.

M1 is a scripted drafter right for 2 tokens (greedy tests) or a table of the target's
argmax continuations (distribution test), so M2's screen keeps some M1 tokens and
corrects others; ``initial_threshold`` 2.6 nats sits at the median M2 entropy of the
tiny draft (V = 48), so the dynamic window both stops blocks early and lets them run.
"""

import dataclasses

import numpy as np
import pytest
from e2e_lib import (
    DIST_PROMPT,
    ENGINE_CONFIG,
    K,
    TableDrafter,
    assert_target_law,
    check_counters,
    full_logits,
    law_requests,
    make_requests,
)
from e2e_lib import scripted_drafter as make_scripted

from methods.hsddw import HSDDW, HSDDWState, updated_threshold
from methods.ngram import NGram
from methods.registry import make_method
from specjax.config import SamplingParams
from specjax.engine import Engine
from specjax.method import VerifyResult
from specjax.request import Request

THRESHOLD = 2.6


def _run(engine, requests):
  """``(outputs, metrics, method state)`` of one run (the state caught from init_state)."""
  states = []
  method = engine.method
  real = type(method).init_state

  def init_state(self, runtime):
    states.append(real(self, runtime))
    return states[-1]

  type(method).init_state = init_state
  try:
    outputs, metrics = engine.generate(requests)
  finally:
    type(method).init_state = real
  return outputs, metrics, states[-1]


def _check_hsddw_counters(metrics, outputs, state):
  check_counters(metrics, outputs, K)
  c = state.counters
  drafted = sum(s.num_draft_tokens for s in metrics.steps)
  assert c["m1_accepted"] + c["m2_tokens"] == drafted, (c, drafted)
  assert 0 <= c["m1_accepted"] <= c["m1_proposed"]
  # One screen forward per drafting step, plus at most one per further drafted token.
  assert c["m2_forwards"] <= drafted + len(metrics.steps)
  # At most one rejected draft per drafting row-step.
  assert c["rejected"] <= sum(int(s.drafted_per_position[0]) for s in metrics.steps)


def test_threshold_update_by_hand():
  assert updated_threshold(2.0, 1.0, []) == 2.0
  assert updated_threshold(2.0, 1.0, [1.0, 0.4]) == pytest.approx(3.4 / 3)
  assert updated_threshold(2.0, 0.0, [1.0, 0.4]) == pytest.approx(0.7)
  assert updated_threshold(2.0, 0.0, []) == 2.0  # was 0/0 = nan before any rejection
  # Through observe: row 0 rejects draft 1 (entropy 0.5), row 1 accepts all 2 drafts,
  # row 2 rejects draft 0 (entropy 3.0) and ends (its history is dropped).
  method = HSDDW(k=4, m1=NGram(k=4), initial_threshold=2.0, prior_weight=1.0)
  class _KV:  # the draft KV is not needed here
    def drop(self, finished):
      pass

  state = HSDDWState(_KV(), None, {}, {}, dict(rejected=0))
  state.last_entropy = {"a": np.array([0.1, 0.5, 0.9], np.float32),
                        "b": np.array([0.2, 0.3], np.float32),
                        "c": np.array([3.0], np.float32)}
  res = VerifyResult(["a", "b", "c"], np.array([1, 2, 0]), [[1, 2], [1, 2, 3], [4]],
                     frozenset({"c"}))
  state = method.observe(state, res)
  assert method.threshold(state, "a") == pytest.approx((2.0 + 0.5) / 2)
  assert method.threshold(state, "b") == 2.0
  assert "c" not in state.rejected and state.counters["rejected"] == 2
  state.last_entropy["a"] = np.array([1.5], np.float32)
  state = method.observe(state, VerifyResult(["a"], np.array([0]), [[7]], frozenset()))
  assert method.threshold(state, "a") == pytest.approx((2.0 + 0.5 + 1.5) / 3)


def test_bad_options_are_refused():
  with pytest.raises(ValueError, match="initial_threshold"):
    HSDDW(initial_threshold=0.0)
  with pytest.raises(ValueError, match="m1="):
    HSDDW(m1="draft_model")
  with pytest.raises(ValueError, match="prior_weight"):
    HSDDW(prior_weight=-1.0)
  with pytest.raises(ValueError, match="m1=None"):  # not built from a name: the registry's job
    HSDDW()
  assert make_method("hsddw", 3).describe()["m1"] == "ngram"
  assert make_method("hsddw", 3) == HSDDW(k=3, m1=NGram(k=3))


@pytest.mark.parametrize("workload", [
    "queue12", pytest.param("batch1_ngram", marks=pytest.mark.slow)])  # slow: +compiles
def test_greedy_hsddw_equals_ar(make_engine, reference, workload):
  if workload == "queue12":  # 12 requests through 8 seats: rows join and finish apart
    requests = make_requests(4, 12)
    m1 = make_scripted(requests, reference, num_right=2)
  else:
    requests = make_requests(1, 1, prompt_len=(8, 12))
    m1 = NGram(k=K)
  engine = make_engine(HSDDW(k=K, m1=m1, initial_threshold=THRESHOLD))
  outputs, metrics, state = _run(engine, requests)
  assert [o.output_token_ids for o in outputs] == reference(requests)
  _check_hsddw_counters(metrics, outputs, state)
  if workload == "queue12":
    c = state.counters
    assert c["m1_accepted"] > 0 and c["m2_tokens"] > 0 and c["rejected"] > 0
    assert sum(s.num_draft_tokens for s in metrics.steps) < K * sum(
        int(s.drafted_per_position[0]) for s in metrics.steps)  # the window cut blocks


@pytest.mark.slow  # 27 s alone on the 2-core CPU (CI budget)
def test_stops_inside_accepted_runs(target, reference):
  """M2 = the target and M1 always right: every block is accepted whole, so stop ids,
  EOS and max_tokens fall inside accepted runs and must end requests as AR does."""
  prompt = (7, 21, 3, 30, 12)
  base = [Request("base", prompt, SamplingParams(max_tokens=26, ignore_eos=True))]
  cont = reference(base)[0]
  s = next(i for i in range(2, len(cont)) if cont[i] not in cont[:i])  # first occurrence
  requests = [
      Request("stop_id", prompt, SamplingParams(max_tokens=26, stop_token_ids=(cont[s],))),
      Request("max_tokens", prompt, SamplingParams(max_tokens=s + 2, ignore_eos=True)),
      Request("eos", prompt + (1,), SamplingParams(max_tokens=26)),
  ]
  eos = (cont[s],)
  m1 = make_scripted(requests, reference)
  engine = Engine(target, HSDDW(k=K, m1=m1, initial_threshold=10.0), ENGINE_CONFIG,
                  draft=target, eos_token_ids=eos)
  outputs, metrics, state = _run(engine, requests)
  assert [o.output_token_ids for o in outputs] == reference(requests, eos_ids=eos)
  assert outputs[0].output_token_ids == cont[: s + 1] and outputs[0].finish_reason == "stop"
  assert outputs[1].output_token_ids == cont[: s + 2] and outputs[1].finish_reason == "length"
  _check_hsddw_counters(metrics, outputs, state)
  assert state.counters["rejected"] == 0  # M2 = target: nothing rejected
  assert max(s.num_accepted for s in metrics.steps) >= 2 * (K - 1)


SEEDED = Request("seeded", (7, 21, 3, 30, 12, 44, 8),
                 SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12))


@pytest.mark.slow  # sampled drafting compiles per batch bucket: ~4 min on the 2-core CPU
def test_seeded_request_ignores_partners(make_engine):
  engine = make_engine(HSDDW(k=K, m1=NGram(k=K), initial_threshold=THRESHOLD))
  alone = engine.generate([SEEDED])[0][0].output_token_ids
  assert len(alone) == 12
  greedy = make_requests(11, 2, prefix="g")
  sampled = make_requests(12, 2, prefix="s", temperature=0.8, top_k=5, seed=3)
  for batch in ([*greedy, SEEDED], [sampled[0], SEEDED, greedy[0]], [SEEDED, *sampled]):
    outputs, metrics = engine.generate(batch)
    assert {o.request_id: o for o in outputs}["seeded"].output_token_ids == alone
    check_counters(metrics, outputs, K)
  other = dataclasses.replace(SEEDED, sampling=dataclasses.replace(SEEDED.sampling, seed=4321))
  assert engine.generate([other])[0][0].output_token_ids != alone


# ---------------------------------------------------------------- distribution
NUM_SAMPLES = 1024


@pytest.mark.slow  # 53 s alone on the 2-core CPU (CI budget)
def test_three_token_distribution_matches_target(make_engine, target):
  """Three sampled tokens per request (step 1 drafts 2: M1's 2 tokens screened by M2)."""
  p1 = full_logits(target, [list(DIST_PROMPT)])[0]
  g1 = int(np.argmax(p1))
  g2 = int(np.argmax(full_logits(target, [[*DIST_PROMPT, g1]])[0]))
  table = ((DIST_PROMPT, (g1, g2)),)
  method = HSDDW(k=K, m1=TableDrafter(table=table), initial_threshold=10.0)
  outputs, metrics, state = _run(make_engine(method), law_requests(NUM_SAMPLES, 3))
  _check_hsddw_counters(metrics, outputs, state)
  c = state.counters
  assert 0 < c["m1_accepted"] < c["m1_proposed"]  # M2 kept some M1 tokens, corrected others
  accepted = sum(s.num_accepted for s in metrics.steps)
  assert 0 < accepted < sum(s.num_draft_tokens for s in metrics.steps)
  assert_target_law(target, outputs, 3)
