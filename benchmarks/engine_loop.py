"""Engine-loop benchmark: the whole engine (scheduler, drafts, the fused device step,
commit) timed per step at any model shape, against the HBM roofline and the device's
own busy time.

Rows drafting L tokens use a zero-cost host drafter (``ConstantDrafter``: L copies of
the pending token) with synthetic acceptance 1.0 (``EngineConfig.synthetic_acceptance``),
so every step verifies and commits L + 1 tokens and c(L) = (SD step time) / (AR step
time) at the same batch and context is the engine's verification cost alone. Prompts
are ``context`` random token ids; every request generates ``new_tokens`` tokens.

Per (batch, context, L): ``step_ms`` = mean wall time of the steady (non-compiling)
engine steps of a measured run after a warm-up run; ``roofline_ms`` = (weight bytes +
mean KV bytes read per step) / the device's read bandwidth measured in the same process
(XLA sum over 2 GiB); ``device_ms`` (``--profile``) = device busy time per step from a
``jax.profiler`` trace of a third run over the same steps (``benchmarks.device_time``).

  python -m benchmarks.engine_loop --target=llama3-8b --dtype=bfloat16 \
      --batch_sizes=1,16,64 --contexts=512,4096 --lengths=0,1,2,4,8 --output_dir=$OUT
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import pandas as pd
from absl import app, flags

from benchmarks.device_time import device_busy_seconds
from benchmarks.step_cost import _kv_bytes, _param_bytes
from harness import plots
from models.shapes import SHAPES
from specjax.config import EngineConfig, SamplingParams
from specjax.engine import Engine
from specjax.method import Capabilities, Draft, Method
from specjax.request import Request
from specjax.steps import split_model

__all__ = ["ConstantDrafter", "read_bandwidth", "run_engine_loop"]

@dataclasses.dataclass(frozen=True, kw_only=True)
class ConstantDrafter(Method):
  """Drafts ``k`` copies of each row's pending token on the host (no compute): with
  synthetic acceptance it makes every step a full-width verify step."""

  name = "constant"
  k: int = 1

  @property
  def num_speculative_tokens(self) -> int:
    return self.k

  def capabilities(self) -> Capabilities:
    return Capabilities(runs_on="host")

  def propose(self, state, context):
    rows = len(context.request_ids)
    tokens = np.full((rows, self.k), -1, np.int32)
    for i, seq in enumerate(context.token_ids):
      tokens[i] = seq[-1]
    return state, Draft(tokens, np.minimum(context.budgets, self.k).astype(np.int32))


def read_bandwidth(num_bytes: int = 2 << 30, reps: int = 10) -> float:
  """Bytes/s the device reads in an XLA sum over ``num_bytes`` of bf16."""
  x = jnp.ones((num_bytes // 2,), jnp.bfloat16)
  f = jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32))
  f(x).block_until_ready()
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    f(x).block_until_ready()
    times.append(time.perf_counter() - t)
  return num_bytes / float(np.median(times))


def _target(name: str, dtype: str):
  if name in SHAPES:  # random weights (models.shapes)
    from models.random_weights import random_transformer

    cfg = dataclasses.replace(SHAPES[name], dtype=dtype)
    return cfg, random_transformer(cfg, 0)
  from models.zoo import load_model

  loaded = load_model(name, dtype)
  return loaded.config, loaded.model


def run_engine_loop(*, target: str, dtype: str, batch_sizes, contexts, lengths,
                    new_tokens: int, attention_implementation, profile: bool,
                    layer_execution: str = "unrolled", log=print) -> pd.DataFrame:
  """One row per (batch, context, L); see the module docstring. ``target`` is a
  ``SHAPES`` name (random weights) or a ``models.zoo`` model (real weights)."""
  cfg, model = _target(target, dtype)
  split = split_model(model, unroll_layers=layer_execution == "unrolled")
  bw = read_bandwidth() if jax.default_backend() != "cpu" else float("nan")
  log(f"read bandwidth {bw / 1e9:.0f} GB/s on {jax.devices()[0].device_kind}")
  rng = np.random.default_rng(0)
  rows = []
  for batch in batch_sizes:
    for context in contexts:
      prompts = [tuple(int(t) for t in rng.integers(0, cfg.vocab_size, context))
                 for _ in range(batch)]
      ar_ms = None
      for length in lengths:
        ecfg = EngineConfig(
            max_num_seqs=batch, max_model_len=context + new_tokens + max(lengths) + 16,
            attention_implementation=attention_implementation,
            max_num_batched_tokens=max(512, min(8192, batch * context)),
            synthetic_acceptance=(1.0,) if length else None)
        method = ConstantDrafter(k=length) if length else _ar()
        engine = Engine(split, method, ecfg)
        sp = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
        reqs = [Request(i, p, sp) for i, p in enumerate(prompts)]
        engine.generate(reqs)  # warm-up: compiles
        _, met = engine.generate(reqs)
        steady = met.steady_steps()
        step_ms = 1e3 * float(np.mean([s.step_s for s in steady]))
        device_ms = float("nan")
        if profile:
          with tempfile.TemporaryDirectory() as d:
            with jax.profiler.trace(d):
              _, pmet = engine.generate(reqs)
            busy = device_busy_seconds(d)
          device_ms = 1e3 * (busy - pmet.prefill_s) / max(1, len(pmet.steps))
        mean_ctx = context + new_tokens / 2
        roof_ms = 1e3 * (_param_bytes(cfg, batch) + _kv_bytes(cfg, batch, int(mean_ctx))) / bw
        if length == 0:
          ar_ms = step_ms
        tau = float(np.mean([s.num_emitted / s.num_rows for s in steady]))
        rows.append(dict(
            target=target, dtype=dtype, batch=batch, context=context, L=length,
            steps=len(steady), step_ms=step_ms, device_ms=device_ms,
            step_over_device=step_ms / device_ms, roofline_ms=roof_ms,
            roofline_fraction=roof_ms / step_ms, c=step_ms / ar_ms if ar_ms else float("nan"),
            tau=tau, tokens_per_s=1e3 * tau * batch / step_ms,
            prefill_s=met.prefill_s, num_compiles=met.num_compiles,
            device=jax.devices()[0].device_kind, backend=jax.default_backend(),
            attention_implementation=str(attention_implementation),
            layer_execution=layer_execution, jax_version=jax.__version__))
        log(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                     for k, v in rows[-1].items() if k in (
                         "batch", "context", "L", "step_ms", "device_ms", "roofline_fraction",
                         "c", "tokens_per_s", "step_over_device")))
  return pd.DataFrame(rows)


def _ar():
  from methods.ar import AutoRegressive

  return AutoRegressive()


_TARGET = flags.DEFINE_string("target", "llama3-8b", f"{list(SHAPES)} or a models.zoo name.")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Model dtype.")
_BATCH = flags.DEFINE_list("batch_sizes", ["1", "16", "64"], "Batch sizes.")
_CTX = flags.DEFINE_list("contexts", ["512", "4096"], "Prompt lengths (tokens).")
_L = flags.DEFINE_list("lengths", ["0", "1", "2", "4", "8"], "Draft lengths (0 = AR).")
_NEW = flags.DEFINE_integer("new_tokens", 64, "Tokens generated per request.")
_IMPL = flags.DEFINE_list("attention_implementation", ["reference"], "Paged attention impl(s).")
_LAYERS = flags.DEFINE_enum("layer_execution", "unrolled", ["unrolled", "scan"], "Layers.")
_PROFILE = flags.DEFINE_boolean("profile", True, "Also measure device busy time per step.")
_OUT = flags.DEFINE_string("output_dir", "results/engine_loop", "Where CSV and plot go.")


def main(argv):
  del argv
  impl = tuple(_IMPL.value)
  df = run_engine_loop(
      target=_TARGET.value, dtype=_DTYPE.value, batch_sizes=[int(b) for b in _BATCH.value],
      contexts=[int(c) for c in _CTX.value], lengths=[int(v) for v in _L.value],
      new_tokens=_NEW.value, attention_implementation=impl[0] if len(impl) == 1 else impl,
      profile=_PROFILE.value, layer_execution=_LAYERS.value)
  os.makedirs(_OUT.value, exist_ok=True)
  df.to_csv(os.path.join(_OUT.value, "engine_loop.csv"), index=False)
  plots.engine_loop_figure(df, os.path.join(_OUT.value, "engine_loop.png"))
  print(df.to_string(index=False, float_format=lambda x: f"{x:.3f}"))


if __name__ == "__main__":
  app.run(main)
