"""Fits a ``specjax.cost_model.CostModel`` from this project's measurement files.

Least squares (``scipy.optimize.nnls``, coefficients >= 0, rows weighted by 1 / measured
time so every point counts by its relative error) on ``benchmarks.engine_loop`` CSVs
(target forward from the profiled ``device_ms``; overheads from ``step_ms - device_ms`` of
AR rows, L = 0, and SD rows) and ``harness.evaluation`` ``results.csv`` files (per-method
``draft_ms`` against ``batch_size`` and ``k``); the target's query tokens are the engine's
padded ``bucket(B) * (bucket(L) + 1)``, and the target's ``query_knee`` (the
roofline's bend: query tokens that ride along with the weight read) is the best of a
scan over the measured query-token counts (``_fit_knee``); or, with
``query_model="segments"``, the query term is piecewise linear with a start at 0 and at
every power of two inside the measured counts that has two distinct counts above it
(``query_segment_starts``, ``_fit_segments``; each segment's slope >= 0). The model's
JSON records the device, JAX version, dtype, target and files it came from, and per-part
fit errors. The model itself (its terms, presets, ``load``) lives in
``specjax.cost_model``.
"""

from __future__ import annotations

import platform

import numpy as np

from specjax.cost_model import (
  CostModel,
  DraftCost,
  OverheadCost,
  TargetCost,
  bucket,
  segment_widths,
)

__all__ = ["QUERY_MODELS", "fit", "mean_kv_per_row", "query_segment_starts"]

QUERY_MODELS = ("knee", "segments")


def mean_kv_per_row(frame, new_tokens: int) -> np.ndarray:
  """Mean KV positions a row reads over an engine-loop run: ``context + new_tokens * tau
  / 2`` (a request commits tau tokens per step for ``new_tokens`` steps; with synthetic
  acceptance 1.0, tau = L + 1), ``context + new_tokens / 2`` where the CSV has no tau."""
  tau = frame.tau.to_numpy(float) if "tau" in frame else np.ones(len(frame))
  return frame.context.to_numpy(float) + new_tokens * tau / 2


def _nnls(features: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, dict]:
  """Non-negative least squares weighted by 1/y; returns coefs and fit statistics."""
  from scipy.optimize import nnls  # noqa: PLC0415

  w = 1.0 / y
  coef, _ = nnls(features * w[:, None], y * w)
  rel = features @ coef / y - 1.0
  return coef, {"num_points": int(y.size), "rms_rel_error": float(np.sqrt(np.mean(rel**2))),
                "max_abs_rel_error": float(np.max(np.abs(rel)))}


def _fit_knee(q: np.ndarray, kv: np.ndarray, y: np.ndarray):
  """The target's ``query_knee`` and coefficients: the fit of ``[1, max(q - knee, 0), kv]``
  with the smallest rms relative error over knee = 0 and each measured q but the two
  largest (two distinct q above a knee identify its slope); ties go to the smaller knee."""
  ones = np.ones_like(q)
  distinct = np.unique(q)
  best = None
  for knee in [0.0, *distinct[:-2]]:
    coef, stats = _nnls(np.stack([ones, np.maximum(q - knee, 0.0), kv], 1), y)
    if best is None or stats["rms_rel_error"] < best[2]["rms_rel_error"] - 1e-12:
      best = (float(knee), coef, stats)
  knee, coef, stats = best
  stats["query_knee"] = knee
  return knee, coef, stats


def query_segment_starts(q) -> list[float]:
  """Segment starts for measured query-token counts ``q``: 0, then, in increasing order,
  each power of two p that closes a segment holding a measured count (two distinct counts
  for the first segment, [0, p], which also fixes the constant; one for each later one,
  (previous start, p]) and leaves two distinct counts above it for the open last segment.
  Every slope is then pinned by the data (a linear spline's Schoenberg-Whitney condition)
  and a sparse grid gets few segments, not an exact fit through its points."""
  distinct = np.unique(np.asarray(q, float))
  starts, p = [0.0], 1
  while p < distinct[-1]:
    inside = ((distinct > starts[-1]) & (distinct <= p)).sum() if starts[-1] else (
        distinct <= p).sum()
    if inside >= (1 if starts[-1] else 2) and (distinct > p).sum() >= 2:
      starts.append(float(p))
    p *= 2
  return starts


def _fit_segments(q: np.ndarray, kv: np.ndarray, y: np.ndarray):
  """The fit of ``[1, segments(q), kv]`` (``query_segment_starts``): (fixed, segments as
  ``(start, slope)`` pairs, per-KV-token) and fit statistics."""
  starts = query_segment_starts(q)
  features = np.concatenate([np.ones((len(q), 1)), segment_widths(q, starts), kv[:, None]],
                            1)
  coef, stats = _nnls(features, y)
  stats["query_segment_starts"] = starts
  return coef[0], tuple(zip(starts, coef[1:-1].tolist())), coef[-1], stats


def _single(frame, column: str):
  values = sorted({str(v) for v in frame[column].dropna()}) if column in frame else []
  return values[0] if len(values) == 1 else values


def fit(engine_loop_frames, eval_frames=(), *, new_tokens: int = 64, name: str = "fitted",
        switch_s: float = 0.0, query_model: str = "knee") -> CostModel:
  """Fits a ``CostModel`` (module docstring) from this project's timings.

  Args:
    engine_loop_frames: ``benchmarks.engine_loop`` CSVs as DataFrames (columns batch,
      context, L, step_ms, device_ms, ...); rows of one target shape and dtype.
    eval_frames: ``harness.evaluation`` results as DataFrames (method, batch_size, k,
      draft_ms); every method but ``ar`` gets a draft cost.
    new_tokens: engine steps of each engine-loop request (its ``--new_tokens``; the CSV
      does not record it): the mean KV per row is ``mean_kv_per_row``.
    query_model: the target's query term (``QUERY_MODELS``): ``"knee"`` (one slope past
      a fitted knee) or ``"segments"`` (piecewise linear; module docstring).

  Raises:
    ValueError: no engine-loop rows with a finite ``device_ms``, more than one target, or
      ``query_model`` not in ``QUERY_MODELS``.
  """
  if query_model not in QUERY_MODELS:
    raise ValueError(f"query_model={query_model!r} must be one of {QUERY_MODELS}")
  import pandas as pd  # noqa: PLC0415
  import scipy  # noqa: PLC0415

  loop = pd.concat(list(engine_loop_frames), ignore_index=True)
  loop = loop[np.isfinite(loop.device_ms) & np.isfinite(loop.step_ms)]
  if loop.empty:
    raise ValueError("engine_loop_frames must hold rows with finite device_ms (run "
                     "benchmarks.engine_loop with --profile)")
  if loop.target.nunique() != 1 or loop.dtype.nunique() != 1:
    raise ValueError(f"engine_loop_frames must be of one target and dtype, got "
                     f"{sorted(set(zip(loop.target, loop.dtype)))}")
  batch = loop.batch.to_numpy(float)
  length = loop.L.to_numpy(float)
  kv = batch * mean_kv_per_row(loop, new_tokens)
  # The engine verifies a padded [bucket(B), bucket(L) + 1] block (query_padding="engine").
  q = np.asarray([bucket(int(b)) * (bucket(int(v)) + 1) for b, v in zip(batch, length)],
                 float)
  device_s = loop.device_ms.to_numpy(float) / 1e3
  ones = np.ones_like(batch)
  if query_model == "segments":
    fixed, segments, per_kv, target_stats = _fit_segments(q, kv, device_s)
    target = TargetCost(fixed_s=fixed, per_query_token_s=0.0, per_kv_token_s=per_kv,
                        query_segments=segments)
  else:
    knee, coef, target_stats = _fit_knee(q, kv, device_s)
    target = TargetCost(fixed_s=coef[0], per_query_token_s=coef[1], per_kv_token_s=coef[2],
                        query_knee=knee)

  host_s = np.maximum(loop.step_ms.to_numpy(float) / 1e3 - device_s, 1e-6)
  ar, sd = length == 0, length > 0
  stats = {"target": target_stats}
  ar_coef = np.zeros(2)
  if ar.any():
    ar_coef, stats["ar_overhead"] = _nnls(np.stack([ones[ar], batch[ar]], 1), host_s[ar])
  sd_coef = np.zeros(3)
  if sd.any():
    sd_coef, stats["sd_overhead"] = _nnls(
        np.stack([ones[sd], batch[sd], batch[sd] * length[sd]], 1), host_s[sd])
  overhead = OverheadCost(ar_step_s=ar_coef[0], ar_per_row_s=ar_coef[1], sd_step_s=sd_coef[0],
                          sd_per_row_s=sd_coef[1], sd_per_row_token_s=sd_coef[2])

  drafts = {}
  evals = pd.concat(list(eval_frames), ignore_index=True) if len(eval_frames) else None
  draft_sources = {}
  if evals is not None:
    for method, g in evals[evals.method != "ar"].groupby("method"):
      g = g[np.isfinite(g.draft_ms) & (g.draft_ms > 0)]
      if g.empty:
        continue
      drafts[method], stats[f"draft_{method}"] = _fit_draft(g)
      draft_sources[method] = {"model": _single(g, "model"), "draft": _single(g, "draft"),
                               "device": _single(g, "device")}
  meta = {
      "device": _single(loop, "device"), "jax_version": _single(loop, "jax_version"),
      "backend": _single(loop, "backend"), "target": _single(loop, "target"),
      "dtype": _single(loop, "dtype"),
      "attention_implementation": _single(loop, "attention_implementation"),
      "engine": "specjax", "new_tokens": new_tokens, "fit": stats,
      "draft_sources": draft_sources, "numpy": np.__version__, "scipy": scipy.__version__,
      "python": platform.python_version(),
  }
  return CostModel(name=name, target=target, drafts=drafts, overhead=overhead,
                   switch_s=switch_s, query_padding="engine", prefill_emits_token=False,
                   meta=meta)


def _fit_draft(g) -> tuple[DraftCost, dict]:
  """Draft cost from (batch_size, k, draft_ms) points, with the terms the points identify:
  one point: time proportional to L; several batches, one k: fixed + per row; one batch,
  several k: fixed + per draft position; both: fixed + per row + per position (+ per
  row x position with >= 4 points)."""
  rows = g.batch_size.to_numpy(float)
  length = g.k.to_numpy(float)
  y = g.draft_ms.to_numpy(float) / 1e3
  ones = np.ones_like(rows)
  varied_rows, varied_len = len(set(rows)) > 1, len(set(length)) > 1
  if not varied_rows and not varied_len:
    names, cols = ["per_step_s"], [length]
  elif varied_rows and not varied_len:
    names, cols = ["fixed_s", "per_row_s"], [ones, rows]
  elif varied_len and not varied_rows:
    names, cols = ["fixed_s", "per_step_s"], [ones, length]
  else:
    names, cols = ["fixed_s", "per_row_s", "per_step_s"], [ones, rows, length]
    if y.size >= 4:
      names.append("per_row_token_s")
      cols.append(rows * length)
  coef, stats = _nnls(np.stack(cols, 1), y)
  stats["terms"] = names
  return DraftCost(**dict(zip(names, (float(c) for c in coef)))), stats
