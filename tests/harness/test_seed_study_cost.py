"""The seed study's cost model (``harness.seed_study.draft_cost_points`` and
``fit_cost_model``): study rows made from a known EAGLE-3 draft cost give that cost
back."""

import numpy as np
import pandas as pd
import pytest

from harness import seed_study


def _loop_frame():
  # target = 5 ms + 0.01 ms per padded query token + 1e-5 ms per KV token; no host time.
  padded = {0: 0, 1: 1, 4: 4, 16: 16}
  rows = []
  for batch in (1, 4, 16):
    for context in (512, 2048):
      for length in (0, 1, 4):
        device = 5.0 + 0.01 * padded[batch] * (padded[length] + 1) + 1e-5 * batch * (
            context + 32)
        rows.append(dict(target="llama3-8b", dtype="bfloat16", batch=batch, context=context,
                         L=length, step_ms=device, device_ms=device, device="NVIDIA H100"))
  return pd.DataFrame(rows)


def _draft_ms(batch, k):  # the EAGLE-3 head: 0.2 ms + 0.5 ms per draft + 0.01 per row-draft
  return 0.2 + 0.5 * k + 0.01 * batch * k


def _study_rows():
  rows = []
  for data in ("instructcoder", "gsm8k"):
    for batch in (1, 4, 16):
      for k in (1, 3, 5):
        zero = 6.0 + 0.05 * batch * k  # the zero-cost drafter's step at this k
        step = zero + _draft_ms(batch, k)
        common = dict(data=data, target="llama3-8b", batch=batch, L=k, repeat=0,
                      device="NVIDIA H100")
        rows.append(dict(common, point=f"ngram_k{k}", step_ms=zero, verify_share=1.0))
        rows.append(dict(common, point=f"eagle3_k{k}", step_ms=step, verify_share=zero / step))
    rows.append(dict(data=data, target="llama3-8b", batch=1, L=5, repeat=0,
                     device="NVIDIA H100", point="adaptive_k5", step_ms=9.0,
                     verify_share=np.nan))
  return pd.DataFrame(rows)


def test_draft_cost_points_are_the_eagle3_step_less_the_zero_cost_step():
  points = seed_study.draft_cost_points(_study_rows())
  assert len(points) == 18 and set(points.method) == {seed_study.EAGLE}
  want = [_draft_ms(b, k) for b, k in zip(points.batch_size, points.k)]
  np.testing.assert_allclose(points.draft_ms, want, rtol=1e-12)


def test_draft_cost_points_combine_runs_through_the_mean_zero_cost_step():
  # Two runs: the zero-cost points in one (two repeats), the EAGLE-3 points in another,
  # measured without a verify_share of their own.
  rows = _study_rows()
  rows["drafter"] = np.where(rows.point.str.startswith("ngram"), "constant", "eagle3")
  zero = rows[rows.drafter == "constant"]
  again = zero.assign(repeat=1, step_ms=zero.step_ms + 0.2)
  zero = zero.assign(step_ms=zero.step_ms - 0.2)
  eagle = rows[rows.point.str.startswith("eagle3")].assign(verify_share=np.nan)
  points = seed_study.draft_cost_points(pd.concat([zero, again, eagle], ignore_index=True))
  assert len(points) == 18
  want = [_draft_ms(b, k) for b, k in zip(points.batch_size, points.k)]
  np.testing.assert_allclose(points.draft_ms, want, rtol=1e-12)


def test_fit_cost_model_recovers_the_draft_cost_and_charges_ngram_nothing():
  model = seed_study.fit_cost_model([_loop_frame()], _study_rows(), new_tokens=64, name="t")
  eagle = model.draft(seed_study.EAGLE)
  assert (eagle.fixed_s, eagle.per_step_s, eagle.per_row_token_s) == pytest.approx(
      (2e-4, 5e-4, 1e-5), rel=1e-6, abs=1e-12)
  assert eagle.per_row_s == pytest.approx(0.0, abs=1e-12)
  assert model.draft(seed_study.NGRAM).time(16, 5, 0, 0.0) == 0.0
  assert model.target.fixed_s == pytest.approx(5e-3, rel=1e-6)
  assert "constant drafter" in model.meta["draft_sources"][seed_study.NGRAM]


def test_fit_cost_model_needs_eagle3_points():
  rows = _study_rows()
  with pytest.raises(ValueError, match="no eagle3_k point"):
    seed_study.fit_cost_model([_loop_frame()], rows[~rows.point.str.startswith("eagle3")],
                              new_tokens=64, name="t")
