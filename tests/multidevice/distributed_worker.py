"""One process of the two-process ``jax.distributed`` check (see test_distributed.py).

``python distributed_worker.py PROCESS_ID NUM_PROCESSES PORT``: 2 CPU devices per
process, coordinator on 127.0.0.1:PORT (process 0). Every process builds the same tiny
model, shards it over a ``data:1,model:4`` mesh spanning both processes (attention
heads and the KV pool split across hosts, row-parallel all-reduces between them), runs
one forward and checks the all-gathered logits against its own unsharded forward
(1e-5); process 0 prints one JSON line.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "tests", "e2e")]

import jax  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
jax.config.update("jax_cpu_collectives_implementation", "gloo")


def main(process_id: int, num_processes: int, port: int) -> int:
  os.environ.update(SPECJAX_COORDINATOR=f"127.0.0.1:{port}",
                    SPECJAX_NUM_PROCESSES=str(num_processes), SPECJAX_PROCESS_ID=str(process_id))
  from specjax import distributed  # noqa: PLC0415

  index, count = distributed.initialize()
  assert (index, count) == (process_id, num_processes), (index, count)
  assert jax.device_count() == 2 * num_processes and jax.local_device_count() == 2

  from e2e_lib import build_model, model_config  # noqa: PLC0415
  from jax.experimental import multihost_utils  # noqa: PLC0415

  from models.llama import init_kv_caches  # noqa: PLC0415
  from pallas_kernels.paged_attention.metadata import AttentionMetadata  # noqa: PLC0415
  from specjax import sharding  # noqa: PLC0415
  from specjax.steps import forward_step  # noqa: PLC0415

  target = build_model(model_config(num_heads=4, num_kv_heads=2), seed=0)
  cfg = target.config
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 8)).astype(np.int32)
  meta = AttentionMetadata(np.array([[3, 1], [0, 2]], np.int32), np.array([8, 5], np.int32),
                           np.array([8, 5], np.int32))
  rows = np.tile(np.arange(8, dtype=np.int32), (2, 1))
  local = jax.local_devices()[0]
  put = lambda x: jax.device_put(x, local)  # noqa: E731
  _, ref, _ = forward_step(target.graphdef, jax.tree.map(put, target.params),
                           put(init_kv_caches(cfg, 4, 8)), put(tokens), jax.tree.map(put, meta),
                           put(rows))
  mesh = sharding.make_mesh(f"data:1,model:{jax.device_count()}")
  sm = sharding.shard_model(target, mesh)
  kv = sharding.init_kv_pool(sm, 4, 8, mesh)
  rep = sharding.replicate(mesh)
  args = [jax.device_put(x, rep) for x in (tokens, rows)]
  meta = jax.tree.map(lambda x: jax.device_put(x, rep), meta)
  _, logits, _ = forward_step(sm.graphdef, sm.params, kv, args[0], meta, args[1])
  full = multihost_utils.process_allgather(logits, tiled=True)
  err = float(np.abs(np.asarray(full) - np.asarray(ref)).max())
  assert err <= 1e-5, err
  if index == 0:
    print(json.dumps({"process_count": count, "device_count": jax.device_count(),
                      "max_abs_err": err}))
  jax.distributed.shutdown()
  return 0


if __name__ == "__main__":
  sys.exit(main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])))
