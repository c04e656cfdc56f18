"""Sharded engine on 4 CPU devices: meshes model 2, model 4, data 2 x model 2.

The checks live in ``sharded_checks.py`` and run in subprocesses: the 4 host devices
(``--xla_force_host_platform_device_count``) must be configured before JAX starts its
CPU backend, which this pytest process has long done (with one device) by the time
this module is collected. One subprocess per mesh, all started at once (their compiles
overlap on a multi-core host); each test waits for its own.
"""

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "sharded_checks.py")
MESHES = ("data:1,model:2", "data:1,model:4", "data:2,model:2")
TIMEOUT_S = 600


def _start(*args):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  # Keep the suite's backend optimization level (tests/conftest.py), no device count.
  opt = [f for f in os.environ.get("XLA_FLAGS", "").split()
         if f.startswith("--xla_backend_optimization_level")]
  if opt:
    env["XLA_FLAGS"] = " ".join(opt)
  return subprocess.Popen([sys.executable, SCRIPT, *args], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=env)


def _result(proc) -> dict:
  out, err = proc.communicate(timeout=TIMEOUT_S)
  assert proc.returncode == 0, f"sharded_checks failed (rc {proc.returncode}):\n{err[-6000:]}"
  return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def runs():
  procs = {m: _start(m) for m in MESHES}
  yield procs
  for p in procs.values():
    if p.poll() is None:
      p.kill()


@pytest.mark.parametrize("mesh", MESHES)
def test_sharded_outputs_equal_unsharded(runs, mesh):
  """AR, n-gram, draft model and EAGLE-3 greedy outputs on ``mesh`` equal the unsharded
  engine's (and logits within 1e-5 for the one-replica meshes): asserted in the
  subprocess, which fails on the first mismatch."""
  res = _result(runs[mesh])
  assert res["tokens"] > 0
  if mesh.startswith("data:1,"):
    assert res["logits_max_abs_err"][mesh] <= 1e-5


@pytest.mark.slow
def test_sharded_draft_option():
  """draft_sharding='sharded' (draft model and EAGLE-3 head laid out by the rules)."""
  _result(_start(MESHES[0], "--sharded_draft"))
