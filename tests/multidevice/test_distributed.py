"""``jax.distributed`` on one machine: two CPU processes, coordinator on 127.0.0.1.

Each process (``distributed_worker.py``) has 2 CPU devices; a ``data:1,model:4`` mesh
spans both, so the sharded forward's all-reduces cross processes. Process 0 reports the
all-gathered logits' error against its own unsharded forward.
"""

import json
import os
import socket
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "distributed_worker.py")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_two_process_sharded_forward():
  port = _free_port()
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  procs = [subprocess.Popen([sys.executable, WORKER, str(i), "2", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
           for i in range(2)]
  try:
    results = [p.communicate(timeout=300) for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  for p, (_, err) in zip(procs, results):
    assert p.returncode == 0, err[-6000:]
  report = json.loads(results[0][0].strip().splitlines()[-1])
  assert report["process_count"] == 2 and report["device_count"] == 4
  assert report["max_abs_err"] <= 1e-5
