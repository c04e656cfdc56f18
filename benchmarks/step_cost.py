"""Step-cost benchmark: AR decode and chain-verify step times against the HBM roofline.

For a model shape with random weights (the step cost does not depend on weight
values), times the jitted target step (``specjax.steps.forward_step``) for AR decode
(T = 1) and verification (T = L + 1) over a paged KV cache filled to a given context,
and reports:
  * ``ar_ms``: median AR step time; ``roofline_ms`` = (weight bytes + KV bytes read) /
    measured device copy bandwidth; ``roofline_fraction`` = roofline_ms / ar_ms.
  * ``c`` = verify step time / AR step time at the same batch and context (c(L)).
Each point is timed two ways: ``step_ms`` waits for every step and feeds host (numpy)
inputs, as the synchronous engine loop does; ``pipelined_ms`` dispatches ``reps`` steps
back to back from device-resident inputs and waits once (the host prepares step i+1
while step i runs, as engines with asynchronous scheduling do), so host-side launch cost
is hidden wherever it is shorter than the device time. ``pipelined_roofline_fraction``
and ``pipelined_c`` are the same ratios from the pipelined times.
Also times the HF ``transformers`` peer (static cache, greedy ``generate``) when torch
and CUDA are present. Every ratio comes from one process run.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import pandas as pd

from harness.roofline import step_read_bytes
from models.config import ModelConfig
from models.shapes import SHAPES
from pallas_kernels.paged_attention.metadata import AttentionMetadata

__all__ = ["StepBenchConfig", "run_step_benchmark", "copy_bandwidth"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepBenchConfig:
  """What to time. ``contexts`` in tokens; ``verify_lengths`` are draft lengths L;
  ``model`` a shape (default ``models.shapes.SHAPES["llama3-8b"]``, bf16)."""

  model: ModelConfig = SHAPES["llama3-8b"]
  batch_sizes: tuple[int, ...] = (1, 4, 16, 64)
  contexts: tuple[int, ...] = (512, 2048, 8192)
  verify_lengths: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8)
  verify_context: int = 512
  page_size: int = 16
  attention_implementation: str = "reference"
  reps: int = 20
  hf_peer: bool = True
  hf_batch_sizes: tuple[int, ...] = (1, 16)
  seed: int = 0


def copy_bandwidth(num_bytes: int = 4 << 30, reps: int = 10) -> float:
  """Device copy bandwidth in bytes/s, counting bytes read and written."""
  x = jnp.ones((num_bytes // 4,), jnp.float32)
  copy = jax.jit(lambda a: a + 1.0)
  copy(x).block_until_ready()
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    copy(x).block_until_ready()
    times.append(time.perf_counter() - t)
  return 2 * num_bytes / float(np.median(times))


class _Runner:
  """Holds the random model and a paged cache large enough for the biggest case."""

  def __init__(self, cfg: StepBenchConfig, unroll_layers: bool = True):
    from models.llama import init_kv_caches
    from models.random_weights import random_transformer
    from specjax.steps import split_model

    self.cfg = cfg
    m = cfg.model
    self.model = split_model(random_transformer(m, cfg.seed), unroll_layers=unroll_layers)
    max_tokens = max(max(cfg.contexts), cfg.verify_context) + max(cfg.verify_lengths, default=0) + 1
    self.pages_per_seq = -(-max_tokens // cfg.page_size)
    self.num_pages = max(cfg.batch_sizes) * self.pages_per_seq
    self.kv = init_kv_caches(m, self.num_pages, cfg.page_size)
    rng = np.random.default_rng(cfg.seed)
    self.perm = rng.permutation(self.num_pages).astype(np.int32)

  def inputs(self, batch: int, context: int, num_query: int):
    """Host (numpy) step inputs, as the engine builds them: ``(tokens, meta, idx)``."""
    cfg = self.cfg
    total = context + num_query
    width = -(-total // cfg.page_size)
    table = self.perm[: batch * self.pages_per_seq].reshape(batch, self.pages_per_seq)[:, :width]
    meta = AttentionMetadata(np.ascontiguousarray(table), np.full((batch,), total, np.int32),
                             np.full((batch,), num_query, np.int32))
    tokens = np.ones((batch, num_query), np.int32)
    idx = np.broadcast_to(np.arange(num_query, dtype=np.int32), (batch, num_query)).copy()
    return tokens, meta, idx

  def dispatch(self, inputs):
    """Enqueues one step on ``(tokens, meta, idx)`` and returns its logits, not waited for."""
    from specjax.steps import forward_step

    m = self.model
    self.kv, logits, _ = forward_step(m.graphdef, m.params, self.kv, *inputs,
                                      implementation=self.cfg.attention_implementation)
    return logits

  def step(self, batch: int, context: int, num_query: int, inputs=None) -> None:
    """One step with ``num_query`` tokens per row at ``context``, waited for."""
    self.dispatch(inputs or self.inputs(batch, context, num_query)).block_until_ready()

  def time_step_pipelined(self, batch: int, context: int, num_query: int) -> float:
    """Mean seconds per step over ``reps`` steps dispatched without waiting in between.

    The inputs live on the device; consecutive steps are ordered on it through the
    (donated) KV cache they pass along, and only the last step's logits are waited for.
    """
    inputs = jax.device_put(self.inputs(batch, context, num_query))
    for _ in range(3):
      logits = self.dispatch(inputs)
    logits.block_until_ready()
    t = time.perf_counter()
    for _ in range(self.cfg.reps):
      logits = self.dispatch(inputs)
    logits.block_until_ready()
    return (time.perf_counter() - t) / self.cfg.reps

  def time_step(self, batch: int, context: int, num_query: int) -> float:
    """Median seconds of one step with ``num_query`` tokens per row at ``context``."""
    times = []
    inputs = self.inputs(batch, context, num_query)
    for i in range(self.cfg.reps + 3):
      t = time.perf_counter()
      self.step(batch, context, num_query, inputs)
      if i >= 3:
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def _hf_step_seconds(cfg: ModelConfig, batch: int, context: int) -> float:
  """Per-token time of HF transformers greedy generate with a static cache (CUDA)."""
  import torch
  import transformers

  hf_cfg = transformers.LlamaConfig(
      vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
      intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
      num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
      head_dim=cfg.head_dim, tie_word_embeddings=False, max_position_embeddings=16384,
  )
  with torch.device("cuda"):
    model = transformers.LlamaForCausalLM(hf_cfg).to(torch.bfloat16).eval()
  ids = torch.randint(0, cfg.vocab_size, (batch, context), device="cuda")

  def gen(n):
    torch.cuda.synchronize()
    t = time.perf_counter()
    with torch.no_grad():
      model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                     cache_implementation="static", pad_token_id=0)
    torch.cuda.synchronize()
    return time.perf_counter() - t

  for n in (8, 40):  # warm-up: static-cache generate compiles/captures per length
    gen(n)
  short = min(gen(8) for _ in range(2))
  long = min(gen(40) for _ in range(2))
  return (long - short) / 32


def run_step_benchmark(cfg: StepBenchConfig, log=print) -> pd.DataFrame:
  """Runs the grid; returns one row per (kind, batch, context, L).

  The HF peer runs first, before JAX touches the GPU, so JAX's memory pool does not
  starve PyTorch; both are timed in the same process.
  """
  m = cfg.model
  hf = {}
  if cfg.hf_peer:
    for batch in cfg.hf_batch_sizes:
      try:
        hf[batch] = _hf_step_seconds(m, batch, cfg.verify_context)
        log(f"hf  B={batch:3d} ctx={cfg.verify_context}: {1e3 * hf[batch]:8.3f} ms/step")
      except (RuntimeError, AssertionError) as e:
        log(f"hf peer failed at batch {batch}: {e!r}")
    import gc

    import torch

    gc.collect()
    torch.cuda.empty_cache()
  bw = copy_bandwidth()
  log(f"copy bandwidth: {bw / 1e12:.2f} TB/s")
  runner = _Runner(cfg)
  device = jax.devices()[0].device_kind
  base = dict(device=device, backend=jax.default_backend(), jax_version=jax.__version__,
              attention_implementation=cfg.attention_implementation, dtype=m.dtype,
              copy_bw_tb_s=bw / 1e12)
  rows = []
  ar = {}
  for batch in cfg.batch_sizes:
    for context in sorted(set(cfg.contexts) | {cfg.verify_context}):
      t = runner.time_step(batch, context, 1)
      tp = runner.time_step_pipelined(batch, context, 1)
      ar[batch, context] = t, tp
      floor = step_read_bytes(m, batch, context) / bw
      rows.append(dict(base, kind="ar", batch=batch, context=context, L=0, step_ms=1e3 * t,
                       pipelined_ms=1e3 * tp, roofline_ms=1e3 * floor,
                       roofline_fraction=floor / t, pipelined_roofline_fraction=floor / tp,
                       c=1.0, pipelined_c=1.0))
      log(f"ar  B={batch:3d} ctx={context:5d}: {1e3 * t:8.3f} ms (pipelined {1e3 * tp:8.3f} ms)"
          f"  roofline {1e3 * floor:.3f} ms ({100 * floor / t:.1f} % / {100 * floor / tp:.1f} %)")
    for length in cfg.verify_lengths:
      t = runner.time_step(batch, cfg.verify_context, length + 1)
      tp = runner.time_step_pipelined(batch, cfg.verify_context, length + 1)
      ar_t, ar_tp = ar[batch, cfg.verify_context]
      rows.append(dict(base, kind="verify", batch=batch, context=cfg.verify_context, L=length,
                       step_ms=1e3 * t, pipelined_ms=1e3 * tp, c=t / ar_t,
                       pipelined_c=tp / ar_tp))
      log(f"verify B={batch:3d} L={length}: {1e3 * t:8.3f} ms  c={t / ar_t:.3f}"
          f"  (pipelined {1e3 * tp:8.3f} ms  c={tp / ar_tp:.3f})")
  for batch, t in hf.items():
    ours, ours_p = ar.get((batch, cfg.verify_context), (None, None))
    rows.append(dict(base, kind="hf_transformers_static", batch=batch,
                     context=cfg.verify_context, L=0, step_ms=1e3 * t,
                     speedup_vs_hf=(t / ours) if ours else float("nan"),
                     pipelined_speedup_vs_hf=(t / ours_p) if ours_p else float("nan")))
    if ours:
      log(f"specjax AR step vs HF at B={batch}: {t / ours:.2f}x faster"
          f" (pipelined {t / ours_p:.2f}x)")
  return pd.DataFrame(rows)
