"""Ahead-of-time compiles of every step shape a workload can meet (``Engine.precompile``).

A shape is one jitted call's argument shapes and static plan: decode / verify steps
(``engine_step``: batch bucket x page-table bucket x step length x sampler) and prefill
calls (``forward_step``: batch bucket x prefill-length bucket x page-table bucket, plus
a fused proposer's own prefill). Every shape is then run once with all rows padding (no
KV, slot or proposer state changes), which puts its executable into the jitted
function's in-memory cache, so a later run of the workload compiles nothing.

With ``num_threads`` > 1 the shapes are first compiled in that many threads
(``jit(...).lower(...).compile()``: tracing holds the GIL, XLA's compile does not); JAX
keeps those executables in its in-process compilation cache, which the jitted calls of
the workload then reuse (JAX 0.10.2, CPU: a call after ``lower(x).compile()`` compiles
nothing, with or without the persistent cache), as long as they are traced under the
same thread-local config (the caller's matmul precision is re-entered in the workers).
On a CPU the padding runs are then skipped (each costs what a real call costs there),
but for a fused proposer's own prefill (with the target's padding prefill only where the
proposer reads its hidden states).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import os
from collections.abc import Callable, Sequence

import jax
import numpy as np

from pallas_kernels.paged_attention.metadata import AttentionMetadata
from specjax.batch import bucket, build_batch
from specjax.request import Request, RequestState
from specjax.slots import init_slots, padded_rows, write_slots
from specjax.steps import engine_step, forward_step

__all__ = ["default_num_threads", "prefill_shapes", "precompile"]


def _sampler_plans(engine, rows: list[RequestState], tree: bool) -> list[tuple]:
  """Every ``(sampler, fused implementation)`` a step of ``rows``' requests can run:
  a step holds any mix of the workload's sampling kinds (greedy, temperature only,
  top-k / top-p), so each non-empty subset of the kinds present is planned (at most 7)."""
  kinds = {}
  for st in rows:
    sp = st.request.sampling
    kinds.setdefault((sp.greedy, bool(sp.top_k) or sp.top_p < 1), st)
  plans = []
  for n in range(1, len(kinds) + 1):
    for subset in itertools.combinations(kinds.values(), n):
      plan = engine._sampler_plan(list(subset), tree)[:2]
      if plan not in plans:
        plans.append(plan)
  return plans


def default_num_threads() -> int:
  """Compile threads: the machine's cores, at most 16."""
  return max(1, min(16, os.cpu_count() or 1))


def prefill_shapes(requests: Sequence[Request], *, bucket: Callable, pages_bucket: Callable,
                   max_num_seqs: int, budget: int, min_bucket: int) -> list[tuple[int, int, int]]:
  """``(batch bucket, prefill length bucket, page-table bucket)`` of every prefill call
  ``Engine._prefill_rows`` can make for ``requests`` (first prefills; recompute after a
  preemption, which also prefills output tokens, is not covered).

  A prompt of P tokens prefills P - 1 in chunks of ``budget`` tokens and a remainder. A
  call's length bucket ``t`` is that of its longest chunk; its other rows are chunks of
  other requests no longer than that bucket, at most ``budget // t`` rows in all (one
  row always fits) and ``max_num_seqs``; its page table covers the furthest chunk end.
  Example: prompts of 40 and 700 tokens, budget 512, minimum bucket 16, page size 16
  (page-table buckets 4, 16, 64 pages), max_num_seqs 4: chunks (length, end) (39, 39),
  (512, 512), (187, 699), so calls (1, 64, 4), (1, 256, 64) and (2, 256, 64) (the 39 and
  187 chunks together), (1, 512, 64).
  """
  chunks = []  # (length bucket, end, request index)
  for i, r in enumerate(requests):
    n = len(r.prompt_token_ids) - 1
    for s in range(0, n, budget):
      e = min(s + budget, n)
      chunks.append((bucket(e - s, budget, min_bucket), e, i))
  shapes = set()
  for t in {c[0] for c in chunks}:
    lowest_end = min(e for b, e, _ in chunks if b == t)
    others = [(e, i) for b, e, i in chunks if b <= t]
    widths = {pages_bucket([e]) for e, _ in others if e >= lowest_end}
    rows = max(1, min(max_num_seqs, budget // t, len({i for _, i in others})))
    for n in range(1, rows + 1):
      for w in widths:
        shapes.add((bucket(n, max_num_seqs), t, w))
  return sorted(shapes)


# A row that write_slots drops (slot -1): compiles the slot-admission shapes.
_PADDING_ROW = RequestState(Request("padding", (0,)), np.zeros(2, np.uint32), [0])


def precompile(engine, requests: Sequence[Request], num_threads: int | None = None) -> int:
  """``Engine.precompile``'s work (see there); returns the number of shapes run."""
  cfg = engine.config
  steps_run = engine.k == 0 or engine.fused or (engine.caps.runs_on == "host"
                                                and not engine.caps.tree)
  most = max(min(len(r.prompt_token_ids) + r.sampling.max_tokens + engine.k + 1,
                 cfg.max_model_len) for r in requests)
  batches = sorted({cfg.decode_batch(n) for n in range(1, cfg.max_num_seqs + 1)})
  widths = sorted({engine._pages_bucket([n]) for n in range(1, most + cfg.page_size,
                                                            cfg.page_size)})
  if engine.caps.plans_verify:  # a fused step at the bucket of its largest verify cap
    plans = [(n, False) for n in sorted({bucket(i, engine.k) for i in range(1, engine.k + 1)})]
  elif engine.k == 0 or engine.fused:
    plans = [(engine.k, False)]
  else:
    plans = [(0, True)] + [(n, True) for n in sorted({bucket(i, engine.k)
                                                       for i in range(1, engine.k + 1)})]
  rows = [RequestState(r, np.zeros(2, np.uint32), list(r.prompt_token_ids)) for r in requests]
  tree = engine.fused and engine.caps.tree
  samplers = _sampler_plans(engine, rows, tree)
  engine.slots = engine._commit(init_slots(cfg.max_num_seqs, cfg.max_model_len,
                                           engine._num_stop_ids(requests),
                                           replay=cfg.acceptance_replay,
                                           replay_sources=cfg.replay_sources))
  if engine.fused:  # committed as in Engine.generate: the same placement signatures
    engine._pparams, engine._pstate = engine._commit(engine.method.init_device(engine.runtime))
  for n in sorted({padded_rows(i) for i in range(1, cfg.max_num_seqs + 1)}):
    engine.slots = write_slots(engine.slots, [-1] * n, [_PADDING_ROW] * n, engine.eos_ids)
    if engine.fused:
      engine._pstate = engine.method.reset_device(engine._pparams, engine._pstate,
                                                  np.full(n, -1, np.int32), np.zeros(n, np.int32))
      engine._pstate = engine.method.release_device(engine._pparams, engine._pstate,
                                                    engine.slots.tokens, np.full(n, -1, np.int32),
                                                    np.zeros(n, np.int32))

  decode = []
  if steps_run:
    for batch in batches:
      for width in widths:
        for (length, host), (sampler, fused) in itertools.product(plans, samplers):
          plan = engine._plan(sampler, fused, length, tree=tree and not host, host=host,
                              iterations=1 if host else cfg.steps_per_dispatch)
          sb = build_batch(batch=batch, width=width, length=length if host else 0,
                           page_tables=[], slots=[],
                           replay_source=[] if plan.replay_source_column else None,
                           verify_caps=[] if plan.verify_caps else None)
          decode.append((plan, sb))
  prefill = [_prefill_args(engine, *shape) for shape in prefill_shapes(
      requests, bucket=bucket, pages_bucket=engine._pages_bucket,
      max_num_seqs=cfg.max_num_seqs, budget=cfg.max_num_batched_tokens,
      min_bucket=cfg.min_prefill_bucket)]

  threads = default_num_threads() if num_threads is None else num_threads
  if threads > 1:
    lowerings = [lambda p=p, b=b: engine_step.lower(*engine._step_args(p, b)[0],
                                                    **engine._step_args(p, b)[1])
                 for p, b in decode]
    lowerings += [lambda a=a: forward_step.lower(*a[0], **a[1]) for a in prefill]
    # Config contexts are thread-local: the workers trace under the caller's matmul
    # precision (jax.default_matmul_precision around an evaluation), or the executables
    # would differ from the caller's and its calls would compile again.
    precision = jax.config.jax_default_matmul_precision

    def compile_one(lower):
      with jax.default_matmul_precision(precision) if precision else contextlib.nullcontext():
        lower().compile()

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
      list(pool.map(compile_one, lowerings))

  # Compiled in threads on a CPU, the steps' executables are in the in-process cache
  # already (tests/e2e/test_precompile.py: the run compiles nothing): the padding calls
  # would only run them, at a real prefill's cost each, so they run only where something
  # is left to compile: a fused proposer's own prefill, which needs the target's hidden
  # states only for the kinds that read them. On a GPU they cost milliseconds and stay:
  # with JAX 0.11.2 on the H200 a step's first call after ``compile()`` still registers
  # a compile event (0.1-0.2 ms), which the padding calls keep out of the measured steps.
  skip_padding = threads > 1 and jax.default_backend() == "cpu"
  needs_hidden = bool(engine.caps.target_hidden_layers)
  results = None
  if not skip_padding:
    for plan, sb in decode:
      results, _ = engine._dispatch(plan, sb)
  for args, kwargs, tokens, meta in prefill:  # args[2], the pool, was donated since
    hidden = ()
    if not skip_padding or (engine.fused and needs_hidden):
      engine.kv_caches, results, hidden = forward_step(args[0], args[1], engine.kv_caches,
                                                       *args[3:], **kwargs)
    if engine.fused:
      engine._pstate = engine.method.prefill_device(engine._pparams, engine._pstate, tokens,
                                                    meta, tuple(hidden))
  if results is not None:
    jax.block_until_ready(results)
  if engine.fused:  # padding calls change no proposer state: hand it back unchanged
    engine.method.end_device(engine.runtime, engine._pparams, engine._pstate)
  return len(decode) + len(prefill)


def _prefill_args(engine, batch: int, t_len: int, width: int):
  """``(args, kwargs, tokens, meta)`` of an all-padding ``forward_step`` of this shape
  (``args[2]`` is the KV pool; the padding rows write no KV: q_lens 0, pages -1)."""
  zeros = np.zeros(batch, np.int32)
  tokens = np.zeros((batch, t_len), np.int32)
  meta = AttentionMetadata(np.full((batch, width), -1, np.int32), zeros, zeros)
  args = (engine.target.graphdef, engine.target.params, engine.kv_caches, tokens, meta,
          zeros[:, None])
  kwargs = dict(hidden_layers=engine.caps.target_hidden_layers,
                implementation=engine.config.attention_implementation)
  return args, kwargs, tokens, meta
