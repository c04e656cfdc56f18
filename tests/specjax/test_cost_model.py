"""The one step-cost model (``specjax.cost_model``): hand-computed step times, the goodput
and verify-skip forms, presets and JSON, one-line errors."""

import numpy as np
import pytest

from specjax import cost_model as cm
from specjax.cost_model import (
    ANY_METHOD,
    CostModel,
    DraftCost,
    LinearVerifyCost,
    OverheadCost,
    StepCostModel,
    TableVerifyCost,
    TargetCost,
)

# target 10 + 1 per row + 0.5 per query token + 0.01 per KV token; "a" drafts for 2 + 1 per
# row + 3 per position; AR overhead 0.25 per row, SD 4 + 0.5 per row x L; switches 7.
MODEL = CostModel(
    name="hand", target=TargetCost(fixed_s=10.0, per_row_s=1.0, per_query_token_s=0.5,
                                   per_kv_token_s=0.01),
    drafts={"a": DraftCost(fixed_s=2.0, per_row_s=1.0, per_step_s=3.0)},
    overhead=OverheadCost(ar_per_row_s=0.25, sd_step_s=4.0, sd_per_row_token_s=0.5),
    switch_s=7.0)


def test_step_time_by_hand():
  # 4 rows verifying (2, 1, 0, 3) drafts: ragged q = 3 + 2 + 1 + 4 = 10; kv 200.
  q = MODEL.query_tokens([2, 1, 0, 3])
  assert q == 10
  # target 10 + 4 + 5 + 2 = 21; "a" over 3 rows, longest 3: 2 + 3 + 9 = 14;
  # SD overhead 4 + 0.5 * 4 * 3 = 10; one switch 7.
  parts = MODEL.step_parts(4, q, 200, {"a": (3, 3)}, switches=1)
  assert parts == (21.0, 14.0, 10.0, 7.0) and parts.total == 52.0
  assert MODEL.step_time(4, q, 200, {"a": (3, 3)}, switches=1) == 52.0
  # Plain decoding: no draft work, AR overhead 0.25 * 4.
  assert MODEL.step_time(4, 4, 200) == 10 + 4 + 2 + 2 + 1.0
  # A method drafting nothing costs nothing; speculative=True forces the SD overhead.
  assert MODEL.step_time(4, 4, 200, {"a": (4, 0)}, speculative=True) == 18 + 4.0
  # Engine padding: bucket(3 rows) = 4, bucket(3) + 1 = 5 -> 20 query tokens.
  engine = CostModel(name="e", target=MODEL.target, drafts={}, query_padding="engine")
  assert engine.query_tokens([1, 3, 0]) == 20
  # The engine's length buckets stop at k: k = 5 verifies 5 + 1 tokens a row, not 8 + 1;
  # k = 3 gives 3 + 1; a step of shorter drafts keeps its bucket (2 -> 2, under k = 5).
  assert engine.query_tokens([5, 5], k=5) == 2 * 6 and engine.query_tokens([5, 5]) == 2 * 9
  assert engine.query_tokens([3, 1, 0], k=3) == 4 * 4
  assert engine.query_tokens([2, 1], k=5) == 2 * 3
  with pytest.raises(ValueError, match="exceed the step's k=3"):
    engine.query_tokens([4, 1], k=3)
  for bad in ([-5, 2], [1.7], [[1, 2], [3, 4]]):  # nothing truncated or flattened
    with pytest.raises(ValueError, match="must be a 1-D sequence of integers >= 0"):
      engine.query_tokens(bad)
  for k in (2.5, -1, True):
    with pytest.raises(ValueError, match="must be an integer >= 0 or None"):
      engine.query_tokens([1], k=k)


def test_verify_time_is_linear_verify_cost():
  cost = LinearVerifyCost(fixed_s=1, per_row_s=0.5, per_token_s=0.25)
  assert cost(2, 3) == cost.verify_time(2, 3) == 1 + 1 + 2
  assert cost.verify_time(2, 0) == 1 + 1 + 0.5
  # MODEL's T(B, L): target at q = B (L + 1), kv 0, plus the SD overhead (AR at L = 0).
  assert MODEL.verify_time(2, 1) == 10 + 2 + 2 + 4 + 0.5 * 2 * 1
  assert MODEL.verify_time(2, 0) == 10 + 2 + 1 + 0.5
  default = LinearVerifyCost()
  assert default(16, 1) == pytest.approx(7.2e-3 + 16 * 6.8e-5 + 32 * 2e-5)


def test_step_cost_model_is_the_goodput_form():
  cost = StepCostModel(verify_base=1.0, verify_per_token=0.1, verify_per_kv=0.001,
                       draft_base=0.5, draft_per_row=0.25)
  # 1 + 0.1 * 12 + 0.001 * 300 + 3 * (0.5 + 0.25 * 4) = 2.5 + 4.5 = 7.0
  assert cost.step_time(4, 12, 300, {"draft_model": (4, 3)}) == pytest.approx(7.0)
  assert cost.step_time(4, 4, 300) == pytest.approx(2.5 - 0.8)
  assert cost.draft("any method") is cost.drafts[ANY_METHOD]
  with pytest.raises(ValueError, match=r"^verify_per_token=-1.0 must be a finite number >= 0"):
    StepCostModel(verify_base=1.0, verify_per_token=-1.0)
  with pytest.raises(ValueError, match=r"^verify_base=0 must be > 0"):
    StepCostModel(verify_base=0)
  with pytest.raises(ValueError, match=r"^per_token_s=nan must be"):
    LinearVerifyCost(per_token_s=float("nan"))


def test_table_verify_cost():
  table = TableVerifyCost(batches=(1, 64), lengths=(1, 4), seconds=((1.0, 2.0), (3.0, 10.0)))
  assert table(1, 1) == 1.0 and table(32, 2) == pytest.approx(2.0 + 8.0 * 31 / 63)
  with pytest.raises(ValueError, match="length=8"):
    table(1, 8)
  with pytest.raises(ValueError, match="must increase"):
    TableVerifyCost(batches=(2, 1), lengths=(1,), seconds=((1.0,), (2.0,)))


def test_presets_json_and_errors(tmp_path):
  seed = cm.preset("seed-llama8b-h100")
  assert cm.load("seed-llama8b-h100") is seed
  # The seed's EAGLE step at B = 1, l = 3, kv 1000 (its own formula, num_spec_tokens 4).
  verify = 5.88590713e-3 + 2.10103129e-5 * 4 + 3.92645679e-8 * 1000
  eagle = 2.37768493e-9 * 1000 + 8.41429603e-7 * 4 + 2.13526175e-3
  assert seed.step_time(1, 4, 1000, {"eagle": (1, 3)}) == pytest.approx(
      verify + eagle + 1.20683946e-3, rel=1e-12)
  # The seed's idle charge: EAGLE also pays on a step that drafts nothing.
  assert seed.draft("eagle").time(1, 0, 1000, 0.0) == 0.0
  assert seed.draft("eagle").time(1, 0, 1000, 0.0, charge_idle=True) == pytest.approx(
      2.37768493e-9 * 1000 + 2.13526175e-3 + 8.41429603e-7)
  path = tmp_path / "m.json"
  path.write_text(MODEL.to_json())
  assert cm.load(str(path)) == MODEL and hash(cm.load(str(path))) == hash(MODEL)
  with pytest.raises(ValueError, match=r"must be a preset \(\['seed-llama8b-h100'\]\) or a .json"):
    cm.load("nope")
  with pytest.raises(ValueError, match="is unknown; presets"):
    cm.preset("nope")
  bad = tmp_path / "bad.json"
  bad.write_text('{"name": "x", "drafts": {}}')
  with pytest.raises(ValueError, match="must hold name, target and drafts"):
    cm.load(str(bad))
  with pytest.raises(ValueError, match=r"has no draft cost for method='b'; it has \['a'\]"):
    MODEL.step_time(1, 1, 0, {"b": (1, 1)})
  with pytest.raises(ValueError, match="query_padding='x' must be"):
    CostModel(name="x", target=MODEL.target, drafts={}, query_padding="x")
  with pytest.raises(ValueError, match="must map method names to DraftCost"):
    CostModel(name="x", target=MODEL.target, drafts={"a": 1.0})


def test_arrays_where_the_seed_simulator_passes_them():
  d = DraftCost(fixed_s=1.0, per_step_s=2.0, per_kv_token_s=0.5)
  got = d.time(1, np.array([0, 1, 2]), np.array([2.0, 4.0, 6.0]), 0.0, charge_idle=True)
  np.testing.assert_array_equal(got, [2.0, 5.0, 8.0])
