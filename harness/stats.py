"""Spread over repeats: mean, standard deviation and a 95 % Student t interval.

Each repeat of an evaluation is one independent sample of a (method, batch size) cell
(its own sampling seed and a fresh engine), so a per-cell statistic over ``n`` repeats
gets ``mean +- t_{0.975, n-1} * std / sqrt(n)`` (``scipy.stats.t.interval``); with one
repeat the std and interval are NaN (no spread can be claimed).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pandas as pd
from scipy import stats

__all__ = ["SPREAD_COLUMNS", "aggregate", "format_mean_std", "spread"]

# Result columns summarized with spread (those present in the results are used).
SPREAD_COLUMNS = (
    "tau", "acceptance_rate", "c", "S_pred", "measured_speedup", "e2e_speedup",
    "wall_speedup", "tokens_per_s", "decode_tokens_per_s", "requests_per_s", "goodput_rps",
    "ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "tpot_mean_s", "tpot_p50_s",
    "tpot_p90_s", "tpot_p99_s", "latency_mean_s", "latency_p50_s", "latency_p90_s",
    "latency_p99_s", "queue_mean_s", "queue_p50_s", "queue_p90_s", "queue_p99_s",
)


def spread(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float, float, float]:
  """``(mean, std, ci_low, ci_high)`` of the finite ``values`` (std with ddof=1).

  E.g. ``[1.0, 1.2, 1.1]`` -> mean 1.1, std 0.1, 95 % interval 1.1 +- 4.303 * 0.1 / sqrt(3)
  = (0.852, 1.348). NaNs are dropped; fewer than two values give NaN std and interval.
  """
  x = np.asarray([v for v in values if v is not None and np.isfinite(v)], float)
  if x.size == 0:
    return (math.nan,) * 4
  mean = float(x.mean())
  if x.size < 2:
    return mean, math.nan, math.nan, math.nan
  std = float(x.std(ddof=1))
  if std == 0:
    return mean, 0.0, mean, mean
  lo, hi = stats.t.interval(confidence, x.size - 1, loc=mean, scale=std / math.sqrt(x.size))
  return mean, std, float(lo), float(hi)


def aggregate(df: pd.DataFrame, by: Sequence[str] = ("method", "batch_size"),
              columns: Sequence[str] = SPREAD_COLUMNS) -> pd.DataFrame:
  """One row per group of ``by``: ``n_repeats`` and ``<col>_{mean,std,ci_lo,ci_hi}``
  for each of ``columns`` present in ``df`` (groups in first-seen order)."""
  cols = [c for c in columns if c in df]
  out = []
  for key, g in df.groupby(list(by), sort=False):
    row = dict(zip(by, key if isinstance(key, tuple) else (key,)))
    row["n_repeats"] = len(g)
    for c in cols:
      vals = pd.to_numeric(g[c], errors="coerce").to_numpy(float)
      row[f"{c}_mean"], row[f"{c}_std"], row[f"{c}_ci_lo"], row[f"{c}_ci_hi"] = spread(vals)
    out.append(row)
  return pd.DataFrame(out)


def format_mean_std(mean: float, std: float, digits: int = 3) -> str:
  """``"1.234 ± 0.012"``; just the mean when the std is NaN; "" when the mean is."""
  if mean is None or not np.isfinite(mean):
    return ""
  if std is None or not np.isfinite(std):
    return f"{mean:.{digits}f}"
  return f"{mean:.{digits}f} ± {std:.{digits}f}"
