"""verify_skip against fixed draft lengths, whole engine loop, synthetic acceptance.

Per batch size: fixed-length runs (``harness.synthetic.ConstantDrafter`` with k = L for each
``--lengths`` L, synthetic per-position acceptance ``--acceptance``) give step times
and tokens/s; their step times become the ``TableVerifyCost`` that ``verify_skip``
(wrapping the fused ``ConstantDrafter(k=max L)``) then uses in its own runs, one per
``--paths`` entry: "fused" (its asynchronous fused path) and "host" (``host_path=True``:
the synchronous host path over the same drafter's host ``propose``); ``runs_on`` records
which ran. Each configuration
runs once untimed (compiles) and once measured. Random weights of a ``models.shapes``
shape (default the Llama-3.1-8B shape, bf16); ``new_tokens`` per request, prompts of
``context`` random tokens. ``tokens_per_s`` = tokens / time of the measured run's
steady (non-compiling) steps. Writes ``verify_skip_bench.csv`` under ``--output_dir``.

  python -m benchmarks.verify_skip_bench --output_dir=$OUT
"""

from __future__ import annotations

import dataclasses
import os
import time

import jax
import numpy as np
import pandas as pd
from absl import flags

from harness import cli
from harness.synthetic import ConstantDrafter
from methods.verify_skip import VerifySkip
from models.random_weights import random_transformer
from models.shapes import SHAPES
from specjax.compile_cache import enable_compilation_cache
from specjax.config import EngineConfig, SamplingParams
from specjax.cost_model import TableVerifyCost
from specjax.engine import Engine
from specjax.request import Request
from specjax.steps import split_model

__all__ = ["run"]


def _measure(split, method, ecfg, requests):
  engine = Engine(split, method, ecfg)
  engine.generate(requests)  # untimed: compiles
  states = []
  real = type(method).init_state

  def init_state(self, runtime):
    states.append(real(self, runtime))
    return states[-1]

  type(method).init_state = init_state
  try:
    t0 = time.perf_counter()
    outputs, met = engine.generate(requests)
    wall = time.perf_counter() - t0
  finally:
    type(method).init_state = real
  steady = met.steady_steps()
  emitted = sum(len(o.output_token_ids) for o in outputs)
  return dict(
      runs_on=method.capabilities().runs_on,
      step_ms=1e3 * float(np.mean([s.step_s for s in steady])),
      host_ms=1e3 * float(np.mean([s.host_s for s in steady])),
      tau=float(np.mean([s.num_emitted / s.num_rows for s in steady])),
      mean_L=float(np.mean([s.query_bucket - 1 for s in steady])),
      tokens_per_s=sum(s.num_emitted for s in steady) / sum(s.step_s for s in steady),
      wall_tokens_per_s=emitted / wall,
      num_compiles=met.num_compiles, steps=len(steady)), states[-1] if states else None


def run(*, shape: str, dtype: str, batch_sizes, lengths, acceptance, context: int,
        new_tokens: int, layer_execution: str, paths=("fused",), log=print) -> pd.DataFrame:
  """One row per (batch, method); see the module docstring."""
  cfg = dataclasses.replace(SHAPES[shape], dtype=dtype)
  split = split_model(random_transformer(cfg, 0), unroll_layers=layer_execution == "unrolled")
  rng = np.random.default_rng(0)
  rows = []
  for batch in batch_sizes:
    prompts = [tuple(int(t) for t in rng.integers(0, cfg.vocab_size, context))
               for _ in range(batch)]
    sp = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    requests = [Request(i, p, sp) for i, p in enumerate(prompts)]
    ecfg = EngineConfig(max_num_seqs=batch, max_model_len=context + new_tokens + max(lengths) + 16,
                        max_num_batched_tokens=max(512, min(8192, batch * context)),
                        synthetic_acceptance=tuple(acceptance))
    step_s = {}
    for length in lengths:
      res, _ = _measure(split, ConstantDrafter(k=length), ecfg, requests)
      step_s[length] = res["step_ms"] / 1e3
      rows.append(dict(batch=batch, method=f"fixed_k{length}", **res))
      log(rows[-1])
    # This batch's measured step times are T(B, L) of the verify_skip run; T(B, 0) is
    # extrapolated linearly from the two shortest lengths (no AR run: no extra compile).
    ls = sorted(step_s)
    t0 = step_s[ls[0]] if len(ls) == 1 else max(
        0.0, step_s[ls[0]] - (step_s[ls[1]] - step_s[ls[0]]) * ls[0] / (ls[1] - ls[0]))
    table = TableVerifyCost(batches=(batch,), lengths=tuple([0, *ls]),
                            seconds=((t0, *[step_s[v] for v in ls]),))
    for path in paths:
      method = VerifySkip(k=max(lengths), drafter=ConstantDrafter(k=max(lengths)),
                          cost_model=table, host_path=path == "host")
      res, state = _measure(split, method, ecfg, requests)
      caps = state.counters["caps"] if state is not None else []
      rows.append(dict(batch=batch, method="verify_skip" + ("_host" if path == "host" else ""),
                       **res, caps=" ".join(map(str, sorted(set(caps))))))
      log(rows[-1])
  df = pd.DataFrame(rows)
  df["shape"], df["dtype"], df["device"] = shape, dtype, jax.devices()[0].device_kind
  df["acceptance"] = ",".join(map(str, acceptance))
  return df


_BATCH = flags.DEFINE_list("batch_sizes", ["1", "16", "64", "128"], "Batch sizes.")
_L = flags.DEFINE_list("lengths", ["1", "2", "4"], "Fixed draft lengths k to compare (>= 1).")
_NEW = flags.DEFINE_integer("new_tokens", 48, "Engine steps per request.", lower_bound=1)
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Model dtype.")
_LAYERS = flags.DEFINE_enum("layer_execution", "scan", ["unrolled", "scan"], "Layers.")
_OUT = flags.DEFINE_string("output_dir", "results/verify_skip_bench", "Where the CSV goes.")
_SHAPE = flags.DEFINE_string("shape", "llama3-8b", f"One of {list(SHAPES)} (random weights).")
_ACC = flags.DEFINE_list("acceptance", ["0.9", "0.75", "0.6", "0.45"],
                         "Synthetic per-position acceptance probabilities.")
_CTX = flags.DEFINE_integer("context", 128, "Prompt length (tokens).")
_PATHS = flags.DEFINE_multi_enum("paths", ["fused"], ["fused", "host"],
                                 "verify_skip runs: its fused path, and/or its host path.")


def main(argv):
  del argv
  enable_compilation_cache()
  lengths = [int(v) for v in _L.value]
  if min(lengths) < 1:
    raise ValueError(f"lengths={lengths} must all be >= 1")
  df = run(shape=_SHAPE.value, dtype=_DTYPE.value, batch_sizes=[int(b) for b in _BATCH.value],
           lengths=lengths, acceptance=[float(a) for a in _ACC.value], context=_CTX.value,
           new_tokens=_NEW.value, layer_execution=_LAYERS.value, paths=_PATHS.value)
  os.makedirs(_OUT.value, exist_ok=True)
  df.to_csv(os.path.join(_OUT.value, "verify_skip_bench.csv"), index=False)
  print(df.to_string(index=False, float_format=lambda x: f"{x:.3f}"))


if __name__ == "__main__":
  cli.run(main)
