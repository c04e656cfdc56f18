"""Multi-host start-up: ``jax.distributed.initialize`` from flags or the environment.

Every host runs the same command; process 0 also hosts the coordinator. After
``initialize`` each process sees all hosts' devices in ``jax.devices()`` (its own in
``jax.local_devices()``) and a mesh from ``specjax.sharding.make_mesh`` spans them;
jitted steps then run SPMD on every process with the same host inputs (the scheduler
is deterministic, so each process builds the same batches). A two-host, 8-GPU-each run
of the 70B shape, TP 8 within each host and two data-parallel replicas (run on both
hosts, PROCESS_ID 0 and 1)::

  SPECJAX_COORDINATOR=host0:12355 SPECJAX_NUM_PROCESSES=2 SPECJAX_PROCESS_ID=$PROCESS_ID \\
    python -m benchmarks.sharded_step --mesh=data:2,model:8 --target=llama3.3-70b \\
      --output_dir=$OUT

(On Cloud TPU and under SLURM / Open MPI ``jax.distributed.initialize()`` with no
arguments finds all three itself: leave the variables unset and pass
``--distributed``.)
"""

from __future__ import annotations

import os

import jax

__all__ = ["ENV", "DistributedConfig", "initialize", "from_env"]

ENV = {"coordinator_address": "SPECJAX_COORDINATOR", "num_processes": "SPECJAX_NUM_PROCESSES",
       "process_id": "SPECJAX_PROCESS_ID"}


class DistributedConfig:
  """``coordinator_address`` ("host:port"), ``num_processes``, ``process_id`` (all None:
  let JAX detect the cluster, e.g. Cloud TPU, SLURM)."""

  def __init__(self, coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None):
    given = [v is not None for v in (coordinator_address, num_processes, process_id)]
    if any(given) and not all(given):
      raise ValueError(f"{coordinator_address=}, {num_processes=}, {process_id=}: give all "
                       "three or none (none: JAX detects the cluster)")
    if num_processes is not None and num_processes < 1:
      raise ValueError(f"{num_processes=} must be >= 1")
    if process_id is not None and not 0 <= process_id < num_processes:
      raise ValueError(f"{process_id=} must be in [0, {num_processes=})")
    if coordinator_address is not None and ":" not in coordinator_address:
      raise ValueError(f"{coordinator_address=} must be 'host:port'")
    self.coordinator_address = coordinator_address
    self.num_processes = num_processes
    self.process_id = process_id

  def __repr__(self):
    return (f"DistributedConfig({self.coordinator_address!r}, {self.num_processes}, "
            f"{self.process_id})")


def from_env(environ=None) -> DistributedConfig:
  """Reads ``SPECJAX_COORDINATOR``, ``SPECJAX_NUM_PROCESSES``, ``SPECJAX_PROCESS_ID``.

  Raises:
    ValueError: a non-int count or id, or only some of the three set.
  """
  env = os.environ if environ is None else environ
  values = {k: env.get(v) or None for k, v in ENV.items()}
  for k in ("num_processes", "process_id"):
    if values[k] is not None:
      try:
        values[k] = int(values[k])
      except ValueError:
        raise ValueError(f"{ENV[k]}={values[k]!r} must be an int") from None
  return DistributedConfig(**values)


def initialize(config: DistributedConfig | None = None, *, local_device_ids=None) -> tuple[int, int]:
  """Calls ``jax.distributed.initialize`` once per process (before any JAX computation).

  Args:
    config: None reads the environment (``from_env``).
    local_device_ids: this process's devices (default: all visible ones).

  Returns:
    ``(jax.process_index(), jax.process_count())``.
  """
  config = from_env() if config is None else config
  jax.distributed.initialize(coordinator_address=config.coordinator_address,
                             num_processes=config.num_processes,
                             process_id=config.process_id, local_device_ids=local_device_ids)
  return jax.process_index(), jax.process_count()
