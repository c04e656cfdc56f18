"""The evaluation's figures (matplotlib, Agg backend), written next to ``results.csv``.

``evaluation_figures(out_dir, df, categories, records)`` writes:

- ``speedup.png``: tau, and predicted (S_pred = tau / c) vs measured decode-phase and
  end-to-end speedup, per method and batch size, error bars = 95 % t interval over repeats.
- ``acceptance_by_position.png``: share of drafted position-j tokens accepted, per method.
- ``categories.png``: tau and S_pred per dataset category (grouped bars), per method.
- ``latency_cdf.png`` (online runs): CDFs of TTFT and TPOT per method, requests alive
  during a compile left out.

Every figure names its model, dataset, device and repeat count in its title. The step
benchmarks draw here too: ``step_benchmark_figure`` (``experiments.bench_step``: c(L)
and the AR roofline fraction) and ``engine_loop_figure`` (``benchmarks.engine_loop``).
"""

from __future__ import annotations

import os

import numpy as np
import pandas as pd

from harness.stats import aggregate

__all__ = ["engine_loop_figure", "evaluation_figures", "seed_study_figure",
           "step_benchmark_figure"]


def _pyplot():
  import matplotlib  # noqa: PLC0415

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  return plt


def _subtitle(df: pd.DataFrame) -> str:
  r = df.iloc[0]
  rate = (f", {r['request_rate']:g} req/s" if "request_rate" in df and pd.notna(r["request_rate"])
          else ", offline")
  return (f"{r['model']} on {r['device']}, {r['dataset']} x{r['num_prompts']}, "
          f"T={r['temperature']}{rate}, {df['repeat'].nunique()} repeat(s)")


def _half_width(agg: pd.DataFrame, col: str) -> np.ndarray:
  hw = (agg[f"{col}_ci_hi"] - agg[f"{col}_ci_lo"]).to_numpy(float) / 2
  return np.nan_to_num(hw)


def _speedup_figure(plt, df: pd.DataFrame, path: str) -> None:
  agg = aggregate(df)
  sd = agg[agg["method"] != "ar"]
  methods = list(dict.fromkeys(sd["method"]))
  batches = sorted(set(sd["batch_size"]))
  fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
  width = 0.8 / max(len(methods), 1)
  x = np.arange(len(batches))
  for i, m in enumerate(methods):
    g = sd[sd["method"] == m].set_index("batch_size").reindex(batches)
    axes[0].bar(x + i * width, g["tau_mean"], width, yerr=_half_width(g, "tau"), capsize=3,
                label=m)
  axes[0].set(xticks=x + width * (len(methods) - 1) / 2, xticklabels=[f"batch {b}" for b in batches],
              ylabel="tau (tokens committed per sequence per step)",
              title="Mean acceptance length tau (1 = plain decoding)")
  axes[0].axhline(1.0, color="grey", lw=0.8, ls=":")
  axes[0].legend(title="method")
  kinds = [("S_pred", "predicted S = tau / c", "o"),
           ("measured_speedup", "measured, decode phase", "s"),
           ("e2e_speedup", "measured, with prefill", "^")]
  labels = []
  pos = 0
  for m in methods:
    for b in batches:
      g = sd[(sd["method"] == m) & (sd["batch_size"] == b)]
      if g.empty:
        continue
      for j, (col, name, marker) in enumerate(kinds):
        if f"{col}_mean" not in g:
          continue
        axes[1].errorbar(pos + (j - 1) * 0.22, g[f"{col}_mean"].iloc[0],
                         yerr=_half_width(g, col)[0], fmt=marker, capsize=3, color=f"C{j}",
                         label=name if pos == 0 else None)
      labels.append(f"{m}\nbatch {b}")
      pos += 1
  axes[1].axhline(1.0, color="grey", lw=0.8, ls=":")
  axes[1].set(xticks=range(len(labels)), xticklabels=labels,
              ylabel="speedup over AR (same requests)",
              title="Predicted vs measured speedup (bars: 95% interval)")
  axes[1].legend(loc="best", fontsize=8)
  fig.suptitle(_subtitle(df), fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _acceptance_figure(plt, df: pd.DataFrame, path: str) -> bool:
  cols = sorted((c for c in df if c.startswith("accept_rate_pos")),
                key=lambda c: int(c.removeprefix("accept_rate_pos")))
  sd = df[df["method"] != "ar"]
  if not cols or sd.empty:
    return False
  fig, ax = plt.subplots(figsize=(6.5, 4.2))
  pos = np.arange(1, len(cols) + 1)
  drawn = 0
  for (m, b), g in sd.groupby(["method", "batch_size"], sort=False):
    vals = g[cols].to_numpy(float)
    if np.isnan(vals).all():
      continue
    drawn += 1
    mean = np.nanmean(vals, axis=0)
    std = np.nanstd(vals, axis=0, ddof=1) if len(vals) > 1 else np.zeros_like(mean)
    ax.errorbar(pos, mean, yerr=np.nan_to_num(std), marker="o", capsize=3,
                label=f"{m}, batch {b}")
  if not drawn:
    plt.close(fig)
    return False
  ax.set(xticks=pos, xlabel="draft position j",
         ylabel="accepted / drafted at position j", ylim=(0, 1.05),
         title="Per-position acceptance (mean ± std over repeats)")
  ax.legend(fontsize=8)
  fig.suptitle(_subtitle(df), fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return True


def _category_figure(plt, df: pd.DataFrame, categories: pd.DataFrame, path: str) -> bool:
  if categories is None or categories.empty:
    return False
  b = int(categories["batch_size"].min())
  cat = categories[(categories["batch_size"] == b) & (categories["method"] != "ar")]
  if cat.empty:
    return False
  names = list(dict.fromkeys(cat["category"]))
  methods = list(dict.fromkeys(cat["method"]))
  fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
  width = 0.8 / len(methods)
  x = np.arange(len(names))
  for i, m in enumerate(methods):
    g = cat[cat["method"] == m].set_index("category").reindex(names)
    axes[0].bar(x + i * width, g["tau"], width, label=m)
    axes[1].bar(x + i * width, g["S_pred"], width, label=m)
  for ax, ylabel, title in (
      (axes[0], "tau (tokens per sequence per step)", f"tau per category (batch {b})"),
      (axes[1], "S_pred = tau / c", f"Predicted speedup per category (batch {b})")):
    ax.set(xticks=x + width * (len(methods) - 1) / 2, ylabel=ylabel, title=title)
    ax.set_xticklabels(names, rotation=30, ha="right")
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.legend(title="method", fontsize=8)
  fig.suptitle(_subtitle(df) + "; pooled over repeats", fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return True


def _latency_figure(plt, df: pd.DataFrame, records: list[dict], path: str) -> bool:
  if "request_rate" not in df or df["request_rate"].isna().all() or not records:
    return False
  out = pd.DataFrame(records)
  if "compile_affected" in out:
    out = out[~out["compile_affected"].astype(bool)]
  if out.empty:
    return False
  fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
  for (m, b), g in out.groupby(["method", "batch_size"], sort=False):
    for ax, col in zip(axes, ("ttft_s", "tpot_s")):
      v = np.sort(g[col].to_numpy(float) * 1e3)
      ax.step(v, np.arange(1, len(v) + 1) / len(v), where="post", label=f"{m}, batch {b}")
  for ax, name in zip(axes, ("TTFT (time to first token)", "TPOT (time per output token)")):
    ax.set(xlabel=f"{name.split(' ')[0]} [ms]", ylabel="share of requests <= x",
           title=f"CDF of {name}", ylim=(0, 1.02))
    ax.legend(fontsize=8)
  fig.suptitle(_subtitle(df) + "; requests alive during a compile left out", fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return True


def evaluation_figures(out_dir: str, df: pd.DataFrame, categories: pd.DataFrame | None,
                       records: list[dict]) -> list[str]:
  """Writes the figures above into ``out_dir``; returns the paths written."""
  plt = _pyplot()
  written = []
  path = os.path.join(out_dir, "speedup.png")
  _speedup_figure(plt, df, path)
  written.append(path)
  for name, draw in (
      ("acceptance_by_position.png", lambda p: _acceptance_figure(plt, df, p)),
      ("categories.png", lambda p: _category_figure(plt, df, categories, p)),
      ("latency_cdf.png", lambda p: _latency_figure(plt, df, records, p))):
    path = os.path.join(out_dir, name)
    if draw(path):
      written.append(path)
  return written


def step_benchmark_figure(df: pd.DataFrame, path: str) -> None:
  """``experiments.bench_step``: c(L) per batch (synchronous and pipelined) and the AR
  step's roofline fraction per context."""
  plt = _pyplot()
  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  ver = df[df.kind == "verify"]
  for batch, g in ver.groupby("batch"):
    line, = axes[0].plot(g.L, g.c, marker="o", label=f"B={batch}")
    axes[0].plot(g.L, g.pipelined_c, marker="x", ls="--", color=line.get_color())
  axes[0].set(xlabel="draft length L (verify width L + 1)", ylabel="c = verify step / AR step",
              title="c(L) (solid: synchronous, dashed: pipelined)")
  axes[0].legend()
  ar = df[df.kind == "ar"]
  for ctx, g in ar.groupby("context"):
    line, = axes[1].plot(g.batch, g.roofline_fraction, marker="o", label=f"ctx={ctx}")
    axes[1].plot(g.batch, g.pipelined_roofline_fraction, marker="x", ls="--",
                 color=line.get_color())
  axes[1].set(xscale="log", xlabel="batch", ylabel="memory roofline time / AR step time",
              title="AR step vs the memory roofline (1 = at the roofline)")
  axes[1].legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def engine_loop_figure(df: pd.DataFrame, path: str) -> None:
  """``benchmarks.engine_loop``: engine-level c(L) per batch and context, and the AR
  engine step's HBM roofline fraction."""
  plt = _pyplot()
  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  # Runs with several meshes or layer counts (``--mesh``, ``--num_layers``) get one line each.
  extra = [c for c in ("mesh", "num_layers") if c in df and df[c].nunique() > 1]

  def tag(key) -> str:
    return "".join(f"{c}={v} " for c, v in zip(extra, key))

  for key, g in df.groupby(extra + ["batch", "context"]):
    g = g.sort_values("L")
    axes[0].plot(g.L, g.c, marker="o",
                 label=f"{tag(key[:len(extra)])}B={key[-2]}, ctx={key[-1]}")
  axes[0].axhline(1.0, color="gray", lw=0.5)
  axes[0].set(xlabel="draft length L (verify width L + 1)", ylabel="c = SD step / AR step",
              title="engine-level c(L), synthetic acceptance")
  axes[0].legend(fontsize=7)
  ar = df[df.L == 0]
  for key, g in ar.groupby(extra + ["context"]):
    key = key if isinstance(key, tuple) else (key,)
    axes[1].plot(g.batch, g.roofline_fraction, marker="o",
                 label=f"{tag(key[:len(extra)])}ctx={key[-1]}")
  axes[1].set(xscale="log", xlabel="batch", ylabel="HBM roofline / AR engine step",
              title="AR engine step vs HBM roofline", ylim=(0, 1.05))
  axes[1].legend()
  fig.suptitle(f"{df.target.iloc[0]} {df.dtype.iloc[0]} on {df.device.iloc[0]}")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def seed_study_figure(table: pd.DataFrame, path: str) -> None:
  """``experiments.seed_study``, one trace file: measured speedup over AR vs batch size
  per point (error bars: std over repeats), the specjax-semantics simulator dashed in the
  same colour (over full-batch steps, as measured, where the table has that column); and the share of the SD step not spent drafting (verify_share)."""
  plt = _pyplot()
  fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
  pts = table[~table.point.isin(["ar"]) & ~table.point.str.startswith("ngram_lookup")]
  for i, (point, g) in enumerate(pts.groupby("point", sort=False)):
    g = g.sort_values("batch")
    color = f"C{i % 10}"
    axes[0].errorbar(g.batch, g.speedup, yerr=g.speedup_std.fillna(0), marker="o",
                     color=color, label=point, capsize=2)
    sim = next((c for c in ("sim_specjax_full_speedup", "sim_specjax_speedup") if c in g), None)
    if sim:
      axes[0].plot(g.batch, g[sim], ls="--", color=color, lw=0.8)
    if g.verify_share.notna().any() and not point.startswith(("ngram_k", "oracle", "comb")):
      axes[1].plot(g.batch, g.verify_share, marker="o", color=color, label=point)
  axes[0].axhline(1.0, color="gray", lw=0.5)
  axes[0].set(xscale="log", xlabel="batch size", ylabel="speedup over AR (tau / c)",
              title="measured (solid) vs simulator, specjax semantics (dashed)")
  axes[0].legend(fontsize=7, ncol=2)
  axes[1].set(xscale="log", xlabel="batch size", ylim=(0, 1.05),
              ylabel="zero-cost drafter step / SD step",
              title="share of the SD step spent verifying")
  axes[1].legend(fontsize=7)
  # The SD points' repeats (AR's may be more: one baseline per run of the study).
  reps = table.repeats[table.point != "ar"]
  reps = reps if len(reps) else table.repeats
  lo, hi = int(reps.min()), int(reps.max())
  fig.suptitle(f"{table.data.iloc[0]}: seed traces replayed, "
               f"{lo if lo == hi else f'{lo}-{hi}'} repeat(s)")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)

