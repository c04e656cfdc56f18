"""One Markdown and HTML report over one or more evaluation run directories.

``write_report(run_dirs, out_dir)`` reads each run's ``config.json``, ``results.csv``,
``categories.csv`` and ``peer.csv`` (written by ``harness.evaluation``) and writes
``report.md`` and ``report.html`` into ``out_dir`` with, per run: the settings, the
per-method table (mean ± std over repeats, 95 % intervals), the per-category table, the
figures, the notes and the greedy divergences; and for two or more runs a side-by-side
comparison of each (method, batch size) against the first run: the difference and
whether it exceeds the spread (Welch's t-test over the repeats, p < 0.05,
``scipy.stats.ttest_ind_from_stats``; "n/a" with fewer than two repeats on a side).

Raises ``ValueError`` for a directory without ``results.csv``.
"""

from __future__ import annotations

import html
import json
import math
import os
from collections.abc import Sequence

import pandas as pd
from scipy import stats

from harness.stats import aggregate, format_mean_std

__all__ = ["COMPARED", "load_run", "write_report"]

# Columns compared across runs (mean ± std per (method, batch size)).
COMPARED = ("tau", "acceptance_rate", "c", "S_pred", "measured_speedup", "e2e_speedup",
            "tokens_per_s", "ttft_p50_s", "tpot_p50_s")
_TABLE = ("tau", "acceptance_rate", "c", "S_pred", "measured_speedup", "e2e_speedup",
          "tokens_per_s", "ttft_p50_s", "tpot_p50_s", "latency_p99_s")
_SETTINGS = ("target", "draft", "methods", "dataset", "num_prompts", "categories", "batch_sizes",
             "num_speculative_tokens", "max_new_tokens", "temperature", "seed", "repeats",
             "request_rate", "dtype", "layer_execution", "attention_implementation",
             "matmul_precision")
_FIGURES = ("speedup.png", "acceptance_by_position.png", "categories.png", "latency_cdf.png")


def load_run(run_dir: str) -> dict:
  """The files of one run directory: ``config`` (dict), ``results``, ``categories`` and
  ``peer`` (DataFrames; empty when absent), ``figures`` (paths that exist)."""
  path = os.path.join(run_dir, "results.csv")
  if not os.path.isfile(path):
    raise ValueError(f"run_dir={run_dir!r} has no results.csv (not an evaluation output)")
  cfg_path = os.path.join(run_dir, "config.json")
  config = json.load(open(cfg_path, encoding="utf-8")) if os.path.isfile(cfg_path) else {}

  def csv(name):
    p = os.path.join(run_dir, name)
    return pd.read_csv(p) if os.path.isfile(p) and os.path.getsize(p) > 1 else pd.DataFrame()

  results = pd.read_csv(path)
  if "notes" in results:
    results["notes"] = ["" if pd.isna(v) else str(v) for v in results["notes"]]
  return {"dir": run_dir, "config": config, "results": results,
          "categories": csv("categories.csv"), "peer": csv("peer.csv"),
          "figures": [os.path.join(run_dir, f) for f in _FIGURES
                      if os.path.isfile(os.path.join(run_dir, f))]}


def _method_table(df: pd.DataFrame) -> pd.DataFrame:
  agg = aggregate(df)
  out = pd.DataFrame({"method": agg["method"], "batch": agg["batch_size"],
                      "repeats": agg["n_repeats"]})
  for c in _TABLE:
    if f"{c}_mean" in agg:
      out[c] = [format_mean_std(m, s) for m, s in zip(agg[f"{c}_mean"], agg[f"{c}_std"])]
  if "S_pred_ci_lo" in agg:
    out["S_pred 95% CI"] = [f"[{lo:.3f}, {hi:.3f}]" if math.isfinite(lo) else ""
                            for lo, hi in zip(agg["S_pred_ci_lo"], agg["S_pred_ci_hi"])]
  if "lossless" in df:
    lossless = df.groupby(["method", "batch_size"], sort=False)["lossless"].agg(
        lambda v: "" if v.isna().all() else str(bool(v.dropna().astype(bool).all())))
    out["lossless"] = lossless.to_numpy()
  return out


def _category_table(cat: pd.DataFrame) -> pd.DataFrame:
  if cat.empty:
    return cat
  cols = [c for c in ("method", "batch_size", "category", "n_requests", "tau", "S_pred",
                      "latency_speedup", "n_latency_pairs") if c in cat]
  return cat[cols].round(3)


def _comparison(base: dict, other: dict) -> pd.DataFrame:
  a, b = aggregate(base["results"]), aggregate(other["results"])
  merged = a.merge(b, on=["method", "batch_size"], suffixes=("_a", "_b"))
  rows = []
  for _, r in merged.iterrows():
    for c in COMPARED:
      if f"{c}_mean_a" not in r or f"{c}_mean_b" not in r:
        continue
      ma, sa, na = r[f"{c}_mean_a"], r[f"{c}_std_a"], r["n_repeats_a"]
      mb, sb, nb = r[f"{c}_mean_b"], r[f"{c}_std_b"], r["n_repeats_b"]
      if not (math.isfinite(ma) and math.isfinite(mb)):
        continue
      verdict = "n/a (1 repeat)"
      if na >= 2 and nb >= 2 and math.isfinite(sa) and math.isfinite(sb):
        if sa == 0 and sb == 0:
          verdict = "yes" if ma != mb else "no"
        else:
          p = stats.ttest_ind_from_stats(ma, sa, na, mb, sb, nb, equal_var=False).pvalue
          verdict = f"{'yes' if p < 0.05 else 'no'} (p={p:.3f})"
      rows.append({"method": r["method"], "batch": r["batch_size"], "metric": c,
                   "A": format_mean_std(ma, sa), "B": format_mean_std(mb, sb),
                   "B - A": f"{mb - ma:+.3f}",
                   "B / A": f"{mb / ma:.3f}" if ma else "",
                   "exceeds spread": verdict})
  return pd.DataFrame(rows)


def _md_table(df: pd.DataFrame) -> str:
  if df is None or df.empty:
    return "_(none)_\n"
  cols = [str(c) for c in df.columns]
  lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
  for _, r in df.iterrows():
    cells = ["" if (isinstance(v, float) and math.isnan(v)) else str(v).replace("|", "\\|")
             for v in r.to_numpy()]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


def _divergences(df: pd.DataFrame) -> pd.DataFrame:
  if "lossless" not in df:
    return pd.DataFrame()
  bad = df[df["lossless"].astype(str) == "False"]
  cols = [c for c in ("method", "batch_size", "repeat", "num_mismatched", "first_divergence",
                      "max_divergence_margin") if c in bad]
  return bad[cols]


def _sections(runs: list[dict], out_dir: str) -> list[tuple[str, str, object]]:
  """(kind, title, payload) with kind in {"h1", "h2", "h3", "text", "table", "image"}."""
  secs: list[tuple[str, str, object]] = [("h1", "specjax evaluation report", None)]
  secs.append(("text", "", "S_pred = tau / c predicts the decode-phase speedup; "
                           "measured_speedup is the measured decode-phase speedup (prefill "
                           "excluded), e2e_speedup the end-to-end one (prefill included). "
                           "Cells are mean ± std over repeats (each its own sampling seed and "
                           "engine); latencies leave out requests alive during a compile."))
  for i, run in enumerate(runs):
    label = chr(ord("A") + i) if len(runs) > 1 else ""
    secs.append(("h2", f"Run {label}: {run['dir']}".replace("Run : ", "Run: "), None))
    cfg = run["config"]
    df = run["results"]
    settings = {k: cfg.get(k) for k in _SETTINGS if k in cfg}
    if len(df):
      first = df.iloc[0]
      for k in ("device", "backend", "jax_version", "attention_backends_used"):
        if k in df:
          settings[k] = first[k]
    secs.append(("h3", "Settings", None))
    secs.append(("table", "", pd.DataFrame({"setting": list(settings),
                                             "value": [str(v) for v in settings.values()]})))
    secs.append(("h3", "Per method and batch size", None))
    secs.append(("table", "", _method_table(df)))
    secs.append(("h3", "Per category (pooled over repeats)", None))
    secs.append(("table", "", _category_table(run["categories"])))
    if not run["peer"].empty:
      secs.append(("h3", "Peer (same prompt ids)", None))
      secs.append(("table", "", run["peer"].round(3)))
    notes = df[df["notes"].astype(bool)] if "notes" in df else pd.DataFrame()
    secs.append(("h3", "Notes (why predicted and measured differ, exclusions)", None))
    secs.append(("table", "", notes[["method", "batch_size", "repeat", "notes"]]
                 if len(notes) else pd.DataFrame()))
    secs.append(("h3", "Greedy divergences from AR", None))
    secs.append(("table", "", _divergences(df)))
    for fig in run["figures"]:
      secs.append(("image", os.path.basename(fig), os.path.relpath(fig, out_dir)))
  if len(runs) > 1:
    for i, other in enumerate(runs[1:], start=1):
      label = chr(ord("A") + i)
      secs.append(("h2", f"Comparison: run {label} vs run A", None))
      secs.append(("table", "", _comparison(runs[0], other)))
  return secs


def _render_md(secs) -> str:
  out = []
  for kind, title, payload in secs:
    if kind in ("h1", "h2", "h3"):
      out.append("#" * int(kind[1]) + f" {title}\n")
    elif kind == "text":
      out.append(f"{payload}\n")
    elif kind == "table":
      out.append(_md_table(payload))
    elif kind == "image":
      out.append(f"![{title}]({payload})\n")
  return "\n".join(out)


def _render_html(secs) -> str:
  out = ["<!doctype html><html><head><meta charset='utf-8'><title>specjax report</title>"
         "<style>body{font-family:sans-serif;max-width:1200px;margin:auto}"
         "table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;"
         "padding:2px 6px}img{max-width:100%}</style></head><body>"]
  for kind, title, payload in secs:
    if kind in ("h1", "h2", "h3"):
      out.append(f"<{kind}>{html.escape(title)}</{kind}>")
    elif kind == "text":
      out.append(f"<p>{html.escape(str(payload))}</p>")
    elif kind == "table":
      out.append("<p><i>(none)</i></p>" if payload is None or payload.empty
                 else payload.to_html(index=False, na_rep=""))
    elif kind == "image":
      out.append(f"<p><img src='{html.escape(payload)}' alt='{html.escape(title)}'></p>")
  out.append("</body></html>")
  return "\n".join(out)


def write_report(run_dirs: Sequence[str], out_dir: str) -> tuple[str, str]:
  """Writes ``report.md`` and ``report.html`` into ``out_dir``; returns their paths."""
  if not run_dirs:
    raise ValueError("run_dirs must name at least one evaluation output directory")
  runs = [load_run(d) for d in run_dirs]
  os.makedirs(out_dir, exist_ok=True)
  secs = _sections(runs, out_dir)
  md, htm = os.path.join(out_dir, "report.md"), os.path.join(out_dir, "report.html")
  with open(md, "w", encoding="utf-8") as f:
    f.write(_render_md(secs))
  with open(htm, "w", encoding="utf-8") as f:
    f.write(_render_html(secs))
  return md, htm
