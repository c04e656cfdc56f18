"""Data parallelism: several engine replicas behind one scheduler front.

A ``("data", "model")`` mesh with data size R gives R replicas, one per mesh row
(``specjax.sharding.replica_meshes``): each is a full ``Engine`` with its own copy of
the (tensor-parallel on ``model``) weights, its own KV pool, scheduler and method
state. The front assigns every request to one replica when ``generate`` is called and
runs the replicas concurrently, one host thread each (their device calls overlap; JAX
dispatch is thread-safe). Requests never move between replicas, and a request's output
does not depend on its batch partners (greedy, or seeded per request: ``fold_in(key,
position)``), so each output equals a single replica's.

Policies: ``round_robin`` (request i -> replica i mod R) and ``least_loaded`` (in
request order, to the replica with the fewest assigned tokens, prompt + max_tokens,
ties to the lowest index), as a static-batch stand-in for vLLM/SGLang's DP routers.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from specjax import sharding
from specjax.config import EngineConfig
from specjax.engine import Engine
from specjax.metrics import RunMetrics
from specjax.request import Request, RequestOutput

__all__ = ["POLICIES", "DataParallelEngine", "assign"]

POLICIES = ("round_robin", "least_loaded")


def assign(requests: Sequence[Request], num_replicas: int, policy: str) -> list[int]:
  """The replica index of each request.

  Example: prompts of 10, 2, 2 tokens and max_tokens 4 each, 2 replicas, least_loaded:
  loads 14 | 0 -> 14 | 6 -> 14 | 12, i.e. [0, 1, 1]; round_robin gives [0, 1, 0].

  Raises:
    ValueError: unknown policy or ``num_replicas < 1``.
  """
  if policy not in POLICIES:
    raise ValueError(f"{policy=} must be one of {POLICIES}")
  if num_replicas < 1:
    raise ValueError(f"{num_replicas=} must be >= 1")
  if policy == "round_robin":
    return [i % num_replicas for i in range(len(requests))]
  load = np.zeros(num_replicas, np.int64)
  out = []
  for r in requests:
    i = int(np.argmin(load))
    load[i] += len(r.prompt_token_ids) + r.sampling.max_tokens
    out.append(i)
  return out


class DataParallelEngine:
  """R engine replicas (R = ``mesh.shape["data"]``), one request front.

  Args:
    target, method, draft, eos_token_ids, decode: as ``Engine``'s (shared by all
      replicas; each replica places its own copy of the weights).
    config: ``EngineConfig`` with ``mesh=None``; each replica gets ``config`` with its
      ``(1, model)`` sub-mesh.
    mesh: a ``("data", "model")`` mesh (``specjax.sharding.make_mesh``).
    policy: ``"round_robin"`` or ``"least_loaded"``.
    threads: run the replicas concurrently (one host thread each); False runs them one
      after another (same outputs).

  Raises:
    ValueError: ``config.mesh`` set, unknown policy, or what ``Engine`` raises.
  """

  def __init__(self, target, method, config: EngineConfig, mesh, *, draft=None,
               eos_token_ids: Sequence[int] = (), decode=None, policy: str = "least_loaded",
               threads: bool = True):
    if config.mesh is not None:
      raise ValueError("config.mesh must be None: DataParallelEngine gives each replica its "
                       "row of `mesh`")
    if policy not in POLICIES:
      raise ValueError(f"{policy=} must be one of {POLICIES}")
    self.mesh, self.policy, self.threads = mesh, policy, threads
    self.replicas = [
        Engine(target, method, config.replace(mesh=sub), draft=draft,
               eos_token_ids=eos_token_ids, decode=decode)
        for sub in sharding.replica_meshes(mesh)]

  @property
  def num_replicas(self) -> int:
    return len(self.replicas)

  def generate(self, requests: Sequence[Request]
               ) -> tuple[list[RequestOutput], list[RunMetrics]]:
    """Runs every request on its replica.

    Returns:
      ``(outputs in request order, one RunMetrics per replica)``. Replicas run in
      threads of one process, so each one's ``num_compiles`` / ``compile_s`` may include
      compiles of its neighbours (``CompileMonitor`` is process-wide).
    """
    where = assign(requests, self.num_replicas, self.policy)
    parts = [[r for r, w in zip(requests, where) if w == i] for i in range(self.num_replicas)]

    def run(i):
      return self.replicas[i].generate(parts[i]) if parts[i] else ([], RunMetrics())

    if self.threads and self.num_replicas > 1:
      with ThreadPoolExecutor(self.num_replicas) as pool:
        results = list(pool.map(run, range(self.num_replicas)))
    else:
      results = [run(i) for i in range(self.num_replicas)]
    by_id = {o.request_id: o for outs, _ in results for o in outs}
    return [by_id[r.request_id] for r in requests], [m for _, m in results]
