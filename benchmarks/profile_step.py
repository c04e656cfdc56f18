"""Where one step's time goes: the top device ops of a profiled forward step.

Runs ``reps`` steps of the step benchmark's model (random weights) under
``jax.profiler.trace`` and sums the trace's complete events by op name (numbered
fusion suffixes folded), so a slow step shows which kernels or copies dominate.

  python -m benchmarks.profile_step --shape=llama3-8b --batch=1 --context=512 --num_query=1
"""

from __future__ import annotations

import cProfile
import pstats
import tempfile
import time

import jax
from absl import flags

from benchmarks.step_cost import StepBenchConfig, _Runner
from harness import cli
from harness.device_time import top_ops
from models.shapes import SHAPES

_SHAPE = flags.DEFINE_enum("shape", "llama3-8b", list(SHAPES),
                           "Model shape (models.shapes; random weights).")
_DTYPE = flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"],
                           "Parameter dtype; default the shape's (bf16; tiny f32).")
_BATCH = flags.DEFINE_integer("batch", 1, "Batch size B.")
_CONTEXT = flags.DEFINE_integer("context", 512, "KV context (tokens).")
_QUERY = flags.DEFINE_integer("num_query", 1, "Query tokens per row (1 = AR, L+1 = verify).")
_IMPL = flags.DEFINE_string("attention_implementation", "reference", "Paged attention impl.")
_REPS = flags.DEFINE_integer("reps", 10, "Profiled steps.")
_TOP = flags.DEFINE_integer("top", 25, "Ops to print.")
_HOST = flags.DEFINE_boolean("host_profile", False, "Also cProfile the host side of the steps.")
_UNROLL = flags.DEFINE_boolean("unroll_layers", True, "Unrolled layers (else the layer scan).")



def main(argv):
  del argv
  model = SHAPES[_SHAPE.value]
  cfg = StepBenchConfig(model=model.replace(dtype=_DTYPE.value or model.dtype),
                        batch_sizes=(_BATCH.value,), contexts=(_CONTEXT.value,), verify_lengths=(_QUERY.value,),
                        verify_context=_CONTEXT.value, attention_implementation=_IMPL.value,
                        reps=3, hf_peer=False)
  runner = _Runner(cfg, unroll_layers=_UNROLL.value)
  step_s = runner.time_step(_BATCH.value, _CONTEXT.value, _QUERY.value)
  print(f"step {1e3 * step_s:.3f} ms (median of 3 after warm-up)")
  inputs = runner.inputs(_BATCH.value, _CONTEXT.value, _QUERY.value)
  if _HOST.value:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(_REPS.value):
      runner.step(_BATCH.value, _CONTEXT.value, _QUERY.value, inputs)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(15)
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d):
      t = time.perf_counter()
      for _ in range(_REPS.value):
        runner.step(_BATCH.value, _CONTEXT.value, _QUERY.value, inputs)
      dt = (time.perf_counter() - t) / _REPS.value
    ops = top_ops(d, _REPS.value)
  print(f"profiled: {1e3 * dt:.3f} ms/step; sum of ops {sum(o[1] for o in ops):.3f} ms/step")
  for name, ms, n in ops[: _TOP.value]:
    print(f"  {ms:9.3f} ms  x{n:<4d} {name[:100]}")


if __name__ == "__main__":
  cli.run(main)
