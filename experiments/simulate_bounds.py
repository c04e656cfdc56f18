"""SD speedup bounds over AR from acceptance traces and a step cost model
(``harness.simulator``; docs/simulator.md).

  python -m experiments.simulate_bounds --traces=traces/x.jsonl \
      --cost_model=seed-llama8b-h100 --output_dir=results/bounds
  python -m experiments.simulate_bounds --cost_model=cost_model.json \
      --engine_loop_csv=results/engine_loop/engine_loop.csv   # measured vs simulated
"""

from __future__ import annotations

import os

import pandas as pd
from absl import flags

from harness import cli, simulator
from specjax import cost_model

_TRACES = flags.DEFINE_list("traces", [], "JSONL trace files (harness.traces or the seed's).")
_COST = flags.DEFINE_string("cost_model", "seed-llama8b-h100",
                            f"A preset {sorted(cost_model.PRESETS)} or a JSON file.")
_METHODS = flags.DEFINE_list("methods", [], "Trace methods (default: all in the file).")
_K = flags.DEFINE_list("fixed_k", ["1", "3", "5"], "Draft lengths of the fixed-k policy.")
_ORACLE = flags.DEFINE_boolean("oracle", True, "Simulate the oracle length per method.")
_COMBINE = flags.DEFINE_boolean("combine", True, "Simulate the oracle combination.")
_BATCH = flags.DEFINE_list("batch_sizes", ["1", "2", "4", "8", "16", "32", "64", "128"],
                           "Batch sizes.")
_BATCHING = flags.DEFINE_enum("batching", "continuous", ["continuous", "copies"],
                              "continuous: distinct requests; copies: the seed's batches.")
_PREFILL = flags.DEFINE_boolean("include_prefill", True, "Charge prefill to AR and SD.")
_SWITCH = flags.DEFINE_float("switch_cost_ms", None, "Method switch cost per row (ms).")
_METHOD_COST = flags.DEFINE_list("method_cost", [],
                                 "TRACE_METHOD=COST_METHOD: charge one with the other's cost.")
_NUM = flags.DEFINE_integer("num_requests", 0, "First n requests per file (0 = all); "
                            "--semantics=seed: n drawn (0 = the seed's 300).", lower_bound=0)
_SEMANTICS = flags.DEFINE_enum(
    "semantics", "specjax", ["specjax", "seed"],
    "specjax: this project's simulator; seed: the seed paper's (SpecDecode-Bench) rules, "
    "with --batching=copies (docs/simulator.md lists the differences).")
_MATCH_P = flags.DEFINE_float(
    "match_probability", None, "seed semantics: n-gram match probability at acc_len 1 "
    "(default: the seed's value for the data set in the file name).")
_LOOP = flags.DEFINE_string("engine_loop_csv", None,
                            "Instead: compare a benchmarks.engine_loop CSV with the model.")
_NEW = flags.DEFINE_integer("new_tokens", 64, "The engine-loop run's --new_tokens.")
_OUT = flags.DEFINE_string("output_dir", None, "Where bounds.csv / engine_loop_vs_sim.csv go.")



def _pair(text: str) -> tuple[str, str]:
  if text.count("=") != 1:
    raise ValueError(f"--method_cost={text!r} must be TRACE_METHOD=COST_METHOD")
  a, b = text.split("=")
  return a, b


def main(argv):
  del argv
  if _LOOP.value:
    df = simulator.compare_engine_loop(pd.read_csv(_LOOP.value), cost_model.load(_COST.value),
                                       new_tokens=_NEW.value)
    name = "engine_loop_vs_sim.csv"
    cols = ["batch", "context", "L", "step_ms", "sim_step_ms", "step_ratio", "tau", "sim_tau"]
    print(df[cols].to_string(index=False, float_format=lambda x: f"{x:.3f}"))
  else:
    cfg = simulator.BoundsConfig(
        traces=tuple(_TRACES.value), cost_model=_COST.value, methods=tuple(_METHODS.value),
        fixed_k=cli.int_list(_K), oracle=_ORACLE.value, combine=_COMBINE.value,
        batch_sizes=cli.int_list(_BATCH), batching=_BATCHING.value,
        include_prefill=_PREFILL.value, switch_cost_ms=_SWITCH.value,
        method_costs=tuple(_pair(p) for p in _METHOD_COST.value), num_requests=_NUM.value,
        semantics=_SEMANTICS.value, match_probability=_MATCH_P.value)
    df = simulator.run_bounds(cfg)
    name = "bounds.csv"
    table = df.pivot_table(index=["traces", "policy"], columns="batch_size", values="speedup")
    print(table.to_string(float_format=lambda x: f"{x:.2f}"))
    if "verify_share" in df:
      vshare = df.pivot_table(index=["traces", "policy"], columns="batch_size",
                              values="verify_share")
      print("\nverification share of SD decode time")
      print(vshare.to_string(float_format=lambda x: f"{x:.2f}"))
  if _OUT.value:
    os.makedirs(_OUT.value, exist_ok=True)
    df.to_csv(os.path.join(_OUT.value, name), index=False)
    print(f"wrote {os.path.join(_OUT.value, name)}")


if __name__ == "__main__":
  cli.run(main)
