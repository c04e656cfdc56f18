"""TurboSpec (``methods.turbospec``) and SV (``methods.sv``) through the engine.

Both wrap the draft model. Cost models are injected (no timing in tests): "expensive"
verification makes every draft slot lose goodput (TurboSpec drafts 0: pure AR steps),
"free" verification makes every slot pay (both reduce to the plain draft model: the
oracle check), "mid" gives mixed lengths. SV's companion is a third tiny model: the
target with its layer weights perturbed half as much as the draft's.
"""

import dataclasses

import numpy as np
import pytest
from e2e_lib import (
    K,
    assert_target_law,
    build_model,
    check_counters,
    law_requests,
    make_requests,
    model_config,
)

from methods.goodput import update_position_ema
from methods.registry import make_method
from methods.sv import choose_gamma, overlap_features
from methods.turbospec import plan_lengths
from specjax.config import SamplingParams
from specjax.cost_model import StepCostModel
from specjax.request import Request

EXPENSIVE = StepCostModel(verify_base=1e-3, verify_per_token=10.0)
FREE = StepCostModel(verify_base=1.0)
MID = StepCostModel(verify_base=1.0, verify_per_token=0.08, draft_base=0.05)


def _steps(metrics):
  return [(s.num_draft_tokens, s.num_accepted, s.num_emitted) for s in metrics.steps]


@pytest.fixture(scope="module")
def companion():
  return build_model(model_config(), seed=0, perturb=0.07)


@pytest.fixture(scope="module")
def plain(make_engine):
  return make_engine(make_method("draft_model", K))


def _sv(cost, companion):
  return make_method("sv", K, companion_model=companion, cost_model=cost)


# ---------------------------------------------------------------- hand-checked pieces
def test_hand_checked_planner_ema_gamma():
  assert plan_lengths(np.array([[0.9, 0.1]]), np.array([2]), 0,
                      StepCostModel(verify_base=1.0, verify_per_token=0.1)).tolist() == [1]
  alphas = np.array([[0.9, 0.9], [0.5, 0.5]])
  assert plan_lengths(alphas, np.array([2, 1]), 0, FREE).tolist() == [2, 1]
  assert plan_lengths(alphas, np.array([2, 2]), 0, EXPENSIVE).tolist() == [0, 0]
  # Load: at 0.8 s per batched token one row drafts 3 (goodput 1/1.8 -> 3.19/4.2), while
  # 8 rows draft nothing (8/7.4 = 1.081 beats 8.85/8.2 = 1.079 and every longer plan).
  load = StepCostModel(verify_base=1.0, verify_per_token=0.8)
  assert plan_lengths(np.full((1, 4), 0.85), np.array([4]), 0, load).tolist() == [3]
  assert plan_lengths(np.full((8, 4), 0.85), np.full(8, 4), 0, load).tolist() == [0] * 8
  np.testing.assert_allclose(update_position_ema(np.full(4, 0.85), 3, 1, 0.3),
                             [0.895, 0.595, 0.85, 0.85])
  np.testing.assert_allclose(update_position_ema(np.full(2, 0.5), 2, 2, 0.5), [0.75, 0.75])
  assert choose_gamma(np.array([0.9, 0.2]), lambda g: 1 + 0.25 * g) == 1
  assert choose_gamma(np.array([0.9, 0.9]), lambda g: 1.0) == 2
  # S = sum min(P_d, P_c), A = min(1, P_c(x) / P_d(x)); the greedy row scores P_c(x).
  pd = np.array([[[0.5, 0.5, 0.0]], [[0.5, 0.5, 0.0]]], np.float32)
  logits = np.log(np.array([[[0.2, 0.6, 0.2]], [[0.2, 0.6, 0.2]]], np.float32))
  s, a = overlap_features(pd, np.array([[0], [1]]), logits, np.array([1.0, 0.0], np.float32),
                          np.zeros(2, np.int32), np.ones(2, np.float32))
  np.testing.assert_allclose(np.asarray(s), [[0.7], [0.6]], atol=1e-6)
  np.testing.assert_allclose(np.asarray(a), [[0.4], [0.6]], atol=1e-6)


# ---------------------------------------------------------------- TurboSpec
def test_turbospec_expensive_verify_is_ar(make_engine, reference):
  requests = make_requests(3, 8)
  outputs, metrics = make_engine(make_method("turbospec", K, cost_model=EXPENSIVE)).generate(
      requests)
  assert [o.output_token_ids for o in outputs] == reference(requests)
  assert all(s.num_draft_tokens == 0 and s.query_bucket == 1 for s in metrics.steps)
  check_counters(metrics, outputs, K)


@pytest.mark.slow  # compiles: CI keeps the hand-checked, AR-limit and SV batch-8 tests
def test_turbospec_free_verify_is_the_plain_drafter(make_engine, plain):
  requests = make_requests(3, 5) + make_requests(4, 3, temperature=1.0, seed=5, prefix="s")
  want, want_m = plain.generate(requests)
  outputs, metrics = make_engine(make_method("turbospec", K, cost_model=FREE)).generate(requests)
  assert [o.output_token_ids for o in outputs] == [o.output_token_ids for o in want]
  assert _steps(metrics) == _steps(want_m)


@pytest.mark.slow
@pytest.mark.parametrize("seed, n", [(1, 1), (2, 3), (3, 8)])
def test_turbospec_greedy_equals_ar(make_engine, reference, seed, n):
  requests = make_requests(seed, n)
  engine = make_engine(make_method("turbospec", K, cost_model=MID))
  outputs, metrics = engine.generate(requests)
  assert [o.output_token_ids for o in outputs] == reference(requests)
  check_counters(metrics, outputs, K)
  if n == 8:  # the planner cut some rows below their budget, and drafted for others
    assert any(s.num_draft_tokens > 0 for s in metrics.steps)
    assert any(0 < s.num_draft_tokens < K * s.num_rows for s in metrics.steps)


# ---------------------------------------------------------------- SV
@pytest.mark.parametrize("seed, n", [pytest.param(1, 1, marks=pytest.mark.slow), (3, 8)])
def test_sv_greedy_equals_ar(make_engine, reference, companion, seed, n):
  requests = make_requests(seed, n)
  outputs, metrics = make_engine(_sv(MID, companion)).generate(requests)
  assert [o.output_token_ids for o in outputs] == reference(requests)
  check_counters(metrics, outputs, K)


@pytest.mark.slow  # compiles: CI keeps the hand-checked, AR-limit and SV batch-8 tests
def test_sv_free_verify_is_the_plain_drafter(make_engine, plain, companion):
  requests = make_requests(3, 5) + make_requests(4, 3, temperature=1.0, seed=5, prefix="s")
  want, want_m = plain.generate(requests)
  outputs, metrics = make_engine(_sv(FREE, companion)).generate(requests)
  assert [o.output_token_ids for o in outputs] == [o.output_token_ids for o in want]
  assert _steps(metrics) == _steps(want_m)


@pytest.mark.slow  # compiles: CI keeps the hand-checked, AR-limit and SV batch-8 tests
def test_sv_stops_inside_accepted_runs(make_engine, reference, companion):
  requests = make_requests(7, 6, prompt_len=(2, 8), max_tokens=(3, 12))
  stop = [o[len(o) // 2] for o in reference(requests) if len(o) > 2][0]
  requests = [Request(r.request_id, r.prompt_token_ids,
                      SamplingParams(max_tokens=r.sampling.max_tokens, stop_token_ids=(stop,)))
              for r in requests]
  outputs, metrics = make_engine(_sv(MID, companion)).generate(requests)
  assert [o.output_token_ids for o in outputs] == reference(requests)
  assert any(o.finish_reason == "stop" for o in outputs)
  check_counters(metrics, outputs, K)


SEEDED = Request("seeded", (7, 21, 3, 30, 12, 44, 8),
                 SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12))


@pytest.mark.slow
@pytest.mark.parametrize("which", ["sv", "turbospec_free"])
def test_seeded_partner_independence(make_engine, companion, which):
  """SV's sampled rows use per-request tables only; TurboSpec's lengths depend on load,
  so its seeded replay holds where the plan is load-free (free verification)."""
  method = (_sv(MID, companion) if which == "sv"
            else make_method("turbospec", K, cost_model=FREE))
  engine = make_engine(method)
  alone = engine.generate([SEEDED])[0][0].output_token_ids
  partners = make_requests(11, 5, prefix="g") + make_requests(12, 2, temperature=0.8, top_k=5,
                                                               seed=3, prefix="s")
  for batch in ([*partners[:2], SEEDED], [SEEDED, *partners]):
    outputs, metrics = engine.generate(batch)
    assert {o.request_id: o for o in outputs}["seeded"].output_token_ids == alone
    check_counters(metrics, outputs, K)


# ---------------------------------------------------------------- lossless under sampling
NUM_SAMPLES = 1024


@pytest.mark.slow
@pytest.mark.parametrize("which", ["sv", "svip", "turbospec"])
def test_two_token_distribution_matches_target(make_engine, target, companion, which):
  """Three tokens after a fixed prompt, drafted in one step (so the length rule acts on
  real drafts), follow the target's joint distribution of the first two."""
  method = {"sv": lambda: _sv(MID, companion),
            "svip": lambda: make_method("svip", K, h=0.62),
            "turbospec": lambda: make_method("turbospec", K, cost_model=MID)}[which]()
  outputs, metrics = make_engine(method).generate(law_requests(NUM_SAMPLES, 3))
  check_counters(metrics, outputs, K)
  accepted = sum(s.num_accepted for s in metrics.steps)
  drafted = sum(s.num_draft_tokens for s in metrics.steps)
  assert 0 < accepted < drafted
  assert_target_law(target, outputs, 2)


@pytest.mark.slow
def test_profiled_cost_model(target, draft):
  """The start-up profile times the tiny target and draft on this host: every fitted
  coefficient is finite and >= 0, and a step costs more with more batched tokens."""
  from methods.goodput import profile_cost_model  # noqa: PLC0415
  from specjax.method import RuntimeInfo  # noqa: PLC0415

  runtime = RuntimeInfo(target=target, draft=draft, num_pages=16, page_size=8,
                        max_model_len=32, attention_implementation="reference")
  cost = profile_cost_model(runtime, K, context=32, repeats=3)
  draft = cost.draft("draft_model")
  assert cost.target.fixed_s > 0 and draft.per_step_s + draft.per_row_token_s > 0
  assert cost.step_time(8, 40, 256, {"draft_model": (8, 4)}) >= cost.step_time(1, 1, 8)


def test_bad_options(companion, tmp_path):
  with pytest.raises(ValueError, match="beta=0"):
    make_method("turbospec", K, beta=0.0, cost_model=FREE)
  with pytest.raises(ValueError, match="verify_per_token=-1"):
    StepCostModel(verify_base=1.0, verify_per_token=-1.0)
  # A cost model without the drafter's draft cost (the preset has ngram, eagle, eagle3).
  with pytest.raises(ValueError, match="has no draft cost for method='draft_model'"):
    make_method("turbospec", K, cost_model="seed-llama8b-h100")
  path = tmp_path / "mid.json"
  path.write_text(MID.to_json())
  assert make_method("turbospec", K, cost_model=str(path)).cost_model == MID
  assert make_method("turbospec", K, cost_model={"verify_base": 1.0}).cost_model == FREE
  with pytest.raises(ValueError, match="exactly one"):
    make_method("sv", K, cost_model=FREE)
  with pytest.raises(ValueError, match="num_bins=0"):
    make_method("sv", K, companion_model=companion, num_bins=0)
  with pytest.raises(ValueError, match="trees"):
    make_method("turbospec", K, drafter="eagle", drafter_options={"feature_layers": [2],
                                                                  "tree_nodes": 4})
  for m in (make_method("turbospec", K, cost_model={"verify_base": 1.0}),
            make_method("sv", K, companion_model=companion, cost_model=FREE)):
    row = m.describe()  # flat, scalar result-row columns
    assert row["drafter.method"] == "draft_model" and "companion_model" not in row
    assert all(v is None or isinstance(v, (bool, int, float, str)) for v in row.values())


@pytest.mark.slow
def test_sv_keeps_a_requests_calibration_through_preemption(make_engine, companion,
                                                            monkeypatch):
  """A preempted request comes back as a new one to the drafter; its per-request table
  (what its verified lengths are learned from) must survive until it finishes, or a
  seeded sampled request's tokens depend on the pool pressure its partners cause."""
  from e2e_lib import ENGINE_CONFIG  # noqa: PLC0415

  from methods import sv  # noqa: PLC0415

  finished, early = set(), []

  class Tables(dict):
    def pop(self, rid, *default):
      if rid in self and rid not in finished:
        early.append(rid)
      return super().pop(rid, *default)

  init, observe = sv.SpeculativeVerification.init_state, sv.SpeculativeVerification.observe
  monkeypatch.setattr(sv.SpeculativeVerification, "init_state", lambda self, rt: dataclasses.replace(
      init(self, rt), tables=Tables()))
  monkeypatch.setattr(sv.SpeculativeVerification, "observe", lambda self, state, result: (
      finished.update(result.finished), observe(self, state, result))[1])
  requests = [Request(f"s{i}", (7 + i, 21, 3, 30, 12, 44), SamplingParams(
      temperature=0.8, top_p=0.9, seed=10 + i, max_tokens=24)) for i in range(4)]
  full, full_m = make_engine(_sv(MID, companion)).generate(requests)
  tight, tight_m = make_engine(_sv(MID, companion),
                               config=ENGINE_CONFIG.replace(num_pages=6)).generate(requests)
  assert full_m.num_preemptions == 0 and tight_m.num_preemptions > 0
  assert early == []  # no table dropped before its request finished
  assert [o.output_token_ids for o in tight] == [o.output_token_ids for o in full]


def test_sv_propose_keeps_the_table_of_a_request_back_from_preemption(companion):
  """The drafter sees a preempted request as new again (``ProposeContext.new_requests``);
  SV restarts its companion KV for it but keeps its calibration table."""
  from e2e_lib import ScriptedDrafter  # noqa: PLC0415

  from methods import sv  # noqa: PLC0415
  from specjax.method import Draft, ProposeContext  # noqa: PLC0415

  class NoDrafts(ScriptedDrafter):
    def propose(self, state, context):
      rows = len(context.request_ids)
      return state, Draft(np.full((rows, K), -1, np.int32), np.zeros(rows, np.int32))

  method = make_method("sv", K, companion_model=companion, cost_model=MID,
                       drafter=NoDrafts(k=K))
  table = np.ones((2, method.num_bins))
  state = sv._State(None, None, None, {"r": 9}, MID, np.zeros((2, method.num_bins)),
                    {"r": table}, {}, "reference")
  ctx = ProposeContext(request_ids=["r"], token_ids=[np.arange(5, dtype=np.int32)],
                       budgets=np.array([K], np.int32), page_indices=np.zeros((1, 4), np.int32),
                       temperature=np.ones(1, np.float32), top_k=np.zeros(1, np.int32),
                       top_p=np.ones(1, np.float32), keys=np.zeros((1, 2), np.uint32),
                       new_requests=frozenset({"r"}))
  state, draft = method.propose(state, ctx)
  assert state.written["r"] == 0  # its companion KV is rebuilt
  assert state.tables["r"] is table  # its calibration is kept
  assert int(np.asarray(draft.num_tokens)[0]) == 0
