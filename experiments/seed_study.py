"""The seed study on the engine (``harness.seed_study``): speedup over AR against batch size
with the seed's acceptance traces replayed on a random-weight target, beside what the
trace simulators print for the same points.

  python -m experiments.seed_study --target=llama3-8b --dtype=bfloat16 \
      --traces=../shared/seed_traces/combined_instructcoder.jsonl \
      --batch_sizes=1,4,16,64,128 --attention_implementation=pallas_gpu,reference \
      --output_dir=$OUT/seed_study
  # simulator columns, table and figures from a measured CSV (no device needed):
  python -m experiments.seed_study --measured_csv=docs/.../seed_study.csv \
      --traces=... --cost_model=docs/gpu/runtime_cost_model/cost_model_llama3-8b_h200.json

Writes ``seed_study.csv`` (one row per point and repeat; appended as points finish) and,
with the simulators, ``seed_study_vs_sim.csv``, ``seed_study_table.csv`` (mean ± std
over repeats) and ``seed_study_<data>.png`` per trace file.
"""

from __future__ import annotations

import contextlib
import os

import jax
import pandas as pd
from absl import flags

from harness import cli, seed_study
from harness.traces import read_jsonl
from specjax import cost_model

_TARGET = flags.DEFINE_string("target", "llama3-8b", "A models.shapes name (random weights).")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Model dtype.")
_TRACES = flags.DEFINE_list("traces", [], "Seed trace files (combined_<data>.jsonl).")
_BATCH = flags.DEFINE_list("batch_sizes", ["1", "4", "16", "64", "128"], "Batch sizes.")
_K = flags.DEFINE_list("fixed_k", ["1", "3", "5"], "Fixed draft lengths.")
_W = flags.DEFINE_list("oracle_widths", ["8"], "Verify widths of the oracle points.")
_POINTS = flags.DEFINE_list("points", [], "Only AR and these point labels, measured in this "
                            "order after AR (default: all; verify_share needs the ngram_k rows, "
                            "verify_skip_k the ngram_k point before it).")
_REPEATS = flags.DEFINE_integer("repeats", 1, "Measured runs per point.", lower_bound=1)
_PER_SLOT = flags.DEFINE_integer("requests_per_slot", 2, "Requests per batch slot.",
                                 lower_bound=1)
_MIN_REQ = flags.DEFINE_integer("min_requests", 4, "Fewest requests per batch size.",
                                lower_bound=1)
_MAX_TOTAL = flags.DEFINE_integer("max_total_tokens", 2048, "Only records whose prompt + "
                                  "output fits (the KV pool holds batch x this).",
                                  lower_bound=2)
_OCC = flags.DEFINE_float("min_occupancy", 1.0, "Measure (and --predict) the decode steps "
                          "with at least this share of the batch's slots busy (1: full "
                          "batches only); a report simulates each batch size with the "
                          "value its measured rows record.")
_IMPL = flags.DEFINE_list("attention_implementation", ["reference"], "Paged attention impl(s).")
_PRECISION = flags.DEFINE_string("matmul_precision", None, "jax.default_matmul_precision "
                                 "around the measurement (unset: JAX's default).")
_DRAFTER_OPTION = flags.DEFINE_multi_string(
    "drafter_option", [], "Repeatable KEY=VALUE: an option of the EAGLE-3 drafter.")
_COST = flags.DEFINE_string("cost_model", None, "With it: the simulators' columns, table "
                            f"and figures (a preset {sorted(cost_model.PRESETS)} or JSON).")
_MEASURED = flags.DEFINE_string("measured_csv", None, "Skip measuring: read this CSV.")
_PREDICT = flags.DEFINE_boolean("predict", False, "Skip measuring: only the simulators' "
                                "columns of every point at --batch_sizes under --cost_model "
                                "(predicted.csv), e.g. before a device run.")
_OUT = flags.DEFINE_string("output_dir", "results/seed_study", "Where the files go.")



def main(argv):
  del argv
  if not _TRACES.value:
    raise ValueError("--traces is empty: name at least one seed trace file")
  points = seed_study.study_points(cli.int_list(_K), cli.int_list(_W))
  if _POINTS.value:
    known = {p.label for p in points}
    unknown = sorted(set(_POINTS.value) - known)
    if unknown:
      raise ValueError(f"--points={unknown} unknown; points: {sorted(known)}")
    by_label = {p.label: p for p in points}
    points = [p for p in points if p.length == 0] + [by_label[x] for x in _POINTS.value]
  if not (_PREDICT.value or _MEASURED.value):
    seed_study.check_point_order(points)  # before the target is built
  os.makedirs(_OUT.value, exist_ok=True)
  if _PREDICT.value:
    _predict(points)
    return
  if _MEASURED.value:
    measured = pd.read_csv(_MEASURED.value)
  else:
    measured = _measure(points)
  if _COST.value:
    _report(measured, points)


def _measure(points) -> pd.DataFrame:
  from harness.engine_loop import build_target  # noqa: PLC0415
  from specjax.compile_cache import enable_compilation_cache  # noqa: PLC0415
  from specjax.steps import split_model  # noqa: PLC0415

  enable_compilation_cache()
  impl = tuple(_IMPL.value)
  cfg, model = build_target(_TARGET.value, _DTYPE.value)
  split = split_model(model, unroll_layers=True)
  del model
  study = seed_study.StudyConfig(
      files=tuple(_TRACES.value), batch_sizes=cli.int_list(_BATCH), points=tuple(points),
      requests_per_slot=_PER_SLOT.value, min_requests=_MIN_REQ.value,
      max_total_tokens=_MAX_TOTAL.value, repeats=_REPEATS.value,
      attention_implementation=impl[0] if len(impl) == 1 else impl,
      drafter_options=cli.key_value_options(_DRAFTER_OPTION.value, "drafter_option"),
      csv_path=os.path.join(_OUT.value, "seed_study.csv"), min_occupancy=_OCC.value)
  precision = (jax.default_matmul_precision(_PRECISION.value) if _PRECISION.value
               else contextlib.nullcontext())
  with precision:
    df = seed_study.measure_study(study, split, cfg, target=_TARGET.value, dtype=_DTYPE.value,
                                  read_records=read_jsonl)
  df["matmul_precision"] = _PRECISION.value or "default"
  df.to_csv(study.csv_path, index=False)
  return df


def _simulator_options(min_occupancy: float | None) -> dict:
  """``seed_study.simulate_points``' options from the flags."""
  return dict(max_total_tokens=_MAX_TOTAL.value, requests_per_slot=_PER_SLOT.value,
              min_requests=_MIN_REQ.value, read_records=read_jsonl,
              seed_cost=cost_model.load("seed-llama8b-h100"), min_occupancy=min_occupancy)


def _predict(points) -> None:
  if not _COST.value:
    raise ValueError("--predict needs --cost_model (a preset or a fitted JSON)")
  pred = seed_study.predict_points(
      _TRACES.value, cli.int_list(_BATCH), cost_model.load(_COST.value), points=points,
      **_simulator_options(_OCC.value))
  pred.to_csv(os.path.join(_OUT.value, "predicted.csv"), index=False)
  print(pred.round(3).to_string(index=False))


def _report(measured: pd.DataFrame, points) -> None:
  from harness import plots  # noqa: PLC0415

  both = seed_study.simulate_points(
      seed_study.rebase_on_mean_baselines(measured), _TRACES.value,
      cost_model.load(_COST.value), points=points,
      **_simulator_options(None))  # each batch size as its rows were measured
  both.to_csv(os.path.join(_OUT.value, "seed_study_vs_sim.csv"), index=False)
  table = seed_study.summary_table(both)
  table.to_csv(os.path.join(_OUT.value, "seed_study_table.csv"), index=False)
  for data, sub in table.groupby("data"):
    plots.seed_study_figure(sub, os.path.join(_OUT.value, f"seed_study_{data}.png"))
  print(table.to_string(index=False))


if __name__ == "__main__":
  cli.run(main)
