"""The engine-loop measurement (``benchmarks.engine_loop`` is its binary): the whole engine (scheduler, drafts, the fused device step,
commit) timed per step at any model shape, against the HBM roofline and the device's
own busy time.

Rows drafting L tokens use a zero-cost drafter (``ConstantDrafter``: L copies of the
pending token; ``--drafter=constant`` drafts inside the fused device step, so SD
iterations run asynchronously like AR ones; ``constant_host`` drafts on the host, one
synchronous step each) with synthetic acceptance 1.0
(``EngineConfig.synthetic_acceptance``), so every step verifies and commits L + 1 tokens
and c(L) = (SD step time) / (AR step time) at the same batch and context is the engine's
verification cost alone. ``--drafter=draft_model`` drafts with a random-weight draft
model of the ``--draft`` shape (a real device drafter: its forwards are in the step and
in ``device_ms``). ``--steps_per_dispatch=N`` runs N iterations per device call. Prompts
are ``context`` random token ids; every request generates ``new_tokens * (L + 1)``
tokens, so every L runs the same number of engine steps (``new_tokens``; with few
steps the first one after the prefill, which no earlier step overlaps, would weigh
more at larger L).

Per (batch, context, L): ``step_ms`` = mean wall time of the steady (non-compiling)
engine steps of a measured run after a warm-up run; ``roofline_ms`` = (weight bytes +
mean KV bytes read per step) / the device's read bandwidth measured in the same process
(XLA sum over 2 GiB); ``device_ms`` (``--profile``) = device busy time per step from a
``jax.profiler`` trace of a third run over the same steps (``harness.device_time``).

  python -m benchmarks.engine_loop --target=llama3-8b --dtype=bfloat16 \
      --batch_sizes=1,16,64 --contexts=512,4096 --lengths=0,1,2,4,8 --output_dir=$OUT

``--mesh=none --mesh=data:1,model:1`` runs the same grid unsharded and on each mesh
(``specjax.sharding``: weights drawn on their shards, tensor-parallel attention under
``shard_map``, KV pool split by heads; a data axis > 1 is not timed here). Rows record
``mesh`` and ``replicated``. ``--num_layers=16,32`` builds the target with that many
layers (a 70B shape on one GPU) and adds ``*_scaled`` columns for the full
``full_num_layers``: a straight-line fit of step time against the layer count (one
count: proportional scaling), marked by ``scaled`` ("linear" / "proportional").
"""

from __future__ import annotations

import cProfile
import dataclasses
import json
import os
import pstats
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import pandas as pd

from harness.device_time import device_busy_seconds, ops_table, top_host_events, top_ops
from harness.roofline import step_read_bytes
from harness.synthetic import ConstantDrafter
from harness.traces import parse_replay, read_jsonl, replay_requests
from models.layers import small_f32_matmul, two_row_decode
from models.shapes import SHAPES
from pallas_kernels.small_matmul import implementations_used as small_matmul_backends
from specjax import sharding
from specjax.config import EngineConfig, SamplingParams
from specjax.engine import Engine
from specjax.request import Request
from specjax.steps import split_model

__all__ = ["DRAFTERS", "build_target", "drafter_method", "read_bandwidth", "run_engine_loop"]


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


def build_target(name: str, dtype: str, num_layers: int | None = None, mesh=None):
  """``(cfg, model)``; random weights are drawn on their shards when ``mesh`` is set."""
  if name in SHAPES:  # random weights (models.shapes)
    from models.random_weights import random_transformer

    cfg = dataclasses.replace(SHAPES[name], dtype=dtype)
    if num_layers is not None:
      cfg = dataclasses.replace(cfg, num_layers=num_layers)
    place = None if mesh is None else sharding.param_sharding_fn(cfg, mesh)
    return cfg, random_transformer(cfg, 0, shardings=place)
  if num_layers is not None:
    raise ValueError(f"--num_layers needs a models.shapes target, not {name!r}")
  from models.zoo import load_model

  loaded = load_model(name, dtype)
  return loaded.config, loaded.model


def run_engine_loop(*, target: str, dtype: str, batch_sizes, contexts, lengths,
                    new_tokens: int, attention_implementation, profile: bool,
                    layer_execution: str = "unrolled", meshes=("none",), num_layers=None,
                    drafter: str = "constant", draft: str | None = None,
                    steps_per_dispatch: int = EngineConfig.steps_per_dispatch, top: int = 0,
                    ops_dir: str | None = None, acceptance: str = "synthetic",
                    replay_num_requests: int | None = None, drafter_options=None,
                    log=print) -> pd.DataFrame:
  """One row per (num_layers, mesh, batch, context, L); see the module docstring.
  ``target`` is a ``SHAPES`` name (random weights) or a ``models.zoo`` model (real
  weights); ``meshes`` holds "none" and/or ``specjax.sharding.parse_mesh`` strings;
  ``drafter`` is "constant" (fused), "constant_host", "draft_model" (with the
  ``draft`` shape, random weights) or "suffix" (suffix decoding's fused device drafter:
  the drafts it finds are accepted with the synthetic probabilities, so its tau is
  what it finds; its step time is the drafter's cost plus a k-wide verify), "ngram"
  (n-gram prompt lookup on the device, likewise: tau is what it finds) or "eagle3"
  (a random-weight EAGLE-3 head for the target, fused chain of L head steps; all its
  drafts are accepted); ``top`` > 0 logs the profiled run's ``top`` device
  ops per engine step (``harness.device_time.top_ops``, prefill included) and the
  ``top`` Python functions of one more run by own time per step (cProfile) and, with
  ``ops_dir``, writes every op unfolded to ``ops_dir/ops_b{batch}_ctx{context}_L{L}.csv``
  and the host tracks' events (``top_host_events``) to ``host_b{batch}_ctx{context}_L{L}.csv``.
  ``acceptance`` is "synthetic" (every draft accepted) or "replay:FILE[:METHOD]": the
  trace file's requests (``harness.traces.replay_requests``, the first
  ``replay_num_requests``; their prompt and output lengths replace ``contexts`` and
  ``new_tokens``) with the recorded acceptance replayed (``EngineConfig.acceptance_replay``).
  ``drafter_options`` (a dict) are passed to the drafter method's constructor (e.g.
  ``{"matmul_precision": "default"}`` for "eagle3"), checked as ``make_method`` checks
  method options.

  Raises:
    ValueError: an unknown ``drafter``, or "draft_model" without ``draft``, a bad
      ``acceptance``.
  """
  replay = None if acceptance == "synthetic" else parse_replay(acceptance)
  if drafter not in DRAFTERS:
    raise ValueError(f"drafter={drafter!r} must be one of {DRAFTERS}")
  if drafter == "draft_model" and not draft:
    raise ValueError("drafter='draft_model' needs draft= (a models.shapes name)")
  bw = read_bandwidth() if jax.default_backend() != "cpu" else float("nan")
  log(f"read bandwidth {bw / 1e9:.0f} GB/s on {jax.devices()[0].device_kind}")
  frames = []
  for layers in (num_layers or [None]):
    for mesh_text in meshes:
      mesh = None if mesh_text == "none" else sharding.make_mesh(mesh_text)
      if mesh is not None and mesh.shape["data"] != 1:
        raise ValueError(f"mesh={mesh_text!r}: the engine loop times one replica (data:1)")
      cfg, model = build_target(target, dtype, layers, mesh)
      split = split_model(model, unroll_layers=layer_execution == "unrolled")
      del model  # the stacked copy (unrolled layers are their own arrays)
      if mesh is not None:
        split = sharding.shard_model(split, mesh)
      draft_split = None
      if drafter == "draft_model":
        _, draft_model = build_target(draft, dtype, None, mesh)
        draft_split = split_model(draft_model, unroll_layers=layer_execution == "unrolled")
        del draft_model
      df = _grid(cfg, split, mesh, bw, target=target, dtype=dtype, batch_sizes=batch_sizes,
                 contexts=contexts, lengths=lengths, new_tokens=new_tokens,
                 attention_implementation=attention_implementation, profile=profile,
                 layer_execution=layer_execution, drafter=drafter, draft_split=draft_split,
                 steps_per_dispatch=steps_per_dispatch, top=top, ops_dir=ops_dir,
                 log=log, replay=replay, replay_num_requests=replay_num_requests,
                 drafter_options=drafter_options)
      df.insert(3, "drafter", drafter if draft_split is None else f"draft_model:{draft}")
      df.insert(4, "drafter_options", json.dumps(drafter_options or {}, sort_keys=True))
      df.insert(2, "num_layers", cfg.num_layers)
      frames.append(df)
      del split
  df = pd.concat(frames, ignore_index=True)
  if num_layers:
    df = _scale_layers(df, SHAPES[target].num_layers)
  return df


def _scale_layers(df: pd.DataFrame, full: int) -> pd.DataFrame:
  """Adds ``step_ms_scaled`` etc. for ``full`` layers (marked ``scaled``)."""
  keys = ["mesh", "batch", "context", "L"]
  out = []
  for _, g in df.groupby(keys, sort=False):
    g = g.copy()
    n = g.num_layers.to_numpy(float)
    if len(set(n)) > 1:
      slope, icept = np.polyfit(n, g.step_ms.to_numpy(float), 1)
      rslope, ricept = np.polyfit(n, g.roofline_ms.to_numpy(float), 1)
      g["step_ms_scaled"], g["roofline_ms_scaled"] = icept + slope * full, ricept + rslope * full
      g["per_layer_ms"], g["scaled"] = slope, "linear"
    else:
      g["step_ms_scaled"] = g.step_ms * full / n
      g["roofline_ms_scaled"] = g.roofline_ms * full / n
      g["per_layer_ms"], g["scaled"] = g.step_ms / n, "proportional"
    out.append(g)
  df = pd.concat(out).sort_index()
  df["full_num_layers"] = full
  df["roofline_fraction_scaled"] = df.roofline_ms_scaled / df.step_ms_scaled
  ar = df.step_ms_scaled.where(df.L == 0)
  df["c_scaled"] = df.step_ms_scaled / ar.groupby(
      [df.num_layers, df["mesh"], df.batch, df.context]).transform("max")
  return df


def drafter_method(drafter: str, length: int, cfg=None, options=None):
  """The method of a ``DRAFTERS`` row drafting ``length`` tokens (0: AR); ``cfg`` is the
  target's config (the EAGLE-3 head's feature layers), ``options`` the drafter's
  constructor options (checked as ``make_method`` checks them).

  Raises:
    ValueError: options the drafter does not take.
  """
  options = dict(options or {})
  if not length:
    from methods.ar import AutoRegressive  # noqa: PLC0415

    return AutoRegressive()
  if drafter == "draft_model":
    from methods.draft_model import DraftModel  # noqa: PLC0415

    return _checked(DraftModel, options, k=length)
  if drafter == "suffix":  # suffix decoding's device drafter (fused): its cost in the step
    from methods.suffix import SuffixDecoding  # noqa: PLC0415

    return _checked(SuffixDecoding, options, k=length, device=True)
  if drafter == "ngram":  # n-gram prompt lookup on the device (fused): its cost in the step
    from methods.ngram import NGram  # noqa: PLC0415

    return _checked(NGram, options, k=length)
  if drafter == "eagle3":  # a random EAGLE-3 head's fused chain: L head steps in the step
    from methods.eagle3 import Eagle3  # noqa: PLC0415
    from models.heads import default_eagle3_layers  # noqa: PLC0415

    return _checked(Eagle3, options, k=length,
                    feature_layers=default_eagle3_layers(cfg.num_layers))
  if options:
    raise ValueError(f"drafter={drafter!r} takes no drafter options; got {options}")
  return ConstantDrafter(k=length, device=drafter == "constant")


def _checked(cls, options: dict, **fixed):
  """``cls(**fixed, **options)`` with the options checked against its fields."""
  from methods.registry import check_option_types  # noqa: PLC0415

  check_option_types(cls, options)
  return cls(**fixed, **options)


def _replay_workload(cfg, replay, num_requests):
  """``(requests, mean prompt length, label)`` of ``--acceptance=replay:FILE[:METHOD]``."""
  path, method = replay
  reqs = replay_requests(read_jsonl(path), method, vocab_size=cfg.vocab_size,
                         num_requests=num_requests)
  label = f"replay:{os.path.basename(path)}" + (f":{method}" if method else "")
  return reqs, int(round(np.mean([len(r.prompt_token_ids) for r in reqs]))), label


def _grid(cfg, split, mesh, bw, *, target, dtype, batch_sizes, contexts, lengths, new_tokens,
          attention_implementation, profile, layer_execution, drafter, draft_split,
          steps_per_dispatch, top, ops_dir, log, replay=None,
          replay_num_requests=None, drafter_options=None) -> pd.DataFrame:
  """The (batch, context, L) rows of one placed model (``replay``: ``(FILE, METHOD)``,
  one workload of the trace's requests instead of the contexts)."""
  placement = sharding.describe(mesh, cfg=cfg)
  rng = np.random.default_rng(0)
  rows = []
  for batch in batch_sizes:
    for context in (contexts if replay is None else [None]):
      if replay is None:
        prompts = [tuple(int(t) for t in rng.integers(0, cfg.vocab_size, context))
                   for _ in range(batch)]
        acceptance = "synthetic:1.0"
      else:
        base, context, acceptance = _replay_workload(cfg, replay, replay_num_requests)
      ar_ms = None
      for length in lengths:
        if replay is None:
          sp = SamplingParams(max_tokens=new_tokens * (length + 1), ignore_eos=True)
          reqs = [Request(i, p, sp) for i, p in enumerate(prompts)]
          longest = context + new_tokens * (max(lengths) + 1)
        else:  # AR runs the same requests without the trace
          reqs = base if length else [dataclasses.replace(r, replay_acc_len=None) for r in base]
          longest = max(len(r.prompt_token_ids) + r.sampling.max_tokens for r in base)
        ecfg = EngineConfig(
            max_num_seqs=batch, max_model_len=longest + max(lengths) + 16,
            attention_implementation=attention_implementation,
            max_num_batched_tokens=max(512, min(8192, batch * context)),
            synthetic_acceptance=(1.0,) if length and replay is None else None,
            acceptance_replay=bool(length) and replay is not None, mesh=mesh,
            steps_per_dispatch=steps_per_dispatch)
        method = drafter_method(drafter, length, cfg, drafter_options)
        engine = Engine(split, method, ecfg, draft=draft_split if length else None)
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
            if top:
              reps = max(1, len(pmet.steps))
              for name, ms, calls in top_ops(d, reps)[:top]:
                log(f"  L={length} op {name}: {ms:.4f} ms/step, {calls} calls/step")
            if top and ops_dir:
              os.makedirs(ops_dir, exist_ok=True)
              pd.DataFrame(ops_table(d, reps)).to_csv(
                  os.path.join(ops_dir, f"ops_b{batch}_ctx{context}_L{length}.csv"), index=False)
              host = top_host_events(d, reps)
              for name, ms, calls in host[:top]:
                log(f"  L={length} host {name}: {ms:.4f} ms/step, {calls} calls/step")
              pd.DataFrame(host, columns=["event", "ms_per_step", "calls_per_step"]).to_csv(
                  os.path.join(ops_dir, f"host_b{batch}_ctx{context}_L{length}.csv"),
                  index=False)
          device_ms = 1e3 * (busy - pmet.prefill_s) / max(1, len(pmet.steps))
        if top:
          _log_python_profile(engine, reqs, length, top, log)
        mean_ctx = context + (new_tokens * (length + 1) if replay is None else
                              np.mean([r.sampling.max_tokens for r in reqs])) / 2
        roof_ms = 1e3 * step_read_bytes(cfg, batch, int(mean_ctx)) / bw
        if length == 0:
          ar_ms = step_ms
        tau = (sum(s.num_emitted for s in steady) / sum(s.num_rows for s in steady)
               if steady else float("nan"))
        rows.append(dict(
            target=target, dtype=dtype, batch=batch, context=context, L=length,
            acceptance=acceptance, num_requests=len(reqs),
            steps=len(steady), step_ms=step_ms, device_ms=device_ms,
            step_over_device=step_ms / device_ms, roofline_ms=roof_ms,
            roofline_fraction=roof_ms / step_ms, c=step_ms / ar_ms if ar_ms else float("nan"),
            tau=tau, tokens_per_s=1e3 * tau * batch / step_ms,
            prefill_s=met.prefill_s, num_compiles=met.num_compiles,
            device=jax.devices()[0].device_kind, backend=jax.default_backend(),
            attention_implementation=str(attention_implementation),
            layer_execution=layer_execution, steps_per_dispatch=steps_per_dispatch,
            two_row_decode=two_row_decode(), small_f32_matmul=small_f32_matmul()[0],
            small_f32_max_rows=small_f32_matmul()[1],
            small_matmul_backends=",".join(small_matmul_backends()),
            runs_on=method.capabilities().runs_on, jax_version=jax.__version__, **placement))
        log(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                     for k, v in rows[-1].items() if k in (
                         "mesh", "batch", "context", "L", "step_ms", "device_ms",
                         "roofline_fraction",
                         "c", "tokens_per_s", "step_over_device")))
  return pd.DataFrame(rows)


def _log_python_profile(engine, reqs, length: int, top: int, log) -> None:
  """Logs the ``top`` Python functions by own time (cProfile) per engine step of one
  more run: where the host's share of a step goes (the jitted call's dispatch counts in
  its caller's own time)."""
  prof = cProfile.Profile()
  prof.enable()
  _, met = engine.generate(reqs)
  prof.disable()
  per = max(1, len(met.steps))
  stats = sorted(pstats.Stats(prof).stats.items(), key=lambda kv: -kv[1][2])
  for (file, line, fn), (_, calls, own, cum, _) in stats[:top]:
    log(f"  L={length} python {os.path.basename(file)}:{line}({fn}): {1e3 * own / per:.4f} "
        f"ms/step own, {1e3 * cum / per:.4f} cumulative, {calls / per:.2f} calls/step")


DRAFTERS = ("constant", "constant_host", "draft_model", "suffix", "ngram", "eagle3")
