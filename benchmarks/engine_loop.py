"""Engine-loop benchmark: the whole engine timed per step at any model shape, against the
HBM roofline and the device's own busy time (``harness.engine_loop`` says what each
column measures and how).

  python -m benchmarks.engine_loop --target=llama3-8b --dtype=bfloat16 \\
      --batch_sizes=1,16,64 --contexts=512,4096 --lengths=0,1,2,4,8 --output_dir=$OUT

``--mesh=none --mesh=data:1,model:1`` runs the same grid unsharded and on each mesh;
``--num_layers=16,32`` builds the target with that many layers and adds ``*_scaled``
columns for the full layer count.
"""

from __future__ import annotations

import contextlib
import os

import jax
import pandas as pd
from absl import flags

from harness import cli, plots
from harness.engine_loop import DRAFTERS, run_engine_loop
from models.layers import (
  SMALL_F32_MATMULS,
  set_small_f32_matmul,
  set_two_row_decode,
  small_f32_matmul,
)
from models.shapes import SHAPES
from specjax.compile_cache import enable_compilation_cache
from specjax.config import MATMUL_PRECISIONS, EngineConfig

_TARGET = flags.DEFINE_string("target", "llama3-8b", f"{list(SHAPES)} or a models.zoo name.")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Model dtype.")
_BATCH = flags.DEFINE_list("batch_sizes", ["1", "16", "64"], "Batch sizes.")
_CTX = flags.DEFINE_list("contexts", ["512", "4096"], "Prompt lengths (tokens).")
_L = flags.DEFINE_list("lengths", ["0", "1", "2", "4", "8"], "Draft lengths (0 = AR).")
_NEW = flags.DEFINE_integer("new_tokens", 64, "Engine steps per request (a request drafting "
                            "L tokens generates new_tokens * (L + 1) tokens).")
_IMPL = flags.DEFINE_list("attention_implementation", ["reference"], "Paged attention impl(s).")
_LAYERS = flags.DEFINE_enum("layer_execution", "unrolled", ["unrolled", "scan"], "Layers.")
_PROFILE = flags.DEFINE_boolean("profile", True, "Also measure device busy time per step.")
_OUT = flags.DEFINE_string("output_dir", "results/engine_loop", "Where CSV and plot go.")
_MESHES = flags.DEFINE_multi_string(
    "mesh", ["none"], "Repeatable: 'none' (unsharded) or a mesh such as 'data:1,model:2' "
    "(specjax.sharding.parse_mesh); each is timed.")
_DRAFTER = flags.DEFINE_enum("drafter", "constant", list(DRAFTERS),
                              "constant: L copies of the pending token drafted in the fused "
                              "device step; constant_host: on the host; draft_model: a "
                              "random-weight --draft model; suffix: suffix decoding's device "
                              "drafter; ngram: n-gram prompt lookup on the device; eagle3: a random EAGLE-3 head's fused chain.")
_DRAFT = flags.DEFINE_string("draft", "llama3.2-1b", "models.shapes draft of --drafter=draft_model.")
_STEPS = flags.DEFINE_integer("steps_per_dispatch", EngineConfig.steps_per_dispatch,
                              "Engine iterations per device call.")
_TOP = flags.DEFINE_integer("top_ops", 0, "With --profile: log this many top device ops "
                            "per engine step of each row's profiled run.")
_PRECISION = flags.DEFINE_enum(
    "matmul_precision", None, list(MATMUL_PRECISIONS), "jax.default_matmul_precision "
    "around the whole run (unset: JAX's default; experiments.evaluate uses 'highest').")
_TWO_ROW = flags.DEFINE_boolean("two_row_decode", True, "models.layers.project's two-row "
                                "GPU decode of one-row projections (off: plain one-row dots).")
_SMALL_F32 = flags.DEFINE_enum(
    "small_f32_matmul", small_f32_matmul()[0], list(SMALL_F32_MATMULS),
    "models.layers.set_small_f32_matmul: how full-f32 GPU projections of at most "
    "--small_f32_max_rows rows run.")
_SMALL_F32_ROWS = flags.DEFINE_integer("small_f32_max_rows", small_f32_matmul()[1],
                                       "Most rows of such a projection.")
_NUM_LAYERS = flags.DEFINE_list("num_layers", None, "Layer counts to build the target with "
                                "(adds columns scaled to the shape's full layer count).")
_ACCEPTANCE = flags.DEFINE_string(
    "acceptance", "synthetic", "synthetic (every draft accepted) or replay:FILE[:METHOD] "
    "(a harness.traces / seed trace file's requests and recorded acceptance; --contexts "
    "and --new_tokens are then unused).")
_DRAFTER_OPTION = flags.DEFINE_multi_string(
    "drafter_option", [], "Repeatable KEY=VALUE (VALUE read as JSON when it parses): an "
    "option of the drafter's method, e.g. --drafter=eagle3 --drafter_option=window=16.")
_REPLAY_N = flags.DEFINE_integer("replay_requests", None, "With replay: the first this many "
                                 "requests of the file (default: all).", lower_bound=1)


def main(argv):
  del argv
  enable_compilation_cache()
  set_two_row_decode(_TWO_ROW.value)
  set_small_f32_matmul(_SMALL_F32.value, _SMALL_F32_ROWS.value)
  impl = tuple(_IMPL.value)
  precision = (jax.default_matmul_precision(_PRECISION.value) if _PRECISION.value
               else contextlib.nullcontext())
  with precision:
    df = _run(impl)
  df["matmul_precision"] = _PRECISION.value or "default"
  os.makedirs(_OUT.value, exist_ok=True)
  df.to_csv(os.path.join(_OUT.value, "engine_loop.csv"), index=False)
  plots.engine_loop_figure(df, os.path.join(_OUT.value, "engine_loop.png"))
  print(df.to_string(index=False, float_format=lambda x: f"{x:.3f}"))


def _run(impl) -> pd.DataFrame:
  return run_engine_loop(
      target=_TARGET.value, dtype=_DTYPE.value, batch_sizes=[int(b) for b in _BATCH.value],
      contexts=[int(c) for c in _CTX.value], lengths=[int(v) for v in _L.value],
      new_tokens=_NEW.value, attention_implementation=impl[0] if len(impl) == 1 else impl,
      profile=_PROFILE.value, layer_execution=_LAYERS.value, meshes=_MESHES.value,
      num_layers=[int(n) for n in _NUM_LAYERS.value] if _NUM_LAYERS.value else None,
      drafter=_DRAFTER.value, draft=_DRAFT.value, steps_per_dispatch=_STEPS.value,
      top=_TOP.value, ops_dir=_OUT.value, acceptance=_ACCEPTANCE.value,
      replay_num_requests=_REPLAY_N.value,
      drafter_options=cli.key_value_options(_DRAFTER_OPTION.value, "drafter_option"))


if __name__ == "__main__":
  cli.run(main)
