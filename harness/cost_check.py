"""Checks a fitted step cost model against engine-loop points it was not fitted on.

``heldout_check`` fits ``harness.cost_fit.fit`` on some ``benchmarks.engine_loop`` rows
and predicts the step time of others (other batch sizes, contexts, or layer counts),
one row per held-out point with its relative error. Only draft-free rows are predicted
(AR and the zero-cost ``constant`` drafter): their step is the target forward plus the
host overhead, ``CostModel.step_time`` with no draft work, the KV read being
``batch * harness.cost_fit.mean_kv_per_row`` as in the fit.

Layer counts: a target measured with fewer layers than it has (the 70B shape on one
GPU) is fitted once per layer count; every coefficient of the target forward is then a
straight line in the layer count through those fits (least squares over two or more
counts), and the overhead is the fit of the largest count (``scale_layers``). A
held-out row is predicted by the model at its own ``num_layers``.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd

from harness.cost_fit import fit, mean_kv_per_row
from specjax.cost_model import CostModel, TargetCost

__all__ = ["DRAFT_FREE", "heldout_check", "predict_steps", "scale_layers", "split_heldout"]

DRAFT_FREE = ("constant",)  # engine-loop drafters whose step has no draft work


def _draft_free(frame: pd.DataFrame) -> pd.DataFrame:
  keep = (frame.L == 0) | frame.drafter.isin(DRAFT_FREE) if "drafter" in frame else frame.L >= 0
  return frame[keep]


def predict_steps(model: CostModel, frame: pd.DataFrame, *, new_tokens: int) -> pd.DataFrame:
  """``frame``'s draft-free rows with ``pred_step_ms`` (target forward + overhead),
  ``pred_device_ms`` (the forward alone) and ``rel_error`` = predicted / measured
  ``step_ms`` - 1."""
  out = _draft_free(frame).copy()
  steps, devices = [], []
  for (_, r), per_row in zip(out.iterrows(), mean_kv_per_row(out, new_tokens)):
    b, length = int(r.batch), int(r.L)
    q = model.query_tokens(np.full(b, length), k=length)
    kv = b * per_row
    steps.append(1e3 * model.step_time(b, q, kv, length=length))
    devices.append(1e3 * model.target.time(kv, q, b))
  out["pred_step_ms"] = steps
  out["pred_device_ms"] = devices
  out["rel_error"] = out.pred_step_ms / out.step_ms - 1.0
  return out


def scale_layers(models: dict[int, CostModel], num_layers: int) -> CostModel:
  """The model of ``num_layers`` layers from fits at other layer counts (module
  docstring). One count: that model, only for the same ``num_layers``.

  Raises:
    ValueError: no models, one model and another ``num_layers``, or fits whose
      ``query_segments`` have different starts.
  """
  if not models:
    raise ValueError("models is empty: fit at least one layer count")
  counts = sorted(models)
  if len(counts) == 1:
    if counts[0] != num_layers:
      raise ValueError(f"num_layers={num_layers} needs fits at two or more layer counts; "
                       f"got only {counts[0]}")
    return models[counts[0]]
  x = np.asarray(counts, float)
  design = np.stack([np.ones_like(x), x], 1)
  def line(y):
    (a, b), *_ = np.linalg.lstsq(design, np.asarray(y, float), rcond=None)
    return max(0.0, float(a + b * num_layers))

  values = {f.name: line([getattr(models[n].target, f.name) for n in counts])
            for f in dataclasses.fields(TargetCost) if f.name != "query_segments"}
  segments = [models[n].target.query_segments for n in counts]
  if any(s != () for s in segments):
    starts = {tuple(a for a, _ in s) for s in segments}
    if len(starts) != 1:
      raise ValueError(f"query_segments starts {sorted(starts)} differ between the layer "
                       "counts' fits: segments scale only with the same starts")
    values["query_segments"] = tuple(
        (a, line([s[j][1] for s in segments])) for j, (a, _) in enumerate(segments[0]))
  largest = models[counts[-1]]
  return dataclasses.replace(largest, name=f"{largest.name}@{num_layers}layers",
                             target=TargetCost(**values))


def split_heldout(frame: pd.DataFrame, *, batches=(), contexts=(), layers=()):
  """``(fit rows, held-out rows)``: a row is held out when its batch, context or
  num_layers is one of those given."""
  held = (frame.batch.isin(batches) | frame.context.isin(contexts)
          | frame.num_layers.isin(layers))
  return frame[~held], frame[held]


def heldout_check(fit_frame: pd.DataFrame, heldout_frame: pd.DataFrame, *, new_tokens: int,
                  tolerance: float = 0.05, query_model: str = "knee") -> pd.DataFrame:
  """Fits on ``fit_frame`` (per layer count; ``query_model`` as ``harness.cost_fit.fit``)
  and predicts ``heldout_frame``'s draft-free rows (``predict_steps`` columns, plus
  ``within`` = |rel_error| <= ``tolerance``).

  Raises:
    ValueError: an empty side, or ``harness.cost_fit.fit``'s errors.
  """
  if fit_frame.empty or _draft_free(heldout_frame).empty:
    raise ValueError(f"fit rows ({len(fit_frame)}) and draft-free held-out rows "
                     f"({len(_draft_free(heldout_frame))}) must both be non-empty")
  models = {int(n): fit([g], new_tokens=new_tokens, name=f"fit{int(n)}",
                       query_model=query_model)
            for n, g in fit_frame.groupby("num_layers")}
  parts = []
  for n, g in heldout_frame.groupby("num_layers"):
    parts.append(predict_steps(scale_layers(models, int(n)), g, new_tokens=new_tokens))
  out = pd.concat(parts, ignore_index=True)
  out["within"] = out.rel_error.abs() <= tolerance
  return out
