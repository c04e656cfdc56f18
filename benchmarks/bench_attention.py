"""Decode paged-attention bandwidth on one GPU: kernels vs the jnp reference vs HBM copy.

Shape: Llama-8B attention (32 query heads, 8 KV heads, head_dim 128, bf16), batch 32,
context 4096, every page read once. Bytes counted = KV bytes read (B * S * 2K * H * 2)
+ Q and O (tiny); achieved GB/s = bytes / median time. The copy ceiling is a jitted
``x + 1`` over a 2 GiB bf16 array (read + write counted).

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
  x = jax.random.normal(jax.random.key(0), (1024, 1024, 1024), jnp.bfloat16)  # 2 GiB
  f = jax.jit(lambda x: x + 1)
  med, _, _ = timed(f, x, reps=5, inner=5)
  return 2 * x.size * x.dtype.itemsize / med


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
  copy_bw = copy_bandwidth()
  print(f"HBM copy (x + 1, 2 GiB bf16, read+write): {copy_bw / 1e9:.0f} GB/s", flush=True)
  rows = []
  sm_scale = HEAD_DIM ** -0.5
  for page_size in (16, 64):
    for num_tokens in (1, 4):  # decode and chain verify with L = 3
      args = make_inputs(page_size, num_tokens)
      q, kv = args[0], args[1]
      kv_bytes = BATCH * CONTEXT * 2 * KV_HEADS * HEAD_DIM * kv.dtype.itemsize
      total_bytes = kv_bytes + 2 * q.size * q.dtype.itemsize
      ref_fn = jax.jit(lambda *a: paged_attention_reference(*a, sm_scale=sm_scale))
      ref = ref_fn(*args)
      variants = [("reference", None, ref_fn)]
      for impl, configs in (
          ("pallas_gpu", [None, BlockSizes(pages_per_block=max(1, 64 // page_size), num_stages=4),
                          BlockSizes(pages_per_block=max(1, 128 // page_size), num_stages=2),
                          BlockSizes(pages_per_block=max(1, 128 // page_size), num_stages=3)]),
          ("pallas_triton", [None, BlockSizes(pages_per_block=max(1, 128 // page_size),
                                              num_warps=4, num_stages=3),
                             BlockSizes(pages_per_block=max(1, 64 // page_size), num_warps=8,
                                        num_stages=3)]),
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
        row = dict(page_size=page_size, num_tokens=num_tokens, impl=impl, block_sizes=str(bs),
                   median_us=round(med * 1e6, 1), min_us=round(lo * 1e6, 1),
                   max_us=round(hi * 1e6, 1), GBps=round(gbps, 1),
                   frac_of_copy=round(gbps * 1e9 / copy_bw, 3), max_abs_err=err,
                   copy_GBps=round(copy_bw / 1e9, 1), jax=jax.__version__,
                   device=jax.devices()[0].device_kind)
        rows.append(row)
        print(f"P={page_size} T={num_tokens} {label}: {med * 1e6:.1f} us "
              f"(min {lo * 1e6:.1f}, max {hi * 1e6:.1f}) {gbps:.0f} GB/s "
              f"= {gbps * 1e9 / copy_bw:.2f} x copy, max|err| {err:.3g}", flush=True)
  keys = sorted({k for r in rows for k in r})
  with open(os.path.join(out_dir, "bench_attention.csv"), "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=keys)
    writer.writeheader()
    writer.writerows(rows)
  print("wrote", os.path.join(out_dir, "bench_attention.csv"))


if __name__ == "__main__":
  main()
