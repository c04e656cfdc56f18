"""``harness.cost_check``: a model fitted on some engine-loop points predicts the others.

Points made from a known linear model (target forward linear in the layer count, host
overhead per step) are predicted exactly at held-out batch sizes, contexts and layer
counts; a perturbed held-out point is reported outside the tolerance; bad inputs are
one-line errors."""

import numpy as np
import pandas as pd
import pytest

from harness import cost_check, cost_fit
from specjax.cost_model import bucket

NEW_TOKENS = 64


def _frame(layers=(32,), batches=(1, 4, 16, 64), contexts=(512, 2048), lengths=(0, 1, 4)):
  rows = []
  for n in layers:
    fixed, per_q, per_kv = 0.2e-3 + 0.12e-3 * n, 1e-7 * n, 3e-10 * n
    for b in batches:
      for ctx in contexts:
        for length in lengths:
          q = bucket(b) * (bucket(length) + 1)
          kv = b * (ctx + NEW_TOKENS / 2)
          device = fixed + per_q * q + per_kv * kv
          host = 0.1e-3 if length == 0 else 0.15e-3 + 2e-6 * b
          rows.append(dict(target="t", dtype="bfloat16", num_layers=n, batch=b, context=ctx,
                           L=length, drafter="constant", device_ms=1e3 * device,
                           step_ms=1e3 * (device + host), device="d", jax_version="x",
                           backend="gpu", attention_implementation="a"))
  return pd.DataFrame(rows)


def test_heldout_batches_and_contexts_are_predicted():
  frame = _frame()
  fit_rows, held = cost_check.split_heldout(frame, batches=(64,), contexts=(2048,))
  assert len(held) and len(fit_rows) and not set(fit_rows.batch) & {64}
  out = cost_check.heldout_check(fit_rows, held, new_tokens=NEW_TOKENS)
  assert len(out) == len(held)
  np.testing.assert_allclose(out.pred_step_ms, out.step_ms, rtol=1e-6)
  assert out.within.all()


def test_layer_counts_scale_linearly():
  frame = _frame(layers=(4, 8, 12))
  fit_rows, held = cost_check.split_heldout(frame, layers=(12,))
  out = cost_check.heldout_check(fit_rows, held, new_tokens=NEW_TOKENS)
  np.testing.assert_allclose(out.pred_device_ms, out.device_ms, rtol=1e-6)
  np.testing.assert_allclose(out.pred_step_ms, out.step_ms, rtol=1e-6)


def test_a_point_off_the_model_is_reported():
  frame = _frame()
  fit_rows, held = cost_check.split_heldout(frame, batches=(64,))
  held = held.copy()
  held.loc[held.index[0], "step_ms"] *= 1.10
  out = cost_check.heldout_check(fit_rows, held, new_tokens=NEW_TOKENS)
  assert (~out.within).sum() == 1
  assert out.rel_error.abs().max() == pytest.approx(1 - 1 / 1.10, rel=1e-4)


def test_bad_inputs():
  frame = _frame(layers=(8,))
  with pytest.raises(ValueError, match="needs fits at two or more layer counts"):
    cost_check.heldout_check(frame, _frame(layers=(16,)), new_tokens=NEW_TOKENS)
  with pytest.raises(ValueError, match="must both be non-empty"):
    cost_check.heldout_check(frame, frame.iloc[:0], new_tokens=NEW_TOKENS)


def test_segments_scale_with_the_layer_count():
  frame = _frame(layers=(4, 8, 12), batches=(1, 4, 16, 64, 128))
  fit_rows, held = cost_check.split_heldout(frame, layers=(12,))
  out = cost_check.heldout_check(fit_rows, held, new_tokens=NEW_TOKENS, query_model="segments")
  np.testing.assert_allclose(out.pred_device_ms, out.device_ms, rtol=1e-6)
  models = {n: cost_fit.fit([g], new_tokens=NEW_TOKENS, query_model="segments")
            for n, g in fit_rows.groupby("num_layers")}
  other = cost_fit.fit([fit_rows[(fit_rows.num_layers == 8) & (fit_rows.batch < 64)]],
                       new_tokens=NEW_TOKENS, query_model="segments")
  with pytest.raises(ValueError, match="segments scale only with the same starts"):
    cost_check.scale_layers({4: models[4], 8: other}, 12)
