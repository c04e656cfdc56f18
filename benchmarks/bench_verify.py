"""Verification cost over a large vocabulary: jnp rejection sampler vs the fused op.

Times, in one run and on one device, a stochastic chain verification of L drafts
(draft probabilities given, temperature 1) with
``specjax.verify.rejection_sample`` (materializes [B, L+1, V] probabilities) and with
``specjax.verify.fused_rejection_sample`` for each ``pallas_kernels.verify``
implementation that accepts the shapes, and prints ms per call and the ratio to the
jnp sampler. GPU: ``python3 -m benchmarks.bench_verify`` (pallas_triton runs natively);
CPU: the Pallas kernel only runs in interpret mode and is skipped.

  python -m benchmarks.bench_verify --batch_sizes=1,16,64 --draft_length=4 --vocab=128256
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import pandas as pd
from absl import flags

from harness import cli
from pallas_kernels.verify import IMPLEMENTATIONS
from specjax.verify import fused_rejection_sample, rejection_sample

_BATCHES = flags.DEFINE_list("batch_sizes", ["1", "16", "64"], "Batch sizes B.")
_L = flags.DEFINE_integer("draft_length", 4, "Draft tokens L per row.")
_V = flags.DEFINE_integer("vocab", 128256, "Vocabulary size V (Llama 3: 128256).")
_REPS = flags.DEFINE_integer("reps", 20, "Timed calls per case (after 3 warm-up calls).")
_OUT = flags.DEFINE_string("output_csv", None, "Optional CSV path.")


def _time(fn, reps: int) -> float:
  """Median seconds of ``fn()`` (blocked on its outputs)."""
  for _ in range(3):
    jax.block_until_ready(fn())
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t)
  return float(np.median(times))


def main(argv):
  del argv
  length, vocab = _L.value, _V.value
  rows = []
  for batch in (int(b) for b in _BATCHES.value):
    rng = np.random.default_rng(batch)
    logits = jnp.asarray(rng.standard_normal((batch, length + 1, vocab)), jnp.float32)
    probs = jax.nn.softmax(jnp.asarray(rng.standard_normal((batch, length, vocab)), jnp.float32))
    drafts = jnp.asarray(rng.integers(0, vocab, (batch, length)), jnp.int32)
    num_draft = jnp.full(batch, length, jnp.int32)
    temp = jnp.ones(batch, jnp.float32)
    keys = jax.random.split(jax.random.PRNGKey(0), batch)
    pos = jnp.zeros(batch, jnp.int32)
    jnp_fn = jax.jit(functools.partial(rejection_sample, all_greedy=False))
    base = _time(lambda: jnp_fn(logits, drafts, num_draft, probs, temp, jnp.zeros(batch, jnp.int32),
                                jnp.ones(batch, jnp.float32), keys, pos), _REPS.value)
    rows.append({"batch": batch, "sampler": "rejection_sample", "ms": base * 1e3, "ratio": 1.0})
    for impl in IMPLEMENTATIONS:
      fused = jax.jit(functools.partial(fused_rejection_sample, implementation=impl))
      try:
        t = _time(lambda: fused(logits, drafts, num_draft, probs, temp, keys, pos), _REPS.value)
      except NotImplementedError as e:
        print(f"B={batch} fused[{impl}]: skipped ({e})")
        continue
      rows.append({"batch": batch, "sampler": f"fused[{impl}]", "ms": t * 1e3, "ratio": t / base})
  df = pd.DataFrame(rows)
  df.insert(0, "device", jax.devices()[0].device_kind)
  df.insert(1, "L", length)
  df.insert(2, "V", vocab)
  print(df.to_string(index=False, float_format=lambda x: f"{x:.3f}"))
  if _OUT.value:
    df.to_csv(_OUT.value, index=False)


if __name__ == "__main__":
  cli.run(main)
