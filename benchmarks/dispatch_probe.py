"""Does a device-side branch or loop block the host's dispatch?

An asynchronous engine only overlaps host work with device work if ``f(x)`` returns
before the device has run ``f``. A jitted function whose control flow depends on a
device value (``lax.cond`` / ``lax.switch`` / ``lax.while_loop``) may need that value on
the host before it can launch the branch (XLA:GPU copies the predicate back unless the
branch runs inside a command buffer). This probe chains ``--calls`` calls of each kind
over ~``--work_ms`` of matmuls and prints the mean time a call takes to return
(``dispatch_ms``) next to the mean time per call on the device (``total_ms``): a
dispatch as long as the device time means the host waited.

  python -m benchmarks.dispatch_probe
  XLA_FLAGS=--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL python -m benchmarks.dispatch_probe
"""

from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
from absl import flags

from harness import cli

__all__ = ["probe"]

_CALLS = flags.DEFINE_integer("calls", 20, "Chained calls per kind.")
_DIM = flags.DEFINE_integer("dim", 4096, "Matmul size.")
_MATMULS = flags.DEFINE_integer("matmuls", 16, "Matmuls per call.")


def _heavy(x, w, n):
  for _ in range(n):
    x = jnp.tanh(x @ w)
  return x


def probe(dim: int, matmuls: int, calls: int) -> list[dict]:
  """Rows ``{kind, dispatch_ms, total_ms}`` for plain / cond / switch / while calls."""
  key = jax.random.PRNGKey(0)
  w = (jax.random.normal(key, (dim, dim), jnp.bfloat16) / dim**0.5).astype(jnp.bfloat16)
  x0 = jax.random.normal(key, (dim, dim), jnp.bfloat16)

  plain = jax.jit(lambda x: _heavy(x, w, matmuls))
  cond = jax.jit(lambda x: jax.lax.cond(x[0, 0] > -1e9, lambda y: _heavy(y, w, matmuls),
                                        lambda y: _heavy(y, w, matmuls // 2), x))
  switch = jax.jit(lambda x: jax.lax.switch(
      jnp.int32(x[0, 0] > -1e9) * 2, [lambda y, n=n: _heavy(y, w, n)
                                       for n in (1, matmuls // 2, matmuls, 2)], x))

  def while_fn(x):
    n = jnp.where(x[0, 0] > -1e9, 4, 3)
    body = lambda c: (c[0] + 1, _heavy(c[1], w, matmuls // 4))
    return jax.lax.while_loop(lambda c: c[0] < n, body, (jnp.int32(0), x))[1]

  rows = []
  for kind, f in (("plain", plain), ("cond", cond), ("switch", switch),
                  ("while", jax.jit(while_fn))):
    f(x0).block_until_ready()
    x = x0
    dispatch = []
    t0 = time.perf_counter()
    for _ in range(calls):
      t = time.perf_counter()
      x = f(x)
      dispatch.append(time.perf_counter() - t)
    x.block_until_ready()
    total = time.perf_counter() - t0
    rows.append(dict(kind=kind, dispatch_ms=1e3 * sum(dispatch[1:]) / (calls - 1),
                     total_ms=1e3 * total / calls))
  return rows


def main(argv):
  del argv
  print(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r} backend={jax.default_backend()} "
        f"jax={jax.__version__}")
  for r in probe(_DIM.value, _MATMULS.value, _CALLS.value):
    print(f"{r['kind']:7s} dispatch_ms={r['dispatch_ms']:.3f} total_ms={r['total_ms']:.3f}")


if __name__ == "__main__":
  cli.run(main)
