"""The seed paper's simulator semantics (``harness.seed_simulator``) on hand-computable
traces, and its published numbers from its own files when ``../shared/seed_traces`` is
there."""

import json
import os

import numpy as np
import pytest

from harness import seed_simulator, simulator
from harness.simulator import Policy
from harness.traces import MethodTrace, TraceRecord, read_jsonl
from specjax import cost_model
from specjax.cost_model import CostModel, DraftCost, OverheadCost, TargetCost

MS = 1e-3
# target 10 ms + 1 ms per query token; EAGLE drafting 2 ms (+ 1 ms per KV token in
# KV_COST); n-gram drafting half the verify time; 1 ms overhead per step.
COST = CostModel(name="test", target=TargetCost(fixed_s=10 * MS, per_query_token_s=1 * MS,
                                                per_kv_token_s=0.0),
                 drafts={"eagle": DraftCost(fixed_s=2 * MS), "ngram": DraftCost(verify_fraction=0.5)},
                 overhead=OverheadCost(ar_step_s=1 * MS, sd_step_s=1 * MS))
KV_COST = CostModel(name="kv", target=COST.target, overhead=COST.overhead,
                    drafts={"eagle": DraftCost(fixed_s=2 * MS, per_kv_token_s=1 * MS)})
# Prompt 2; EAGLE's list has 4 entries (its output length), n-gram's 5.
REC = TraceRecord("a", [0, 0], [0] * 5, {"eagle": MethodTrace(np.asarray([1, 3, 2, 1]), {}),
                                          "ngram": MethodTrace(np.asarray([1, 2, 1, 1, 1]), {})})


def sim(policy, batch=1, cost=COST, **kw):
  return seed_simulator.simulate_seed([REC], cost, policy, batch, **kw)


def test_fixed_k_reads_acc_len_at_g_minus_1_and_overshoots():
  # AR (n = 4): prefill 10 + 2 + 1 = 13, three steps of 10 + 1 + 1 = 12 -> 49 ms.
  # SD fixed k = 2: prefill 13; g = 1 reads acc[0] = 1: verify 3 (13 ms), draft 2, +1 ->
  # 16, g = 2; g = 2 reads acc[1] = 3: 16 ms, commits 3 -> g = 5 (past n = 4). 45 ms.
  r = sim(Policy(kind="fixed", methods=("eagle",), k=2))
  assert r["speedup"] == pytest.approx(49 / 45)
  assert r["tau"] == 2.0 and r["sd_steps"] == 2


def test_combination_charged_ngram_cost_on_every_step():
  # n = min(4, 5) = 4, a = max([1, 3, 2, 1], [1, 2, 1, 1]) = [1, 3, 2, 1].
  # g = 1: v = 1, verify 11, n-gram draft 5.5 (charged: the combination is no n-gram
  # row), +1 -> 17.5; g = 2: v = 3, verify 13, draft 6.5, +1 -> 20.5, g = 5. SD 51 ms.
  r = sim(Policy(kind="combine", methods=("ngram", "eagle")))
  assert r["speedup"] == pytest.approx(49 / 51)
  with pytest.raises(ValueError, match="must include 'ngram'"):
    sim(Policy(kind="combine", methods=("eagle",)))


def test_ngram_oracle_and_match_draws():
  # n-gram alone: n = 5; AR 13 + 4 * 12 = 61 ms. Oracle: g = 1 v = 1 (verify 11, free
  # draft) 12; g = 2 v = 2: 12 + 6 + 1 = 19 -> g = 4; g = 4 v = 1: 12 -> g = 5. SD 56.
  assert sim(Policy(kind="oracle", methods=("ngram",)))["speedup"] == pytest.approx(61 / 56)
  # Fixed k = 1 never matching where acc_len is 1: the oracle's steps (56 ms); always
  # matching: three steps of 19 (g 1 -> 2 -> 4 -> 5): 70 ms.
  k1 = Policy(kind="fixed", methods=("ngram",), k=1)
  assert sim(k1, match_probability=0.0)["speedup"] == pytest.approx(61 / 56)
  assert sim(k1, match_probability=1.0)["speedup"] == pytest.approx(61 / 70)
  with pytest.raises(ValueError, match="needs match_probability"):
    sim(k1)
  with pytest.raises(ValueError, match="match_probability=2"):
    sim(k1, match_probability=2.0)


def test_copies_draft_with_the_kv_they_see():
  # B = 2, EAGLE drafting 2 ms + 1 ms per KV token. KV after prefill 2 * (2 + 1) = 6;
  # prefill 10 + 4 + 1 = 15. g = 1: verify 10 + 6 = 16; commits 1 each: copy 0 drafts at
  # KV 6 (8 ms), copy 1 at 7 (9 ms): mean 16 + 8.5 + 1 = 25.5; KV 8. g = 2: commits 3,
  # both finish (release 5 + 2 each): copy 0 at KV 8 (10 ms), copy 1 at 8 + 3 - 7 = 4
  # (6 ms): 16 + 8 + 1 = 25. SD 65.5 ms; AR 15 + 3 * (10 + 2 + 1) = 54 ms.
  fixed = Policy(kind="fixed", methods=("eagle",), k=2)
  assert sim(fixed, 2, KV_COST)["speedup"] == pytest.approx(54 / 65.5)
  # The per-copy path (n-gram's draws) and the identical-copies path agree.
  acc = np.asarray([1, 3, 2, 1])
  draft = KV_COST.draft("eagle")
  per_copy = seed_simulator._sd_run(KV_COST, fixed, acc, 2, 4, 2, draft, False, None, None)
  identical = seed_simulator._sd_run_identical(KV_COST, fixed, acc, 2, 4, 2, draft, False)
  assert per_copy[0] == pytest.approx(identical[0]) == pytest.approx(65.5 * MS)
  assert per_copy[1:] == identical[1:]


def test_bounds_config_checks_and_specjax_uses_each_methods_length(tmp_path):
  with pytest.raises(ValueError, match="batching='copies'"):
    simulator.BoundsConfig(traces=("x",), semantics="seed")
  with pytest.raises(ValueError, match="semantics='nope'"):
    simulator.BoundsConfig(traces=("x",), semantics="nope")
  # Specjax semantics on the same record: each method's list is its output length (EAGLE
  # 4 tokens: AR steps at positions 1-3; the oracle commits acc[1] = 3 at position 1 and
  # is done; n-gram 5 tokens: 4 AR steps), the combination takes the shorter (4).
  def run(policy):
    return simulator.simulate([REC], COST, policy, 1, include_prefill=False)

  eagle = run(Policy(kind="oracle", methods=("eagle",)))
  assert (eagle["ar_steps"], eagle["sd_steps"], eagle["tau"]) == (3, 1, 3.0)
  assert run(Policy(kind="oracle", methods=("ngram",)))["ar_steps"] == 4
  assert run(Policy(kind="combine", methods=("ngram", "eagle")))["ar_steps"] == 3


SEED_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "seed_traces")


@pytest.mark.skipif(not os.path.isdir(SEED_DIR), reason="../shared/seed_traces is absent")
def test_seed_numbers_on_instructcoder():
  """The seed paper's InstructCoder batch-1 figures (combination about 4.9x)."""
  records = read_jsonl(os.path.join(SEED_DIR, "combined_instructcoder.jsonl"))
  cost = cost_model.preset("seed-llama8b-h100")
  got = {p.label: seed_simulator.simulate_seed(records, cost, p, 1)["speedup"]
         for p in (Policy(kind="combine", methods=("ngram", "eagle")),
                   Policy(kind="oracle", methods=("eagle",)),
                   Policy(kind="fixed", methods=("eagle",), k=5))}
  assert 4.80 <= got["combine:ngram+eagle"] <= 5.00
  assert round(got["oracle:eagle"], 2) == 2.73
  assert round(got["fixed_k5:eagle"], 2) == 2.38


def test_seed_errors_and_rows(tmp_path):
  lacking = TraceRecord("b", [0], [0, 0], {"ngram": MethodTrace(np.asarray([1, 1]), {})})
  with pytest.raises(ValueError, match=r"request 'b' has no trace for methods \['eagle'\]"):
    seed_simulator.simulate_seed([REC, lacking], COST, Policy(kind="oracle", methods=("eagle",)),
                                 1)
  with pytest.raises(ValueError, match="match_probability=2.0 is for semantics='seed' only"):
    simulator.BoundsConfig(traces=("x",), semantics="seed", batching="copies",
                           match_probability=2.0)
  with pytest.raises(ValueError, match="is for semantics='seed' only"):
    simulator.BoundsConfig(traces=("x",), match_probability=0.5)
  empty = tmp_path / "combined_none.jsonl"
  empty.write_text("")
  with pytest.raises(ValueError, match="has no records"):
    simulator.run_bounds(simulator.BoundsConfig(traces=(str(empty),)))
  # The seed rows keep the number of requests they drew (2 of the file's 3).
  path = tmp_path / "combined_gsm8k.jsonl"
  path.write_text("\n".join(json.dumps(r.to_json()) for r in [REC, REC, REC]) + "\n")
  df = simulator.run_bounds(simulator.BoundsConfig(
      traces=(str(path),), semantics="seed", batching="copies", num_requests=2,
      batch_sizes=(1,), fixed_k=(1,), cost_model="seed-llama8b-h100"))
  assert (df.num_requests == 2).all() and (df.match_probability == 0.2).all()
