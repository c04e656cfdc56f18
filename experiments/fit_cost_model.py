"""Fits the step cost model (``specjax.cost_model``; ``harness.cost_fit.fit``) from
engine-loop and evaluation CSVs; ``specjax.cost_model.load`` reads the JSON back.

  python -m experiments.fit_cost_model \
      --engine_loop_csv=docs/gpu/runtime_cost_model/engine_loop_8b_b1/engine_loop.csv \
      --eval_csv=results/x/results.csv --output=cost_model.json
  # the seed study's card: EAGLE-3 draft cost from its rows (harness.seed_study.fit_cost_model)
  python -m experiments.fit_cost_model --engine_loop_csv=docs/gpu/cost_model_check/8b_fit_b1.csv \
      --seed_study_csv=/tmp/sweep.csv --output=cost_model.json
"""

from __future__ import annotations

import pandas as pd
from absl import flags

from harness import cli, cost_fit, seed_study

_LOOP = flags.DEFINE_list("engine_loop_csv", None, "benchmarks.engine_loop CSVs.", required=True)
_EVAL = flags.DEFINE_list("eval_csv", [], "harness.evaluation results.csv files (draft costs).")
_SEED = flags.DEFINE_list("seed_study_csv", [], "experiments.seed_study CSVs: draft costs "
                          "from their points instead of --eval_csv "
                          "(harness.seed_study.fit_cost_model).")
_NEW = flags.DEFINE_integer("new_tokens", 64, "The engine-loop runs' --new_tokens.")
_NAME = flags.DEFINE_string("name", "fitted", "Label of the cost model.")
_SWITCH = flags.DEFINE_float("switch_cost_ms", 0.0, "Method switching cost per row (ms).")
_OUT = flags.DEFINE_string("output", "cost_model.json", "Where the JSON goes.")
_QUERY = flags.DEFINE_enum("query_model", "knee", list(cost_fit.QUERY_MODELS),
                           "The target's query term: one slope past a knee, or piecewise "
                           "linear segments (harness.cost_fit).")


def main(argv):
  del argv
  loops = [pd.read_csv(p) for p in _LOOP.value]
  if _SEED.value and _EVAL.value:
    raise ValueError("--seed_study_csv and --eval_csv are exclusive: give one source of "
                     "draft costs")
  if _SEED.value:
    model = seed_study.fit_cost_model(
        loops, pd.concat([pd.read_csv(p) for p in _SEED.value], ignore_index=True),
        new_tokens=_NEW.value, name=_NAME.value, switch_s=_SWITCH.value / 1e3,
        query_model=_QUERY.value)
  else:
    model = cost_fit.fit(loops, [pd.read_csv(p) for p in _EVAL.value],
                         new_tokens=_NEW.value, name=_NAME.value,
                         switch_s=_SWITCH.value / 1e3, query_model=_QUERY.value)
  with open(_OUT.value, "w") as f:
    f.write(model.to_json())
  print(model.to_json())


if __name__ == "__main__":
  cli.run(main)
