"""The fitted step cost model against held-out engine-loop points
(``harness.cost_check``): one row per held-out draft-free point with its measured and
predicted step time and relative error.

  python -m experiments.check_cost_model \
      --engine_loop_csv=docs/gpu/device_resident_loop/engine_loop_8b_b1.csv,docs/gpu/device_resident_loop/engine_loop_8b_b16_b64.csv \
      --heldout_batches=64 --heldout_contexts=4096 --output=results/cost_check.csv
  # the 70B shape measured at 4 and 8 layers (profiled), predicted at 12:
  python -m experiments.check_cost_model --engine_loop_csv=70b_layers.csv --heldout_layers=12

Held out: rows of ``--heldout_csv`` files, and rows of ``--engine_loop_csv`` whose batch,
context or layer count is listed. Prints the table and how many points are within
``--tolerance``.
"""

from __future__ import annotations

import pandas as pd
from absl import flags

from harness import cli, cost_check, cost_fit

_LOOP = flags.DEFINE_list("engine_loop_csv", None, "benchmarks.engine_loop CSVs (profiled: "
                          "device_ms) to fit on, less the held-out rows.", required=True)
_HELD = flags.DEFINE_list("heldout_csv", [], "engine-loop CSVs predicted, not fitted.")
_BATCHES = flags.DEFINE_list("heldout_batches", [], "Batch sizes held out.")
_CONTEXTS = flags.DEFINE_list("heldout_contexts", [], "Contexts held out.")
_LAYERS = flags.DEFINE_list("heldout_layers", [], "Layer counts held out.")
_NEW = flags.DEFINE_integer("new_tokens", 64, "The engine-loop runs' --new_tokens.",
                            lower_bound=0)
_TOL = flags.DEFINE_float("tolerance", 0.05, "Largest |relative error| counted as within.",
                          lower_bound=0.0)
_OUT = flags.DEFINE_string("output", None, "Where the table's CSV goes (optional).")
_QUERY = flags.DEFINE_enum("query_model", "knee", list(cost_fit.QUERY_MODELS),
                           "The fitted target's query term (harness.cost_fit).")



def main(argv):
  del argv
  frame = pd.concat([pd.read_csv(p) for p in _LOOP.value], ignore_index=True)
  fit_rows, held = cost_check.split_heldout(
      frame, batches=cli.int_list(_BATCHES), contexts=cli.int_list(_CONTEXTS),
      layers=cli.int_list(_LAYERS))
  if _HELD.value:
    held = pd.concat([held] + [pd.read_csv(p) for p in _HELD.value], ignore_index=True)
  out = cost_check.heldout_check(fit_rows, held, new_tokens=_NEW.value,
                                 tolerance=_TOL.value, query_model=_QUERY.value)
  cols = ["target", "num_layers", "batch", "context", "L", "step_ms", "pred_step_ms",
          "device_ms", "pred_device_ms", "rel_error", "within"]
  print(out[[c for c in cols if c in out]].to_string(index=False))
  print(f"{int(out.within.sum())} of {len(out)} held-out points within "
        f"{100 * _TOL.value:g} % (fitted on {len(fit_rows)} points)")
  if _OUT.value:
    out.to_csv(_OUT.value, index=False)


if __name__ == "__main__":
  cli.run(main)
