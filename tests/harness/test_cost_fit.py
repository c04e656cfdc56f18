"""Cost-model fit (``harness.cost_fit``): timings made from known coefficients are fitted
back exactly."""

import json

import numpy as np
import pandas as pd
import pytest

from harness import cost_fit
from specjax import cost_model


def _loop_frame():
  # target = 4 ms + 0.01 ms per query token + 1e-4 ms per KV token, the query tokens being
  # the engine's padded block bucket(B) x (bucket(L) + 1) (L = 3 verifies 5 tokens a row,
  # batch 3 runs as 4 rows); host (step - device):
  # AR 0.1 ms + 0.002 ms per row, SD 2 ms + 0.03 ms per row + 0.008 ms per row x L.
  rows = []
  padded = {0: 0, 1: 1, 3: 4, 8: 8, 16: 16, 64: 64}  # next power of two
  for batch in (1, 3, 16, 64):
    for context in (512, 4096):
      for length in (0, 1, 3, 8):
        kv = batch * (context + 64 / 2)
        q = padded[batch] * (padded[length] + 1)
        device = 4.0 + 0.01 * q + 1e-4 * kv
        host = 0.1 + 0.002 * batch if length == 0 else 2.0 + 0.03 * batch + 0.008 * batch * length
        rows.append(dict(target="llama3-8b", dtype="bfloat16", batch=batch, context=context,
                         L=length, step_ms=device + host, device_ms=device, device="NVIDIA H200",
                         backend="gpu", jax_version="0.11.2", attention_implementation="reference"))
  return pd.DataFrame(rows)


def _eval_frame():
  # ngram: 0.05 ms + 0.01 ms per row (k fixed); draft_model: one point, 5 drafts, 20 ms.
  rows = [dict(method="ar", batch_size=1, k=0, draft_ms=0.01, model="m", device="d")]
  rows += [dict(method="ngram", batch_size=b, k=4, draft_ms=0.05 + 0.01 * b, model="m",
                device="d") for b in (1, 4, 16)]
  rows.append(dict(method="draft_model", batch_size=1, k=5, draft_ms=20.0, model="m",
                   draft="d0", device="d"))
  return pd.DataFrame(rows)


def test_fit_recovers_coefficients(tmp_path):
  model = cost_fit.fit([_loop_frame()], [_eval_frame()], new_tokens=64, name="t")
  assert model.target.fixed_s == pytest.approx(4e-3, rel=1e-6)
  assert model.target.per_query_token_s == pytest.approx(1e-5, rel=1e-6)
  assert model.target.per_kv_token_s == pytest.approx(1e-7, rel=1e-6)
  o = model.overhead
  assert (o.ar_step_s, o.ar_per_row_s) == pytest.approx((1e-4, 2e-6), rel=1e-6)
  assert (o.sd_step_s, o.sd_per_row_s, o.sd_per_row_token_s) == pytest.approx(
      (2e-3, 3e-5, 8e-6), rel=1e-6)
  assert model.draft("ngram").time(8, 4, 0, 0) == pytest.approx((0.05 + 0.08) * 1e-3)
  # One point: time proportional to the draft length (4 ms per draft position).
  assert model.draft("draft_model").per_step_s == pytest.approx(4e-3)
  assert "ar" not in model.drafts
  assert model.query_padding == "engine" and not model.prefill_emits_token
  assert model.meta["device"] == "NVIDIA H200" and model.meta["jax_version"] == "0.11.2"
  assert model.meta["fit"]["target"]["max_abs_rel_error"] < 1e-9
  path = tmp_path / "m.json"
  path.write_text(model.to_json())
  assert cost_model.load(str(path)) == model
  assert json.loads(path.read_text())["meta"]["target"] == "llama3-8b"


def test_fit_errors():
  frame = _loop_frame()
  with pytest.raises(ValueError, match="finite device_ms"):
    cost_fit.fit([frame.assign(device_ms=np.nan)])
  with pytest.raises(ValueError, match="one target and dtype"):
    cost_fit.fit([frame, frame.assign(target="other")])
  with pytest.raises(ValueError, match="must be a preset"):
    cost_model.load("no-such-model")


def test_fit_finds_the_query_knee():
  # A roofline-shaped target: flat up to 128 query tokens (the weight read hides them),
  # then 0.02 ms per token; the linear fit cannot follow it, the knee scan finds 128.
  frame = _loop_frame()
  q = np.asarray([cost_model.bucket(b) * (cost_model.bucket(n) + 1)
                  for b, n in zip(frame.batch, frame.L)], float)
  kv = frame.batch * (frame.context + 64 / 2)
  device = 4.0 + 0.02 * np.maximum(q - 128, 0) + 1e-4 * kv
  frame = frame.assign(device_ms=device, step_ms=device + (frame.step_ms - frame.device_ms))
  model = cost_fit.fit([frame], new_tokens=64)
  assert model.target.query_knee == 128
  assert model.target.per_query_token_s == pytest.approx(2e-5, rel=1e-6)
  assert model.meta["fit"]["target"]["max_abs_rel_error"] < 1e-9
  assert model.target.time(0, 100) == pytest.approx(4e-3)  # below the knee: flat
  assert model.target.time(0, 228) == pytest.approx(4e-3 + 100 * 2e-5)
  # Linear data keep knee 0 (the first test), and a negative knee is refused.
  assert cost_fit.fit([_loop_frame()]).target.query_knee == 0
  with pytest.raises(ValueError, match="query_knee=-1"):
    cost_model.TargetCost(fixed_s=0, per_query_token_s=0, per_kv_token_s=0, query_knee=-1)


def test_fit_segments_follow_a_piecewise_query_cost():
  # The H100's 8B forward: the cost per query token is not one number (dear between 4 and
  # 36 tokens, cheap after). Timings made from a piecewise-linear query term with breaks
  # at the segment starts the fit uses are fitted back exactly; the knee form cannot.
  frame = _loop_frame()
  q = np.asarray([cost_model.bucket(b) * (cost_model.bucket(n) + 1)
                  for b, n in zip(frame.batch, frame.L)], float)
  starts = cost_fit.query_segment_starts(q)
  assert starts == [0.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0]
  assert max(q) == 576 and sum(np.unique(q) > 256) == 2  # 512 has one count above: no start
  # A sparse grid gets only the segments its counts pin down: [0, 64] holds 1 and 36, and
  # 144 and 576 lie above 64; 256 would leave one count for the open last segment.
  assert cost_fit.query_segment_starts([1, 36, 144, 576]) == [0.0, 64.0]
  assert cost_fit.query_segment_starts([1, 2, 5, 9, 16, 32]) == [0.0, 2.0, 8.0]
  slopes = {0.0: 0.0, 2.0: 0.03, 4.0: 0.03, 8.0: 0.03, 16.0: 0.01, 32.0: 0.01, 64.0: 0.01,
            128.0: 0.02, 256.0: 0.02}
  truth = cost_model.TargetCost(fixed_s=4e-3, per_query_token_s=0.0, per_kv_token_s=1e-7,
                                query_segments=tuple((a, s * 1e-3) for a, s in slopes.items()))
  kv = frame.batch * (frame.context + 64 / 2)
  device = 1e3 * truth.time(kv.to_numpy(), q)
  frame = frame.assign(device_ms=device, step_ms=device + (frame.step_ms - frame.device_ms))
  model = cost_fit.fit([frame], new_tokens=64, query_model="segments")
  assert [a for a, _ in model.target.query_segments] == starts
  np.testing.assert_allclose([s for _, s in model.target.query_segments],
                             [s for _, s in truth.query_segments], atol=1e-10)
  assert model.meta["fit"]["target"]["max_abs_rel_error"] < 1e-6
  assert cost_fit.fit([frame], new_tokens=64).meta["fit"]["target"]["max_abs_rel_error"] > 0.01
  path_model = cost_model.CostModel.from_json(model.to_json())
  assert path_model == model and path_model.target.time(0, 36) == model.target.time(0, 36)
  with pytest.raises(ValueError, match="query_model='spline' must be one of"):
    cost_fit.fit([frame], query_model="spline")


def test_query_segments_time_and_errors():
  t = cost_model.TargetCost(fixed_s=1.0, per_query_token_s=0.0, per_kv_token_s=0.5,
                            query_segments=[[0, 1.0], [4, 0.25]])
  assert t.query_segments == ((0.0, 1.0), (4.0, 0.25))
  assert t.time(2, 3) == 1.0 + 3 + 1.0  # inside the first segment
  assert t.time(0, 12) == 1.0 + 4 + 8 * 0.25  # past the last start: its slope, open-ended
  np.testing.assert_allclose(t.time(0, np.array([3, 12])), [4.0, 7.0])
  np.testing.assert_allclose(t.time(0, [3, 12]), [4.0, 7.0])  # a list as an array
  for bad in ([[1, 1.0], [1, 1.0]], [[-1, 1.0]], [[0, -1.0]], [[0, float("nan")]]):
    with pytest.raises(ValueError, match="starts increasing from >= 0 and slopes >= 0"):
      cost_model.TargetCost(fixed_s=0, per_query_token_s=0, per_kv_token_s=0,
                            query_segments=bad)
  with pytest.raises(ValueError, match="not both"):
    cost_model.TargetCost(fixed_s=0, per_query_token_s=1e-5, per_kv_token_s=0,
                          query_segments=[[0, 1.0]])
