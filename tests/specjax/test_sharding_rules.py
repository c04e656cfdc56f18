"""Mesh parsing, the parameter rule table, the data-parallel assignment and the
distributed flag checks (one device: no compiles; the multi-device runs are in
tests/multidevice)."""

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from models.testing import tiny_config
from specjax import distributed, sharding
from specjax.config import EngineConfig, SamplingParams
from specjax.data_parallel import assign
from specjax.request import Request


def test_parse_mesh():
  assert sharding.parse_mesh("data:1,model:2") == {"data": 1, "model": 2}
  assert sharding.parse_mesh("model:4") == {"data": 1, "model": 4}
  for bad in ("model:0", "tensor:2", "model:2,model:2", "model", "model:x", "data:1;model:2"):
    with pytest.raises(ValueError, match="mesh="):
      sharding.parse_mesh(bad)


def test_make_mesh_needs_devices():
  with pytest.raises(ValueError, match="needs 64 devices"):
    sharding.make_mesh("data:8,model:8")
  mesh = sharding.make_mesh("data:1,model:1")
  assert dict(mesh.shape) == {"data": 1, "model": 1}


def test_param_specs_follow_the_rules():
  mesh = sharding.make_mesh("data:1,model:1")
  cfg = tiny_config("llama")
  spec = lambda name, shape, stacked=True: sharding.param_spec(name, shape, cfg, mesh,  # noqa: E731
                                                              stacked=stacked)
  assert spec("q", (2, 32, 4, 8)) == P(None, None, "model", None)
  assert spec("o", (2, 4, 8, 32)) == P(None, "model", None, None)
  assert spec("gate", (2, 32, 64)) == P(None, None, "model")
  assert spec("down", (2, 64, 32)) == P(None, "model", None)
  assert spec("embed", (96, 32), False) == P("model", None)
  assert spec("lm_head", (32, 96), False) == P(None, "model")
  assert spec("attn_norm", (2, 32)) == P()


def test_engine_config_mesh_checks():
  with pytest.raises(ValueError, match="draft_sharding"):
    EngineConfig(draft_sharding="both")
  with pytest.raises(ValueError, match="mesh="):
    EngineConfig(mesh="data:1,model:2")


def test_assign_policies():
  reqs = [Request(i, (1,) * n, SamplingParams(max_tokens=4)) for i, n in enumerate((10, 2, 2))]
  assert assign(reqs, 2, "least_loaded") == [0, 1, 1]
  assert assign(reqs, 2, "round_robin") == [0, 1, 0]
  with pytest.raises(ValueError, match="policy"):
    assign(reqs, 2, "random")
  counts = np.bincount(assign(reqs * 4, 3, "least_loaded"), minlength=3)
  assert counts.min() >= 3


def test_distributed_config_from_env():
  cfg = distributed.from_env({"SPECJAX_COORDINATOR": "127.0.0.1:1234",
                              "SPECJAX_NUM_PROCESSES": "2", "SPECJAX_PROCESS_ID": "1"})
  assert (cfg.coordinator_address, cfg.num_processes, cfg.process_id) == ("127.0.0.1:1234", 2, 1)
  assert distributed.from_env({}).num_processes is None
  with pytest.raises(ValueError, match="all\nthree|give all"):
    distributed.from_env({"SPECJAX_NUM_PROCESSES": "2"})
  with pytest.raises(ValueError, match="must be an int"):
    distributed.from_env({"SPECJAX_COORDINATOR": "h:1", "SPECJAX_NUM_PROCESSES": "two",
                          "SPECJAX_PROCESS_ID": "0"})
  with pytest.raises(ValueError, match="process_id"):
    distributed.DistributedConfig("h:1", 2, 2)
