"""Times AR decode / verify steps against the HBM roofline and the HF transformers peer.

Example (on the GPU machine):
  python -m experiments.bench_step --output_dir=$OUT --batch_sizes=1,4,16,64
"""

from __future__ import annotations

import os

from absl import flags

from benchmarks.step_cost import StepBenchConfig, run_step_benchmark
from harness import cli, plots
from models.shapes import SHAPES

_SHAPE = flags.DEFINE_enum("shape", "llama3-8b", list(SHAPES),
                           "Model shape (models.shapes; random weights).")
_DTYPE = flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"],
                           "Parameter dtype; default the shape's (bf16; tiny f32).")

FLAGS = flags.DEFINE_list("batch_sizes", ["1", "4", "16", "64"], "Batch sizes.")
_CTX = flags.DEFINE_list("contexts", ["512", "2048", "8192"], "AR contexts (tokens).")
_L = flags.DEFINE_list("verify_lengths", [str(i) for i in range(1, 9)], "Draft lengths L.")
_VCTX = flags.DEFINE_integer("verify_context", 512, "Context of the verify sweep.")
_IMPL = flags.DEFINE_string("attention_implementation", "reference", "Paged attention impl.")
_REPS = flags.DEFINE_integer("reps", 20, "Timed repetitions per point.")
_HF = flags.DEFINE_boolean("hf_peer", True, "Also time HF transformers (needs torch+CUDA).")
_HFB = flags.DEFINE_list("hf_batch_sizes", ["1", "16"], "HF peer batch sizes.")
_OUT = flags.DEFINE_string("output_dir", "results/bench_step", "Where to write CSV and plot.")


def main(argv):
  del argv
  shape = SHAPES[_SHAPE.value]
  cfg = StepBenchConfig(
      model=shape.replace(dtype=_DTYPE.value or shape.dtype),
      batch_sizes=tuple(int(b) for b in FLAGS.value), contexts=tuple(int(c) for c in _CTX.value),
      verify_lengths=tuple(int(v) for v in _L.value), verify_context=_VCTX.value,
      attention_implementation=_IMPL.value, reps=_REPS.value, hf_peer=_HF.value,
      hf_batch_sizes=tuple(int(b) for b in _HFB.value),
  )
  df = run_step_benchmark(cfg)
  os.makedirs(_OUT.value, exist_ok=True)
  df.to_csv(os.path.join(_OUT.value, "bench_step.csv"), index=False)
  plots.step_benchmark_figure(df, os.path.join(_OUT.value, "bench_step.png"))
  print(df.to_string(index=False))


if __name__ == "__main__":
  cli.run(main)
