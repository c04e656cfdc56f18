"""Bound simulator on hand-computable traces: every expected number is worked out below."""

import dataclasses

import numpy as np
import pytest

from harness import simulator
from harness.simulator import Policy
from harness.traces import MethodTrace, TraceRecord
from specjax import cost_model
from specjax.cost_model import CostModel, DraftCost, OverheadCost, TargetCost

MS = 1e-3
# target = 10 ms + 1 ms per verified token (kv free); draft "a" 2 ms per step it drafts,
# draft "b" 1 ms per draft position; no overheads.
COST = CostModel(name="test", target=TargetCost(fixed_s=10 * MS, per_query_token_s=1 * MS,
                                                per_kv_token_s=0.0),
                 drafts={"a": DraftCost(fixed_s=2 * MS), "b": DraftCost(per_step_s=1 * MS)},
                 overhead=OverheadCost())
# Request A: prompt 3 tokens, 7 output tokens (decoding starts at position 1).
ACC_A = {"a": [1, 4, 3, 2, 1, 2, 1], "b": [1, 2, 1, 3, 2, 3, 1]}
# Request B: prompt 2 tokens, 3 output tokens.
ACC_B = {"a": [1, 2, 1], "b": [1, 1, 1]}


def record(rid, prompt_len, accs):
  n = len(next(iter(accs.values())))
  return TraceRecord(rid, [0] * prompt_len, [0] * n,
                     {m: MethodTrace(np.asarray(a), {}) for m, a in accs.items()})


A = record("A", 3, ACC_A)
B = record("B", 2, ACC_B)


def sim(records, policy, batch=1, cost=COST, **kw):
  return simulator.simulate(records, cost, policy, batch, include_prefill=False, **kw)


def test_fixed_k_one_request():
  # AR: positions 1..6, six steps of 10 + 1 = 11 ms -> 66 ms.
  # Fixed k=2 (method a):
  #   pos 1: l = min(2, 7-1-1) = 2, commit min(4, 3) = 3 -> pos 4; 10 + 3 + 2 (draft) = 15
  #   pos 4: l = 2, commit min(1, 3) = 1 -> pos 5;                    10 + 3 + 2 = 15
  #   pos 5: l = min(2, 7-5-1) = 1, commit min(2, 2) = 2 -> pos 7;     10 + 2 + 2 = 14
  # SD = 44 ms: speedup 66/44 = 1.5, tau 6/3 = 2, verify share (13+13+12)/44,
  # wasted verify 1 - 6/(3+3+2) = 0.25.
  r = sim([A], Policy(kind="fixed", methods=("a",), k=2))
  assert r["ar_time_s"] == pytest.approx(66 * MS)
  assert r["sd_time_s"] == pytest.approx(44 * MS)
  assert r["speedup"] == pytest.approx(1.5)
  assert r["tau"] == 2.0 and r["sd_steps"] == 3
  assert r["verify_share"] == pytest.approx(38 / 44)
  assert r["draft_share"] == pytest.approx(6 / 44)
  assert r["wasted_verify_share"] == pytest.approx(0.25)


def test_fixed_k_respects_draft_len():
  # Method a proposed only 1 draft at position 1 (draft_len): l = 1, commit min(4, 2) = 2
  # -> pos 3: l = 2, commit min(2, 3) = 2 -> pos 5: l = 1, commit 2 -> pos 7.
  # Steps 12 + 2, 13 + 2, 12 + 2 = 43 ms; tau 6/3.
  rec = record("A", 3, ACC_A)
  rec.methods["a"].extras["draft_len"] = np.asarray([0, 1, 16, 16, 16, 16, 16])
  r = sim([rec], Policy(kind="fixed", methods=("a",), k=2))
  assert r["sd_time_s"] == pytest.approx(43 * MS) and r["tau"] == 2.0


def test_oracle_length():
  # pos 1: acc 4 -> l = 3, commit 4 -> pos 5; 10 + 4 + 2 = 16
  # pos 5: acc 2 (2 tokens left) -> l = 1, commit 2; 10 + 2 + 2 = 14
  # SD 30 ms: speedup 66/30 = 2.2, tau 3, nothing wasted.
  r = sim([A], Policy(kind="oracle", methods=("a",)))
  assert r["speedup"] == pytest.approx(2.2)
  assert r["tau"] == 3.0 and r["wasted_verify_share"] == 0.0
  # Capped at k = 1: every step drafts 1 and commits 2: pos 1, 3, 5 -> 3 steps of 14 ms.
  r = sim([A], Policy(kind="oracle", methods=("a",), k=1))
  assert r["sd_time_s"] == pytest.approx(42 * MS) and r["tau"] == 2.0
  # Fixed width k = 3 (the engine's zero-cost oracle point): the same commits, each step
  # charged 3 drafts: pos 1 (l = 3) 16 ms, pos 5 (l = 1, verified at 3) 16 ms.
  wide = Policy(kind="oracle", methods=("a",), k=3, fixed_width=True)
  r = sim([A], wide)
  assert r["sd_time_s"] == pytest.approx(32 * MS) and r["tau"] == 3.0
  # 8 tokens verified (4 a step), 6 committed: a quarter wasted (the bound wastes none).
  assert r["wasted_verify_share"] == pytest.approx(0.25)
  # A per-row-token SD overhead of 0.5 ms is charged at the verified length: 3 at both
  # steps (+1.5 + 1.5 ms), where the bound's steps pay it at 3 and 1 (+1.5 + 0.5 ms).
  per_token = dataclasses.replace(
      COST, overhead=OverheadCost(sd_per_row_token_s=0.5 * MS))
  assert sim([A], wide, cost=per_token)["sd_time_s"] == pytest.approx(35 * MS)
  assert sim([A], Policy(kind="oracle", methods=("a",), k=3), cost=per_token)[
      "sd_time_s"] == pytest.approx(32 * MS)


def test_oracle_combination_with_switching_cost():
  # pos 1: a 4, b 2 -> a (l = 3): 10 + 4 + 2 = 16 -> pos 5.
  # pos 5: a 2, b min(3, 2 left) = 2 -> tie; one-row draft cost a 2 ms > b 1 ms -> b
  #   (l = 1): 10 + 2 + 1 (b) + 5 (switch a -> b) = 18 -> pos 7.
  # SD 34 ms: speedup 66/34, one switch, switch share 5/34.
  cost = COST.with_switch(5 * MS)
  r = sim([A], Policy(kind="combine", methods=("a", "b")), cost=cost)
  assert r["sd_time_s"] == pytest.approx(34 * MS)
  assert r["speedup"] == pytest.approx(66 / 34)
  assert r["num_switches"] == 1 and r["switch_share"] == pytest.approx(5 / 34)
  # Without the switching cost: 16 + 13 = 29 ms.
  assert sim([A], Policy(kind="combine", methods=("a", "b")))["sd_time_s"] == pytest.approx(
      29 * MS)


def test_batch_two_continuous_and_copies():
  # Continuous, batch 2, requests A and B:
  # AR: step 1 both rows (q 2): 12; step 2 both: 12 (B done at pos 3); A alone at pos
  #   3..6: 4 x 11 = 44 -> 68 ms.
  # Fixed k=2: step 1: A l 2 commit 3 (pos 4); B l min(2, 3-1-1) = 1 commit 2 (done);
  #   q = 3 + 2 = 5 -> 15 + draft a 2 (one call for both rows) = 17;
  #   step 2: A l 2 commit 1: 13 + 2 = 15; step 3: A l 1 commit 2: 12 + 2 = 14 -> 46 ms.
  #   tau = (3 + 2 + 1 + 2) / (2 + 1 + 1) = 2.
  r = sim([A, B], Policy(kind="fixed", methods=("a",), k=2), batch=2)
  assert r["ar_time_s"] == pytest.approx(68 * MS)
  assert r["sd_time_s"] == pytest.approx(46 * MS)
  assert r["speedup"] == pytest.approx(68 / 46) and r["tau"] == 2.0
  # Over the full-batch steps only (both rows running): SD step 1 commits 3 + 2 in 17 ms
  # (tau 5 / 2); AR steps 1 and 2 commit 4 in 24 ms: speedup (5 / 17) / (4 / 24).
  assert r["full_tau"] == 2.5
  assert r["full_speedup"] == pytest.approx((5 / 17) / (4 / 24))
  # min_occupancy 0.5 (at least one of two rows): every step counts, as end to end
  # without the prefills.
  half = sim([A, B], Policy(kind="fixed", methods=("a",), k=2), batch=2, min_occupancy=0.5)
  assert half["full_tau"] == 2.0
  assert half["full_speedup"] == pytest.approx(68 / 46)
  with pytest.raises(ValueError, match="min_occupancy=0 must be in"):
    sim([A, B], Policy(kind="fixed", methods=("a",), k=2), batch=2, min_occupancy=0)
  # Copies (the seed's batching), batch 2, request A: AR 6 steps of 10 + 2 = 72 ms;
  # SD steps q = 2*3, 2*3, 2*2: 16 + 2, 16 + 2, 14 + 2 = 52 ms; speedup 72/52.
  r = sim([A], Policy(kind="fixed", methods=("a",), k=2), batch=2, batching="copies")
  assert r["speedup"] == pytest.approx(72 / 52)
  # Batch 1 continuous over A and B runs them one after the other: B adds one AR step
  # (pos 1 -> 2 -> 3: two steps of 11) and one SD step (pos 1: l 1, commit 2: 12 + 2).
  r = sim([A, B], Policy(kind="fixed", methods=("a",), k=2))
  assert r["ar_time_s"] == pytest.approx(88 * MS) and r["sd_time_s"] == pytest.approx(58 * MS)


def test_kv_prefill_overhead_and_padding():
  # AR over A with 0.5 ms per KV token, 1 ms AR overhead per step, prefill included:
  # prefill 10 + 3 (prompt) + 1 = 14; steps at pos 1..6 with kv = 3 + pos = 4..9:
  # sum(10 + 1 + 0.5 kv + 1) = 72 + 0.5 * 39 = 91.5 -> 105.5 ms.
  cost = CostModel(name="kv", target=TargetCost(fixed_s=10 * MS, per_query_token_s=1 * MS,
                                                per_kv_token_s=0.5 * MS),
                   drafts={"a": DraftCost()}, overhead=OverheadCost(ar_step_s=1 * MS))
  r = simulator.simulate([A], cost, Policy(kind="fixed", methods=("a",), k=1), 1)
  assert r["ar_time_s"] == pytest.approx(105.5 * MS)
  engine = CostModel(name="e", target=COST.target, drafts={}, overhead=OverheadCost(),
                     query_padding="engine")
  # 3 rows verifying 1, 3, 0 drafts: bucket(3) = 4 rows x (bucket(3) = 4 + 1) = 20 tokens.
  assert engine.query_tokens([1, 3, 0]) == 20 and COST.query_tokens([1, 3, 0]) == 7


def test_seed_preset_and_json_round_trip(tmp_path):
  seed = cost_model.preset("seed-llama8b-h100")
  # AR step at batch 1, empty KV: 5.88590713 + 0.0210103129 + 1.20683946 ms = 7.1138 ms
  # (the seed's ~140 tok/s).
  step = seed.target.time(0, 1) + seed.overhead.ar(1)
  assert step == pytest.approx(5.88590713e-3 + 2.10103129e-5 + 1.20683946e-3)
  # EAGLE with 3 drafts: 2.13526175e-3 + 8.41429603e-7 * (3 + 1) + 2.37768493e-9 * kv.
  assert seed.draft("eagle").time(1, 3, 1000, 0.0) == pytest.approx(
      2.13526175e-3 + 4 * 8.41429603e-7 + 1000 * 2.37768493e-9)
  assert seed.draft("ngram").time(1, 3, 0, 0.01) == pytest.approx(0.005875 * 0.01)
  path = tmp_path / "c.json"
  path.write_text(seed.to_json())
  assert cost_model.load(str(path)) == seed
  with pytest.raises(ValueError, match="has no draft cost for method='suffix'"):
    seed.draft("suffix")
  with pytest.raises(ValueError, match="preset name='nope' is unknown"):
    cost_model.preset("nope")


def test_bad_policies():
  with pytest.raises(ValueError, match="needs k >= 1"):
    Policy(kind="fixed", methods=("a",))
  with pytest.raises(ValueError, match="exactly one method"):
    Policy(kind="oracle", methods=("a", "b"))
  with pytest.raises(ValueError, match="kind='best' must be one of"):
    Policy(kind="best")
  with pytest.raises(ValueError, match="fixed_width=True needs policy 'oracle' or 'combine' "
                     "with k >= 1, got kind='oracle', k=0"):
    Policy(kind="oracle", methods=("a",), fixed_width=True)
  with pytest.raises(ValueError, match="got kind='fixed', k=2"):
    Policy(kind="fixed", methods=("a",), k=2, fixed_width=True)
  with pytest.raises(ValueError, match="has no trace for method 'c'"):
    sim([A], Policy(kind="oracle", methods=("c",)))
  with pytest.raises(ValueError, match="batch_size=0 must be >= 1"):
    sim([A], Policy(kind="oracle", methods=("a",)), batch=0)


def test_compare_engine_loop_rows():
  # Engine-loop row batch 2, context 10, L 1 (acc 2 everywhere), 4 new tokens, decoding
  # from position 0 (specjax): pos 0 -> 2 -> 4, two steps of q = 2 x 2 = 4 tokens:
  # 10 + 4 + 1 (SD overhead) = 15 ms; the L = 0 row: AR steps of 10 + 2 + 0.5 = 12.5 ms.
  import pandas as pd

  cost = CostModel(name="c", target=COST.target, drafts={},
                   overhead=OverheadCost(ar_step_s=0.5 * MS, sd_step_s=1 * MS),
                   prefill_emits_token=False)
  loop = pd.DataFrame([dict(batch=2, context=10, L=1, step_ms=30.0, tau=2.0),
                       dict(batch=2, context=10, L=0, step_ms=12.5, tau=1.0)])
  out = simulator.compare_engine_loop(loop, cost, new_tokens=4)
  assert out.sim_step_ms.tolist() == pytest.approx([15.0, 12.5])
  assert out.sim_tau.tolist() == [2.0, 1.0]
  assert out.step_ratio.tolist() == pytest.approx([2.0, 1.0])


def test_engine_padding_stops_at_k():
  # One row, k = 3: the engine verifies a draft of 3 at width 3 (its length buckets stop at
  # k), so its padded query tokens equal the ragged ones (l + 1) at every step; padding to
  # bucket(3) = 4 would charge one token more in the step where A's acceptance of 4 lets
  # the row verify 3 drafts.
  engine = CostModel(name="e", target=COST.target, drafts=COST.drafts,
                     overhead=OverheadCost(), query_padding="engine")
  policy = Policy(kind="fixed", methods=("a",), k=3)
  assert sim([A], policy, cost=engine)["sd_time_s"] == pytest.approx(
      sim([A], policy)["sd_time_s"])
