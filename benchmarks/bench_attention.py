"""Paged-attention bandwidth on one GPU: kernels (unsplit and split-KV) vs jnp vs HBM copy.

Shape: Llama-8B attention (32 query heads, 8 KV heads, head_dim 128, bf16), page_size 16,
context 4096, batch 1 and batch 32; decode (T = 1) and, at batch 1, chain verify (T = 4).
Each KV page is read once per call: KV bytes = B * S * 2K * H * 2 (16 MiB at batch 1,
512 MiB at batch 32); achieved GB/s counts those plus Q and O.

Timing (``device_us``, the figure GB/s and the fractions use): one jitted program runs
``CALLS`` attention calls back to back, each with its own queries and its own page table
into a KV pool of at least 256 MiB (several times the H200's 50 MB L2, so a call does not
find the previous call's pages in L2), and no host dispatch in between; median of 7
runs / ``CALLS``. ``host_loop_us`` is the older figure: the same inputs called 20 times
from Python (host dispatch included, KV L2-warm at batch 1). Ceilings (see
``copy_bandwidth``) are measured on a 2 GiB bf16 array in the same process; "x copy" is
against the PyTorch device copy (read + write bytes), else the best XLA ceiling.

Split-KV (flash-decoding, Dao et al. 2023): ``BlockSizes.num_splits``; ``default`` rows
use the ``num_splits=None`` rule (``BlockSizes.splits``), whose resolved value is printed.

  python3 benchmarks/bench_attention.py            # writes $OUT/bench_attention.csv
  python3 benchmarks/bench_attention.py --diagnose # first: per-kernel CUPTI times (batch 1)
"""

from __future__ import annotations

import csv
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels.paged_attention import _backend, paged_attention_reference  # noqa: E402
from pallas_kernels.paged_attention.tuning import BlockSizes, default_block_sizes  # noqa: E402

CONTEXT, HEADS, KV_HEADS, HEAD_DIM, PAGE = 4096, 32, 8, 128, 16
CALLS = 12  # attention calls per timed program
POOL_BYTES = 256 << 20


def timed(fn, *args, reps=7, inner=20):
  """Median seconds per call; each rep runs ``inner`` back-to-back calls."""
  jax.block_until_ready(fn(*args))
  jax.block_until_ready(fn(*args))
  samples = []
  for _ in range(reps):
    t0 = time.perf_counter()
    out = None
    for _ in range(inner):
      out = fn(*args)
    jax.block_until_ready(out)
    samples.append((time.perf_counter() - t0) / inner)
  return statistics.median(samples), min(samples), max(samples)


def copy_bandwidth():
  """Bytes/s of three streaming ceilings: XLA ``x + 1`` (read + write), XLA sum (read),
  and a PyTorch device-to-device copy (read + write; the figure KINDS.md quotes)."""
  x = jax.random.normal(jax.random.key(0), (1024, 1024, 1024), jnp.bfloat16)  # 2 GiB
  nbytes = x.size * x.dtype.itemsize
  ceilings = {}
  med, _, _ = timed(jax.jit(lambda x: x + 1), x, reps=5, inner=5)
  ceilings["xla_add_one_rw"] = 2 * nbytes / med
  med, _, _ = timed(jax.jit(lambda x: jnp.sum(x, dtype=jnp.float32)), x, reps=5, inner=5)
  ceilings["xla_sum_read"] = nbytes / med
  del x
  try:
    import torch
  except ImportError:
    return ceilings
  if torch.cuda.is_available():
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    for _ in range(3):
      dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
      start.record()
      dst.copy_(src)
      end.record()
      torch.cuda.synchronize()
      times.append(start.elapsed_time(end) / 1e3)
    ceilings["torch_copy_rw"] = 2 * nbytes / statistics.median(times)
    del src, dst
    torch.cuda.empty_cache()
  return ceilings


def make_inputs(batch, num_tokens, seed=0, context=None):
  """Q for each of ``CALLS`` calls, a KV pool and ``CALLS`` disjoint page tables into it
  (one per call: XLA would merge the reference's KV gathers of calls sharing a table)."""
  context = context or CONTEXT
  rng = np.random.default_rng(seed)
  pages_per_seq = context // PAGE
  kv_bytes = batch * context * 2 * KV_HEADS * HEAD_DIM * 2
  sets = CALLS
  num_pages = sets * batch * pages_per_seq + 8
  key = jax.random.key(seed)
  kv = jax.random.normal(key, (num_pages, PAGE, 2 * KV_HEADS, HEAD_DIM), jnp.bfloat16)
  qs = jax.random.normal(jax.random.fold_in(key, 1),
                         (CALLS, batch, num_tokens, HEADS, HEAD_DIM), jnp.bfloat16)
  tables = rng.permutation(num_pages)[: sets * batch * pages_per_seq]
  tables = jnp.asarray(tables.reshape(sets, batch, pages_per_seq), jnp.int32)
  kv_lens = jnp.full((batch,), context, jnp.int32)
  q_lens = jnp.full((batch,), num_tokens, jnp.int32)
  return qs, kv, tables, kv_lens, q_lens, kv_bytes


def device_time(fn, qs, kv, tables, kv_lens, q_lens):
  """Median seconds per call of ``CALLS`` calls inside one jitted program."""
  def many(qs, kv, tables, kv_lens, q_lens):
    return jnp.stack([fn(qs[i], kv, tables[i % tables.shape[0]], kv_lens, q_lens)
                      for i in range(CALLS)])
  med, lo, hi = timed(jax.jit(many), qs, kv, tables, kv_lens, q_lens, reps=7, inner=1)
  return med / CALLS, lo / CALLS, hi / CALLS


def variants(batch, sm_scale):
  ref = jax.jit(lambda *a: paged_attention_reference(*a, sm_scale=sm_scale))
  out = [("reference", None, ref)]
  configs = {
      "pallas_gpu": [BlockSizes(pages_per_block=8, num_stages=2, num_splits=1), None],
      "pallas_triton": [BlockSizes(pages_per_block=8, num_stages=4, num_splits=1), None],
  }
  if batch == 1:  # (run 1 also timed 64-key blocks with 32 / 64 splits: no faster)
    configs["pallas_gpu"] += [BlockSizes(pages_per_block=8, num_stages=2, num_splits=8),
                              BlockSizes(pages_per_block=8, num_stages=2, num_splits=32)]
    configs["pallas_triton"] += [BlockSizes(pages_per_block=8, num_stages=4, num_splits=32)]
  for impl, bss in configs.items():
    for bs in bss:
      fn = _backend(impl)
      out.append((impl, bs, jax.jit(
          lambda *a, fn=fn, bs=bs: fn(*a, sm_scale=sm_scale, block_sizes=bs))))
  return out


def diagnose(out_dir):
  """Where batch-1 time goes: per-kernel GPU durations (CUPTI, via Mosaic GPU's profiler)
  of one call, and the kernel's duration against context length (fixed cost vs slope)."""
  from jax.experimental.mosaic.gpu import profiler

  sm_scale = HEAD_DIM ** -0.5
  lines = []
  for impl, bs in (("pallas_gpu", BlockSizes(pages_per_block=8, num_splits=1)),
                   ("pallas_gpu", BlockSizes(pages_per_block=8, num_splits=16)),
                   ("pallas_triton", BlockSizes(pages_per_block=8, num_stages=4, num_splits=1)),
                   ("pallas_triton", BlockSizes(pages_per_block=8, num_stages=4, num_splits=16))):
    fn = _backend(impl)
    for context in (128, 1024, 4096, 16384):
      qs, kv, tables, kv_lens, q_lens, kv_bytes = make_inputs(1, 1, context=context)
      call = jax.jit(lambda *a, fn=fn, bs=bs: fn(*a, sm_scale=sm_scale, block_sizes=bs))
      _, per_kernel = profiler.measure(call, aggregate=False, iterations=5)(
          qs[0], kv, tables[0], kv_lens, q_lens)
      names = [n for n, _ in per_kernel[0]]
      med = [statistics.median(it[i][1] for it in per_kernel) * 1e3 for i in range(len(names))]
      attn = sum(t for n, t in zip(names, med) if "paged_attention" in n)
      wall, _, _ = device_time(call, qs, kv, tables, kv_lens, q_lens)
      line = (f"diag {impl} splits={bs.num_splits} context={context}: kernels(us)="
              + ", ".join(f"{n[:48]}:{t:.1f}" for n, t in zip(names, med))
              + f" | attention kernel {attn:.1f} us = {kv_bytes / attn / 1e3:.0f} GB/s,"
              f" all kernels {sum(med):.1f} us, in-jit wall per call {wall * 1e6:.1f} us")
      print(line, flush=True)
      lines.append(line)
      del qs, kv, tables
  with open(os.path.join(out_dir, "diagnose.log"), "w") as f:
    f.write("\n".join(lines) + "\n")


def main():
  out_dir = os.environ.get("OUT", "bench_out")
  os.makedirs(out_dir, exist_ok=True)
  if "--diagnose" in sys.argv:
    try:
      diagnose(out_dir)
    except Exception as e:  # the benchmark below must still run
      print(f"diagnose FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)
  print("jax", jax.__version__, jax.devices()[0].device_kind, flush=True)
  ceilings = copy_bandwidth()
  for name, value in ceilings.items():
    print(f"ceiling {name} (2 GiB bf16): {value / 1e9:.0f} GB/s", flush=True)
  copy_bw = ceilings.get("torch_copy_rw", max(ceilings.values()))
  rows = []
  sm_scale = HEAD_DIM ** -0.5
  for batch, num_tokens in ((1, 1), (1, 4), (32, 1)):  # decode; chain verify L = 3
    qs, kv, tables, kv_lens, q_lens, kv_bytes = make_inputs(batch, num_tokens)
    total_bytes = kv_bytes + 2 * qs[0].size * qs.dtype.itemsize
    one = (qs[0], kv, tables[0], kv_lens, q_lens)
    ref = None
    for impl, bs, fn in variants(batch, sm_scale):
      if impl == "reference":
        label, splits = impl, 1
      else:
        resolved = bs or default_block_sizes(impl, PAGE)
        splits = resolved.splits(batch=batch, num_kv_heads=KV_HEADS,
                                 max_blocks=-(-CONTEXT // resolved.block_kv(PAGE)))
        label = (f"{impl}[{'default' if bs is None else 'forced'} "
                 f"{resolved.block_kv(PAGE)} keys/block, splits={splits}]")
      try:
        out = fn(*one)
        ref = out if ref is None else ref
        err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
        med, lo, hi = device_time(fn, qs, kv, tables, kv_lens, q_lens)
        host, _, _ = timed(fn, *one)
      except Exception as e:  # report and go on: one bad config must not hide the rest
        print(f"B={batch} T={num_tokens} {label}: FAILED {type(e).__name__}: "
              f"{str(e)[:400]}", flush=True)
        rows.append(dict(batch=batch, num_tokens=num_tokens, impl=impl, block_sizes=str(bs),
                         num_splits=splits, error=f"{type(e).__name__}"))
        continue
      gbps = total_bytes / med / 1e9
      rows.append(dict(
          batch=batch, num_tokens=num_tokens, page_size=PAGE, context=CONTEXT, impl=impl,
          block_sizes=str(bs), num_splits=splits, ctas=batch * KV_HEADS * splits,
          device_us=round(med * 1e6, 2), min_us=round(lo * 1e6, 2), max_us=round(hi * 1e6, 2),
          host_loop_us=round(host * 1e6, 1), GBps=round(gbps, 1),
          frac_of_copy=round(gbps * 1e9 / copy_bw, 3), max_abs_err_vs_ref=err,
          **{f"{k}_GBps": round(v / 1e9, 1) for k, v in ceilings.items()},
          jax=jax.__version__, device=jax.devices()[0].device_kind,
      ))
      print(f"B={batch} T={num_tokens} {label}: {med * 1e6:.1f} us (min {lo * 1e6:.1f}, "
            f"max {hi * 1e6:.1f}; host loop {host * 1e6:.1f}) {gbps:.0f} GB/s "
            f"= {gbps * 1e9 / copy_bw:.3f} x copy, max|err| {err:.3g}", flush=True)
    del qs, kv, tables
  keys = list(dict.fromkeys(k for r in rows for k in r))
  with open(os.path.join(out_dir, "bench_attention.csv"), "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=keys)
    writer.writeheader()
    writer.writerows(rows)
  print("wrote", os.path.join(out_dir, "bench_attention.csv"))


if __name__ == "__main__":
  main()
