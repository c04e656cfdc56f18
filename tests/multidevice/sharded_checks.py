"""Sharded-engine checks, run in a fresh process with 4 host CPU devices.

``--xla_force_host_platform_device_count`` must be set before JAX initialises its CPU
backend, and the main pytest process has initialised it long before (with one device),
so ``test_sharded_engine.py`` runs this file as subprocesses (one per mesh, in
parallel): ``python tests/multidevice/sharded_checks.py [MESH ...] [--sharded_draft]``
prints one JSON line of results and exits non-zero on the first mismatch.

What it checks (tiny 2-layer Llama, f32, highest matmul precision; N = 4 query heads,
K = 2 KV heads, so model 4 exercises the KV-head repeat):
  * logits of one ragged forward on meshes model 2 and model 4 within 1e-5 of the
    unsharded model's, with the pool split by heads and the logits by vocabulary;
  * greedy outputs of AR, n-gram, draft model and EAGLE-3 (random head) on meshes
    model 2, model 4 and data 2 x model 2 (two replicas behind the front) identical to
    the unsharded AR engine's (every method is lossless unsharded: tests/e2e);
  * ``--sharded_draft``: the sharded draft / head option (model 2) gives the same outputs.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=4").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "tests", "e2e")]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

from e2e_lib import build_model, decode, make_requests, model_config  # noqa: E402

from methods.registry import make_method  # noqa: E402
from models.llama import init_kv_caches  # noqa: E402
from pallas_kernels.paged_attention.metadata import AttentionMetadata  # noqa: E402
from specjax import sharding  # noqa: E402
from specjax.config import EngineConfig  # noqa: E402
from specjax.data_parallel import DataParallelEngine  # noqa: E402
from specjax.engine import Engine  # noqa: E402
from specjax.steps import forward_step, split_model  # noqa: E402

MESHES = ("data:1,model:2", "data:1,model:4", "data:2,model:2")
METHODS = ("ar", "ngram", "draft_model", "eagle3")
K = 2
# Few step shapes (compiles dominate): batch buckets 1-2, one prefill bucket, L in {1, 2}.
ENGINE_CONFIG = EngineConfig(max_num_seqs=2, max_model_len=32, page_size=8, num_pages=8,
                             min_prefill_bucket=16)


def _stacked(split):
  """The same weights with stacked layers (one scanned layer body: faster compiles)."""
  module = nnx.merge(split.graphdef, split.params)
  for name, var in module.layers.weights().items():
    getattr(module.layers, name).set_value(jnp.stack(var))
  return split_model(module, unroll_layers=False)


def _method(name):
  if name == "eagle3":
    return make_method(name, K, feature_layers=(1, 2, 2), window=ENGINE_CONFIG.max_model_len)
  return make_method(name, K)


def check_logits(target, meshes) -> dict:
  cfg = target.config
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, cfg.vocab_size, (2, 8)).astype(np.int32)
  meta = AttentionMetadata(np.array([[3, 1], [0, 2]], np.int32), np.array([8, 5], np.int32),
                           np.array([8, 5], np.int32))
  rows = np.tile(np.arange(8, dtype=np.int32), (2, 1))
  _, ref, _ = forward_step(target.graphdef, target.params, init_kv_caches(cfg, 4, 8), tokens,
                           meta, rows)
  out = {}
  for text in meshes:
    mesh = sharding.make_mesh(text)
    sm = sharding.shard_model(target, mesh)
    kv = sharding.init_kv_pool(sm, 4, 8, mesh)
    kv, logits, _ = forward_step(sm.graphdef, sm.params, kv, tokens, meta, rows)
    assert logits.sharding.spec == jax.sharding.PartitionSpec(None, None, "model"), logits.sharding
    assert kv.sharding.spec == jax.sharding.PartitionSpec(None, None, "model"), kv.sharding
    err = float(np.abs(np.asarray(logits) - np.asarray(ref)).max())
    assert err <= 1e-5, (text, err)
    out[text] = err
  return out


def main(meshes: list[str], sharded_draft: bool) -> int:
  t0 = time.perf_counter()
  assert jax.device_count() == 4, jax.devices()
  cfg = model_config(num_heads=4, num_kv_heads=2)
  target = _stacked(build_model(cfg, seed=0))
  draft = _stacked(build_model(cfg, seed=0, perturb=0.15))
  requests = make_requests(7, 2, prompt_len=(5, 10), max_tokens=(10, 14))
  summary = {"logits_max_abs_err": check_logits(target, [m for m in meshes
                                                          if m.startswith("data:1,")])}

  def run(method, config, mesh=None):
    if mesh is not None and mesh.shape["data"] > 1:
      engine = DataParallelEngine(target, _method(method), config, mesh, draft=draft,
                                  decode=decode)
      outs, _ = engine.generate(requests)
    else:
      cfg_ = config if mesh is None else config.replace(mesh=mesh)
      outs, _ = Engine(target, _method(method), cfg_, draft=draft, decode=decode).generate(
          requests)
    return [o.output_token_ids for o in outs]

  def timed(label, *args):
    t = time.perf_counter()
    out = run(*args)
    print(f"{label}: {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
    return out

  # Every method is lossless unsharded (tests/e2e), so the unsharded AR engine's
  # outputs are every unsharded method's.
  ar = timed("unsharded ar", "ar", ENGINE_CONFIG)
  assert len({t for o in ar for t in o}) >= 5, ar  # not a degenerate one-token loop
  base = {m: ar for m in METHODS}
  summary["tokens"] = sum(len(o) for o in ar)
  for text in meshes:
    mesh = sharding.make_mesh(text)
    for m in METHODS:
      got = timed(f"{text} {m}", m, ENGINE_CONFIG, mesh)
      assert got == base[m], (text, m, got, base[m])
  if sharded_draft:
    mesh = sharding.make_mesh(MESHES[0])
    sharded = ENGINE_CONFIG.replace(draft_sharding="sharded")
    for m in ("draft_model", "eagle3"):
      assert timed(f"sharded draft {m}", m, sharded, mesh) == base[m], ("sharded draft", m)
  summary["seconds"] = round(time.perf_counter() - t0, 1)
  print(json.dumps(summary))
  return 0


if __name__ == "__main__":
  # argv: meshes to check (default all), and "--sharded_draft" for the sharded option.
  args = sys.argv[1:]
  sys.exit(main([a for a in args if not a.startswith("--")] or list(MESHES),
                "--sharded_draft" in args))
