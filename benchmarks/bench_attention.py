"""Decode paged-attention bandwidth on one GPU: kernels vs the jnp reference vs HBM copy.

Shape: Llama-8B attention (32 query heads, 8 KV heads, head_dim 128, bf16), batch 32,
context 4096 (512 MiB of KV), every page read once. Bytes counted = KV bytes read
(B * S * 2K * H * 2) + Q and O (tiny); achieved GB/s = bytes / median time of 20
back-to-back calls (7 repeats). Ceilings (see ``copy_bandwidth``) are measured on a
2 GiB bf16 array in the same process.

  python3 benchmarks/bench_attention.py            # writes $OUT/bench_attention.csv
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
from pallas_kernels.paged_attention.tuning import BlockSizes  # noqa: E402

BATCH, CONTEXT, HEADS, KV_HEADS, HEAD_DIM = 32, 4096, 32, 8, 128


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


def make_inputs(page_size, num_tokens, seed=0):
  rng = np.random.default_rng(seed)
  pages_per_seq = CONTEXT // page_size
  num_pages = BATCH * pages_per_seq + 8
  key = jax.random.key(seed)
  kv = jax.random.normal(key, (num_pages, page_size, 2 * KV_HEADS, HEAD_DIM), jnp.bfloat16)
  q = jax.random.normal(jax.random.fold_in(key, 1), (BATCH, num_tokens, HEADS, HEAD_DIM),
                        jnp.bfloat16)
  page_indices = rng.permutation(num_pages)[: BATCH * pages_per_seq].reshape(BATCH, -1)
  kv_lens = jnp.full((BATCH,), CONTEXT, jnp.int32)
  q_lens = jnp.full((BATCH,), num_tokens, jnp.int32)
  return q, kv, jnp.asarray(page_indices, jnp.int32), kv_lens, q_lens


def main():
  out_dir = os.environ.get("OUT", "bench_out")
  os.makedirs(out_dir, exist_ok=True)
  print("jax", jax.__version__, jax.devices()[0].device_kind, flush=True)
  ceilings = copy_bandwidth()
  for name, value in ceilings.items():
    print(f"ceiling {name} (2 GiB bf16): {value / 1e9:.0f} GB/s", flush=True)
  copy_bw = max(ceilings.values())  # fractions below are of the best streaming ceiling
  rows = []
  sm_scale = HEAD_DIM ** -0.5
  for page_size, num_tokens in ((16, 1), (64, 1), (16, 4)):  # decode; chain verify L = 3
    args = make_inputs(page_size, num_tokens)
    q, kv = args[0], args[1]
    kv_bytes = BATCH * CONTEXT * 2 * KV_HEADS * HEAD_DIM * kv.dtype.itemsize
    total_bytes = kv_bytes + 2 * q.size * q.dtype.itemsize
    ref_fn = jax.jit(lambda *a: paged_attention_reference(*a, sm_scale=sm_scale))
    ref = ref_fn(*args)

    def pages(keys, page_size=page_size):
      return max(1, keys // page_size)

    variants = [("reference", None, ref_fn)]
    for impl, configs in (
        ("pallas_gpu", [None, BlockSizes(pages_per_block=pages(64), num_stages=4),
                        BlockSizes(pages_per_block=pages(128), num_stages=2),
                        BlockSizes(pages_per_block=pages(128), num_stages=3)]),
        ("pallas_triton", [None, BlockSizes(pages_per_block=pages(128), num_stages=3),
                           BlockSizes(pages_per_block=pages(256), num_warps=8, num_stages=3),
                           BlockSizes(pages_per_block=pages(128), num_stages=4)]),
    ):
      for bs in configs:
        fn = _backend(impl)
        variants.append((impl, bs, jax.jit(
            lambda *a, fn=fn, bs=bs: fn(*a, sm_scale=sm_scale, block_sizes=bs))))
    for impl, bs, fn in variants:
      label = f"{impl}[{'default' if bs is None else bs}]" if impl != "reference" else impl
      try:
        out = fn(*args)
        err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
        med, lo, hi = timed(fn, *args)
      except Exception as e:  # report and go on: one bad config must not hide the rest
        print(f"P={page_size} T={num_tokens} {label}: FAILED {type(e).__name__}: "
              f"{str(e)[:300]}", flush=True)
        rows.append(dict(page_size=page_size, num_tokens=num_tokens, impl=impl,
                         block_sizes=str(bs), error=f"{type(e).__name__}"))
        continue
      gbps = total_bytes / med / 1e9
      rows.append(dict(
          page_size=page_size, num_tokens=num_tokens, impl=impl, block_sizes=str(bs),
          median_us=round(med * 1e6, 1), min_us=round(lo * 1e6, 1), max_us=round(hi * 1e6, 1),
          GBps=round(gbps, 1), frac_of_best_ceiling=round(gbps * 1e9 / copy_bw, 3),
          max_abs_err=err, **{f"{k}_GBps": round(v / 1e9, 1) for k, v in ceilings.items()},
          jax=jax.__version__, device=jax.devices()[0].device_kind,
      ))
      print(f"P={page_size} T={num_tokens} {label}: {med * 1e6:.1f} us "
            f"(min {lo * 1e6:.1f}, max {hi * 1e6:.1f}) {gbps:.0f} GB/s "
            f"= {gbps * 1e9 / copy_bw:.2f} x best ceiling, max|err| {err:.3g}", flush=True)
  keys = sorted({k for r in rows for k in r})
  with open(os.path.join(out_dir, "bench_attention.csv"), "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=keys)
    writer.writeheader()
    writer.writerows(rows)
  print("wrote", os.path.join(out_dir, "bench_attention.csv"))


if __name__ == "__main__":
  main()
