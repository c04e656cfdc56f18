"""The engine: a Python host loop around one fused device step per iteration.

Each iteration admits arrived requests, prefills prompt chunks of several requests in
one call under a per-iteration token budget (KV only: the last prompt token stays
pending), asks the method for drafts, and makes ONE device call
(``specjax.steps.engine_step``): the target forward over ``[pending, d_1 .. d_L]`` per
row, verification / sampling and the tree-path KV fix-ups. The host gets one small
``i32[B, L+2]`` result and commits tokens one by one with the stop rules
(``specjax.commit``). L is the bucket of the longest draft proposed in the step, not k
(ragged speculation); a fused proposer's steps verify at k, or, for a method that plans
its verify caps (``Capabilities.plans_verify``, e.g. ``verify_skip``), at the bucket of
the largest cap it chose for the dispatch from the results read so far. Plain decoding steps run asynchronously: step n+1 is dispatched
(its pending tokens taken on the device from step n's output) before the host reads
step n, as vLLM's async scheduling does; a row that step n finishes has its step n+1
output discarded. Offline (all arrivals at 0) and online (Poisson arrival times) runs
share all of it.

A draft with ``parents`` is a tree (``specjax.tree``): the forward gets a tree mask and
depth positions, the tree sampler picks a path, and the path's KV (and hidden states)
are moved into commit order; the method never says which kind it is.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.paged_attention.metadata import AttentionMetadata
from specjax import precompile as _precompile
from specjax import sharding
from specjax.batch import bucket, build_batch
from specjax.commit import commit_rows
from specjax.config import AUTO_VERIFY_IMPLEMENTATION, EngineConfig
from specjax.kv_cache import page_table, pages_needed
from specjax.method import (
    Method,
    PrefillResult,
    ProposeContext,
    ReadResult,
    RuntimeInfo,
    VerifyResult,
)
from specjax.metrics import CompileMonitor, RunMetrics, StepRecord
from specjax.request import (
    Request,
    RequestOutput,
    RequestState,
    default_key_seed,
    truncate_at_stop,
)
from specjax.sampling import request_key
from specjax.scheduler import Scheduler
from specjax.slots import SlotAllocator, init_slots, padded_rows, write_slots
from specjax.steps import SplitModel, StepPlan, engine_step, forward_step, split_model
from specjax.tree import node_depths, tree_mask, tree_positions, validate_tree

__all__ = ["Engine", "bucket"]


class Engine:
  """Runs one method over a list of requests on one target model.

  Args:
    target: the target ``Transformer`` (NNX module).
    method: a ``methods.base.Method``.
    config: ``EngineConfig``.
    draft: the draft ``Transformer`` for methods that need one.
    eos_token_ids: ids that end generation unless a request sets ``ignore_eos``.
    decode: token ids -> text (needed for stop strings and output text).

  Raises:
    ValueError: a method needing a draft model without one; draft/target vocab mismatch.
  """

  def __init__(
      self,
      target,
      method: Method,
      config: EngineConfig,
      *,
      draft=None,
      eos_token_ids: Sequence[int] = (),
      decode: Callable[[list[int]], str] | None = None,
  ):
    self.config = config
    self.method = method
    self.caps = method.capabilities()
    self.target = target if isinstance(target, SplitModel) else split_model(target)
    self.draft = None
    if draft is not None:
      self.draft = draft if isinstance(draft, SplitModel) else split_model(draft)
    self.mesh = config.mesh
    if self.mesh is not None:
      self.target = sharding.shard_model(self.target, self.mesh)
      if self.draft is not None:
        self.draft = sharding.shard_model(
            self.draft, self.mesh, replicated=config.draft_sharding == "replicated")
        k, m = self.draft.config.num_kv_heads, self.mesh.shape["model"]
        if config.draft_sharding == "sharded" and k % m:
          raise ValueError(f"draft_sharding='sharded' needs the draft's num_kv_heads={k} to "
                           f"be a multiple of the model axis size {m} (its method allocates "
                           "an unrepeated KV pool); use draft_sharding='replicated'")
    if draft is not None:
      if self.draft.config.vocab_size != self.target.config.vocab_size:
        raise ValueError(
            f"draft vocab_size={self.draft.config.vocab_size} must equal target "
            f"vocab_size={self.target.config.vocab_size} (draft and target must share a tokenizer)"
        )
    if self.caps.needs_draft_model and self.draft is None:
      raise ValueError(f"method {method.name!r} needs a draft model (--draft)")
    self.eos_ids = frozenset(int(t) for t in eos_token_ids)
    self.decode = decode
    self.k = method.num_speculative_tokens
    if self.caps.runs_on not in ("host", "device", "fused"):
      raise ValueError(f"method {method.name!r}: Capabilities.runs_on={self.caps.runs_on!r} "
                       "must be 'host', 'device' or 'fused'")
    self.fused = self.caps.runs_on == "fused"
    if self.caps.plans_verify and not self.fused:
      raise ValueError(f"method {method.name!r}: Capabilities.plans_verify needs runs_on='fused', "
                       f"not {self.caps.runs_on!r}")
    CompileMonitor.install()
    self.kv_caches = sharding.init_kv_pool(self.target, config.total_pages, config.page_size,
                                           self.mesh)
    cfg = self.target.config
    itemsize = jnp.dtype(self.kv_caches.dtype).itemsize
    # The pool's own head count: KV heads repeated under tensor parallelism cost memory.
    self.kv_bytes_per_token = cfg.num_layers * self.kv_caches.shape[2] * cfg.head_dim * itemsize
    self.runtime = RuntimeInfo(
        target=self.target, draft=self.draft, num_pages=config.total_pages,
        page_size=config.page_size, max_model_len=config.max_model_len,
        attention_implementation=config.attention_implementation,
        max_num_seqs=config.max_num_seqs,
    )

  # ------------------------------------------------------------------ helpers
  def _validate(self, requests: Sequence[Request]) -> None:
    seen = set()
    for r in requests:
      if r.request_id in seen:
        raise ValueError(f"request_id={r.request_id!r} is duplicated")
      seen.add(r.request_id)
      n = len(r.prompt_token_ids)
      if n < 1:
        raise ValueError(f"request {r.request_id!r}: prompt must have >= 1 token")
      if n >= self.config.max_model_len:
        raise ValueError(
            f"request {r.request_id!r}: prompt length {n} must be < max_model_len="
            f"{self.config.max_model_len} (room for at least one generated token)"
        )
      sp = r.sampling
      if sp.stop and self.decode is None:
        raise ValueError(
            f"request {r.request_id!r}: stop={sp.stop!r} needs a detokenizer; this engine "
            "was built without decode= (pass one, or use stop_token_ids)")
      if self.config.verify_implementation not in (None, "auto") and (sp.top_k or sp.top_p < 1):
        raise ValueError(
            f"request {r.request_id!r}: top_k={sp.top_k}, top_p={sp.top_p} need the jnp "
            f"rejection sampler; verify_implementation={self.config.verify_implementation} "
            "handles temperature only (set it to 'auto' or None)")
      vocab = self.target.config.vocab_size
      if min(r.prompt_token_ids) < 0 or max(r.prompt_token_ids) >= vocab:
        raise ValueError(f"request {r.request_id!r}: token ids must be in [0, {vocab})")
      self._validate_replay(r)

  def _validate_replay(self, r: Request) -> None:
    """``Request.replay_acc_len`` is given exactly when the engine replays acceptance,
    with an entry >= 1 for every output position ``max_tokens`` allows, and
    ``Request.replay_sources`` holds ``EngineConfig.replay_sources - 1`` such traces."""
    acc = r.replay_acc_len
    if not self.config.acceptance_replay:
      if acc is not None or r.replay_sources:
        raise ValueError(f"request {r.request_id!r} carries replay_acc_len but the engine "
                         "does not replay acceptance (EngineConfig.acceptance_replay=False)")
      return
    if len(r.replay_sources) != self.config.replay_sources - 1:
      raise ValueError(f"request {r.request_id!r}: {len(r.replay_sources)} replay_sources; "
                       f"the engine replays {self.config.replay_sources} sources, so it must "
                       f"be {self.config.replay_sources - 1}")
    need = min(r.sampling.max_tokens, self.config.max_model_len - len(r.prompt_token_ids))
    for name, trace in (("replay_acc_len", acc), *(
        (f"replay_sources[{i}]", a) for i, a in enumerate(r.replay_sources))):
      if trace is None or len(trace) < need or (len(trace) and min(trace) < 1):
        got = (None if trace is None
               else f"{len(trace)} entries, min {min(trace, default=None)}")
        raise ValueError(
            f"request {r.request_id!r}: {name} must hold >= {need} entries >= 1 (one "
            f"per output position up to max_tokens), got {got}")

  def _sampler_plan(self, rows: list[RequestState], is_tree: bool):
    """``(sampler, fused implementation, jnp_rows)`` of a step (``StepPlan.sampler``;
    see ``EngineConfig.verify_implementation``). Under "auto" a step that mixes
    temperature-only and top-k/top-p requests runs both samplers and each row takes
    its own one's result (the device picks the rows from their slots' top-k / top-p;
    ``jnp_rows`` is the host's view of that choice), so a request is sampled the same way
    whatever its partners.

    Raises:
      NotImplementedError: an explicitly named fused implementation and a tree draft.
    """
    impl = self.config.verify_implementation
    if all(st.request.sampling.greedy for st in rows) and (impl in (None, "auto") or is_tree):
      return "greedy", AUTO_VERIFY_IMPLEMENTATION, None
    if impl == "auto":
      if is_tree:
        return "jnp", AUTO_VERIFY_IMPLEMENTATION, None
      jnp_rows = np.array([bool(st.request.sampling.top_k) or st.request.sampling.top_p < 1
                           for st in rows])
      if jnp_rows.all():
        return "jnp", AUTO_VERIFY_IMPLEMENTATION, None
      if jnp_rows.any():
        return "fused+jnp", AUTO_VERIFY_IMPLEMENTATION, jnp_rows
      return "fused", AUTO_VERIFY_IMPLEMENTATION, None
    if impl is None:
      return "jnp", AUTO_VERIFY_IMPLEMENTATION, None
    if is_tree:
      raise NotImplementedError(
          f"verify_implementation={impl} verifies chains only; this method drafted a tree "
          "(use verify_implementation='auto' or None)")
    return "fused", tuple(impl), None

  def _pages_bucket(self, num_tokens: list[int]) -> int:
    # Page-table width buckets grow 4x (4, 16, 64, ... pages): fewer step shapes to
    # compile for a slightly wider (masked) attention gather.
    need = max(pages_needed(n, self.config.page_size) for n in num_tokens)
    return bucket(need, self.config.pages_per_seq, minimum=4, growth=4)

  # ------------------------------------------------------------------ prefill
  def _prefill_rows(self, rows: list[RequestState]) -> list[tuple[RequestState, int, int]]:
    """Chooses this iteration's prefill chunks ``(state, start, end)``: rows in order,
    each chunk at most ``max_num_batched_tokens`` long, while the padded call (rows x
    the bucket of the longest chunk) stays within that budget; the first row always
    gets a chunk. E.g. budget 512 and remaining prompt lengths [40, 1334]: the first
    call is [40] alone (2 rows x bucket(512) > 512), the long prompt follows in chunks
    of 512, 512 and 310 in the next iterations, one per engine step."""
    cfg = self.config
    budget = cfg.max_num_batched_tokens
    chosen = []
    longest = 0
    for st in rows:
      start, end = st.num_computed, len(st.tokens) - 1
      chunk = min(end - start, budget)
      t_len = bucket(max(longest, chunk), budget, cfg.min_prefill_bucket)
      if chosen and ((len(chosen) + 1) * t_len > budget
                     or len(chosen) + 1 > cfg.max_num_seqs):
        break
      chosen.append((st, start, start + chunk))
      longest = max(longest, chunk)
    return chosen

  def _prefill(self, chunks, metrics: RunMetrics, method_state):
    """Writes KV for the chunks' tokens (one call; no sampling). Methods that read
    target hidden states get them through ``observe_prefill``. Returns the method state."""
    cfg = self.config
    rows = [st for st, _, _ in chunks]
    t_len = bucket(max(e - s for _, s, e in chunks), cfg.max_num_batched_tokens,
                   cfg.min_prefill_bucket)
    batch = bucket(len(rows), cfg.max_num_seqs)
    tokens = np.zeros((batch, t_len), np.int32)
    q_lens = np.zeros(batch, np.int32)
    kv_lens = np.zeros(batch, np.int32)
    for i, (st, s, e) in enumerate(chunks):
      tokens[i, : e - s] = st.tokens[s:e]
      q_lens[i], kv_lens[i] = e - s, e
    width = self._pages_bucket([e for _, _, e in chunks])
    meta = AttentionMetadata(page_table([st.page_array() for st in rows], batch, width),
                             kv_lens, q_lens)
    snap = CompileMonitor.snapshot()
    t0 = time.perf_counter()
    self.kv_caches, logits, hidden = forward_step(
        self.target.graphdef, self.target.params, self.kv_caches, tokens, meta,
        np.maximum(q_lens - 1, 0)[:, None], hidden_layers=self.caps.target_hidden_layers,
        implementation=cfg.attention_implementation,
    )
    if self.fused:  # e.g. a draft model fills its own KV with the same chunk
      self._pstate = self.method.prefill_device(self._pparams, self._pstate, tokens, meta,
                                                tuple(hidden))
    jax.block_until_ready(logits)
    t1 = time.perf_counter()
    metrics.prefill_s += t1 - t0
    if CompileMonitor.snapshot() != snap:
      metrics.compile_windows.append((t0 - self._run_start, t1 - self._run_start))
      metrics.prefill_compiled_s += t1 - t0
      metrics.prefill_compiled_tokens += int(q_lens.sum())
    metrics.num_prefill_tokens += int(q_lens.sum())
    metrics.prefill_calls.append(int(q_lens.sum()))
    for st, _, e in chunks:
      st.num_computed = e
    if self.caps.target_hidden_layers and not self.fused:
      method_state = self.method.observe_prefill(method_state, PrefillResult(
          request_ids=[st.request.request_id for st in rows],
          starts=np.asarray([s for _, s, _ in chunks], np.int32),
          num_tokens=q_lens[: len(rows)].copy(), target_hidden=hidden,
      ))
    return method_state

  def _commit(self, tree):
    """Fresh device state committed to its device (``sharding.commit``: one compiled
    placement signature per step shape); on a mesh as created (``place_state`` and the
    jitted steps place it)."""
    return sharding.commit(tree) if self.mesh is None else tree

  def _budget(self, st: RequestState) -> int:
    sp = st.request.sampling
    return max(0, min(self.k, self.config.max_model_len - len(st.tokens),
                      sp.max_tokens - st.num_output - 1))

  def _kv_extent(self, st: RequestState, ahead: int) -> int:
    """KV positions a row may have written after ``ahead`` more tokens: at most
    ``len(tokens) + ahead``, and never past ``max_model_len`` or its last possible
    pending token (prompt + max_tokens - 1: a step writes the pending token and at most
    its budget of drafts)."""
    limit = min(self.config.max_model_len, st.num_prompt + st.request.sampling.max_tokens - 1)
    return max(len(st.tokens), min(len(st.tokens) + ahead, limit))

  @property
  def runs_ahead(self) -> bool:
    """Steps are dispatched before the previous one is read: plain decoding and fused
    proposers under ``EngineConfig.async_scheduling``."""
    return self.config.async_scheduling and (self.k == 0 or self.fused)

  # ------------------------------------------------------------------ main loop
  def generate(self, requests: Sequence[Request], progress=None):
    """Runs all requests to completion.

    Args:
      requests: the workload; ``arrival_time`` > 0 gives online (timed) arrivals.
      progress: optional callable ``(num_new_output_tokens) -> None`` (e.g. tqdm.update).

    Returns:
      ``(outputs: list[RequestOutput] in request order, metrics: RunMetrics)``.

    Raises:
      ValueError: a bad request (``_validate``) or a bad draft from the method.
    """
    self._validate(requests)
    self._progress = progress
    cfg = self.config
    sched = Scheduler(cfg, reserve_tokens=self.k + 1)
    states = []
    for r in requests:
      if r.sampling.seed is not None:
        seed = r.sampling.seed
      else:  # fresh per submission: the same request id sent again samples anew
        seed = default_key_seed(cfg.seed, (self._num_submitted, r.request_id))
      self._num_submitted += 1
      st = RequestState(r, np.asarray(request_key(seed)), list(r.prompt_token_ids))
      states.append(st)
      sched.add(st)
    self.slots = self._commit(init_slots(cfg.max_num_seqs, cfg.max_model_len,
                                         self._num_stop_ids(requests),
                                         replay=cfg.acceptance_replay,
                                         replay_sources=cfg.replay_sources))
    self._slot_free = SlotAllocator(cfg.max_num_seqs)
    method_state = self.method.init_state(self.runtime)
    if self.mesh is not None:  # a draft's KV pool, a head's weights: onto the mesh
      method_state = sharding.place_state(method_state, self.mesh, self.target.config,
                                          sharded=cfg.draft_sharding == "sharded")
    # A fused method's host state (Capabilities.plans_verify: plan_verify / observe_read).
    self._method_state = method_state
    self._released: list[tuple[int, int]] = []
    if self.fused:
      self._pparams, self._pstate = self._commit(self.method.init_device(self.runtime))
      if self.mesh is not None:
        self._pparams, self._pstate = sharding.place_state(
            (self._pparams, self._pstate), self.mesh, self.target.config,
            sharded=cfg.draft_sharding == "sharded")
    metrics = RunMetrics(kv_bytes_per_token=self.kv_bytes_per_token)
    c0, s0 = CompileMonitor.snapshot()
    start = self._run_start = time.perf_counter()
    self._window = (start, CompileMonitor.snapshot())
    self._inflight: list[dict] = []
    seen_by_method: set = set()
    while sched.has_work:
      now = time.perf_counter() - start
      sched.admit(now)
      need = [st for st in sched.running if st.num_computed < len(st.tokens) - 1]
      if need:
        # Chunked prefill: at most max_num_batched_tokens (padded) per iteration, so a
        # long prompt delays the running requests by one chunk per step.
        self._drain(sched, metrics, start)
        method_state = self._prefill(self._prefill_rows(need), metrics, method_state)
        self._window = (time.perf_counter(), CompileMonitor.snapshot())
      ready = [st for st in sched.running if st.num_computed >= len(st.tokens) - 1]
      if not ready:
        if self._inflight:
          self._drain(sched, metrics, start)
        elif not sched.running:
          nxt = sched.next_arrival()
          time.sleep(max(0.0, nxt - now) if nxt is not None else 0.0)
          self._window = (time.perf_counter(), CompileMonitor.snapshot())
        continue
      if self.fused or self.k == 0:  # runs ahead unless async_scheduling is off
        self._device_step(sched, metrics, start)
      else:
        self._drain(sched, metrics, start)
        method_state = self._host_step(sched, method_state, metrics, start, seen_by_method)
    self._drain(sched, metrics, start)
    if self.fused:
      self._flush_released()
      self.method.end_device(self.runtime, self._pparams, self._pstate)
    metrics.wall_s = time.perf_counter() - start
    c1, s1 = CompileMonitor.snapshot()
    metrics.num_compiles, metrics.compile_s = c1 - c0, s1 - s0
    metrics.num_preemptions = sched.num_preemptions
    assert sched.allocator.num_used == 0, "pages leaked"
    return [self._output(st, start) for st in states], metrics

  _num_submitted = 0
  _progress = None
  _run_start = 0.0

  # ------------------------------------------------------------------ compiles
  def precompile(self, requests: Sequence[Request], num_threads: int | None = None) -> int:
    """Compiles every step shape ``requests`` can meet (``specjax.precompile``), by
    running calls whose rows are all padding (no KV, slot or draft state changes):

    * decode / verify steps: each batch bucket up to ``max_num_seqs`` x each page-table
      bucket up to the longest request's prompt + ``max_tokens`` x the step lengths the
      method uses (fused methods and plain decoding: one; host drafters: 0 and every
      bucket up to k; fused methods that plan their verify caps: every bucket up to k) x the sampler of the requests taken together (a step of a subset
      of mixed greedy / sampled requests can need another). Methods whose steps take
      device drafts or draft probabilities from a host-called proposer (learned heads,
      the host-called draft model, trees) are skipped: their shapes depend on the drafts.
    * prefill calls: every (batch, prefill length, page-table) bucket the chunked
      prefill of these prompts can make (``specjax.precompile.prefill_shapes``), with a
      fused proposer's own prefill.

    The shapes are compiled first in ``num_threads`` threads (default
    ``specjax.precompile.default_num_threads()``; 1: one by one, by the padding calls). Afterwards a run of these requests compiles nothing, unless a
    preemption recomputes a prefill longer than any prompt. Returns the number of
    shapes run.
    """
    self._validate(requests)
    return _precompile.precompile(self, requests, num_threads)

  # ------------------------------------------------------------------ slots
  def _num_stop_ids(self, requests) -> int:
    """E, the slot state's stop-id width: a power of two >= 8 holding every request's
    EOS + stop ids (one width per workload size class: few recompiles)."""
    need = max((len(set(r.sampling.stop_token_ids) | (set() if r.sampling.ignore_eos
                                                       else set(self.eos_ids)))
                for r in requests), default=0)
    return bucket(need, max(8, need), minimum=8)

  def _assign_slots(self, rows: list[RequestState]) -> None:
    """Gives decode-ready rows without a slot one, and writes their state (one call)."""
    self._flush_released()
    fresh = [st for st in rows if st.slot is None]
    if fresh:
      for st in fresh:
        st.slot = self._slot_free.allocate()
      self.slots = write_slots(self.slots, [st.slot for st in fresh], fresh, self.eos_ids)
      if self.fused:
        n = padded_rows(len(fresh))
        slots, lens = np.full(n, -1, np.int32), np.zeros(n, np.int32)
        slots[: len(fresh)] = [st.slot for st in fresh]
        lens[: len(fresh)] = [len(st.tokens) for st in fresh]
        self._pstate = self.method.reset_device(self._pparams, self._pstate, slots, lens)

  def _flush_released(self) -> None:
    """Hands the slots given up since the last call to the fused proposer
    (``Method.release_device``, one call), before any of them is written again."""
    if not self._released:
      return
    n = padded_rows(len(self._released))
    slots, lens = np.full(n, -1, np.int32), np.zeros(n, np.int32)
    slots[: len(self._released)], lens[: len(self._released)] = zip(*self._released)
    self._released = []
    self._pstate = self.method.release_device(self._pparams, self._pstate, self.slots.tokens,
                                              slots, lens)

  def _release(self, sched: Scheduler, st: RequestState, *, preempted: bool = False) -> None:
    if st.slot is not None:
      if self.fused:
        self._released.append((st.slot, len(st.tokens)))
      self._slot_free.free(st.slot)
      st.slot = None
    st.inflight_tokens = 0
    if not preempted:
      sched.finish(st)

  # ------------------------------------------------------------------ steps
  def _plan(self, sampler, fused_impl, length, *, tree=False, probs=False, host=True,
            iterations=1) -> StepPlan:
    return StepPlan(
        length=length, k=self.k, sampler=sampler, tree=tree, host_drafts=host,
        verify_caps=self.caps.plans_verify and not host,
        num_iterations=iterations, fused_implementation=tuple(fused_impl),
        attention_implementation=self.config.attention_implementation,
        hidden_layers=self.caps.target_hidden_layers if host else (),
        proposer_hidden_layers=() if host else self.caps.target_hidden_layers,
        has_draft_probs=probs, synthetic_acceptance=self.config.synthetic_acceptance,
        replay=self.config.acceptance_replay, replay_sources=self.config.replay_sources,
        num_layers=self.target.config.num_layers)

  def _step_args(self, plan, batch, draft_tokens=None, draft_probs=None, tree_arrays=None):
    """``(args, kwargs)`` of the ``engine_step`` call of this plan and batch."""
    proposer = self.method if self.fused and not plan.host_drafts else None
    pparams, pstate = ((self._pparams, self._pstate) if proposer is not None else ((), ()))
    return ((self.target.graphdef, self.target.params, self.kv_caches, self.slots, pparams,
             pstate, batch.ints, draft_tokens, draft_probs, tree_arrays),
            dict(plan=plan, proposer=proposer))

  def _dispatch(self, plan, batch, draft_tokens=None, draft_probs=None, tree_arrays=None):
    """One ``engine_step`` call; returns ``(results i32[N, B, L+3], hidden)`` (device
    arrays) without waiting."""
    args, kwargs = self._step_args(plan, batch, draft_tokens, draft_probs, tree_arrays)
    self.kv_caches, self.slots, pstate, results, hidden = engine_step(*args, **kwargs)
    if kwargs["proposer"] is not None:
      self._pstate = pstate
    return results, hidden

  def _record(self, metrics, rows, batch_bucket, length, width, num_draft, res, times,
              host_extra=0.0, compiled=None):
    """Appends the StepRecord of a committed step; ``times`` = (window start, draft_s,
    verify_s, end) and the step's compile flag comes from its wall window (or
    ``compiled``: every iteration of one call shares the call's flag)."""
    t_start, draft_s, verify_s, t_end = times
    snap = CompileMonitor.snapshot()
    if compiled is None:
      compiled = snap != self._window[1]
    metrics.steps.append(StepRecord(
        num_rows=len(rows), batch_bucket=batch_bucket, query_bucket=length + 1,
        pages_bucket=width, num_draft_tokens=int(np.sum(num_draft[: len(rows)])),
        num_accepted=res.num_accepted, num_emitted=res.num_emitted,
        accepted_per_position=res.accepted_per_position,
        drafted_per_position=res.drafted_per_position,
        draft_s=draft_s, verify_s=verify_s, rejection_s=0.0,
        host_s=max(0.0, (t_end - t_start) - draft_s - verify_s) + host_extra,
        step_s=t_end - t_start, compiled=compiled,
    ))
    if compiled:
      metrics.compile_windows.append((t_start - self._run_start, t_end - self._run_start))
    self._window = (t_end, snap)
    if self._progress is not None:
      self._progress(res.num_emitted)

  def _device_step(self, sched, metrics, start):
    """Plain decoding or a fused proposer: dispatches ``steps_per_dispatch`` iterations
    from the device state, then (running ahead) reads and commits the call before it.

    Pages are reserved for the most tokens each row can gain in every call in flight
    (``(L + 1)`` per iteration) and trimmed after the read. Under page pressure the
    calls in flight are drained first, so preemption sees committed tokens.
    """
    cfg = self.config
    length = self.k
    iterations = cfg.steps_per_dispatch
    advance = iterations * (length + 1)
    rows = [st for st in sched.running if st.num_computed >= len(st.tokens) - 1]
    extra = {st.request.request_id: self._kv_extent(st, st.inflight_tokens + advance)
             - len(st.tokens) for st in rows}
    if sched.pages_short(extra):
      self._drain(sched, metrics, start)
      rows = [st for st in sched.running if st.num_computed >= len(st.tokens) - 1]
      extra = {st.request.request_id: self._kv_extent(st, advance) - len(st.tokens)
               for st in rows}
      for victim in sched.reserve_step(extra):
        self._release(sched, victim, preempted=True)
      rows = [st for st in rows if st in sched.running]
      if not rows:
        return
    else:
      assert not sched.reserve_step(extra), "pages_short said the step fits"
    self._assign_slots(rows)
    t0 = time.perf_counter()
    caps = info = None
    if self.caps.plans_verify:  # pages stay reserved for k (an upper bound)
      caps, info = self._verify_plan(rows)
      length = bucket(max(1, int(caps.max(initial=0))), self.k)
    batch = cfg.decode_batch(len(rows))
    ends = [len(st.tokens) + extra[st.request.request_id] for st in rows]
    width = self._pages_bucket(ends)
    tree = self.fused and self.caps.tree
    sampler, fused, _ = self._sampler_plan(rows, tree)
    sb = build_batch(batch=batch, width=width, length=0,
                     page_tables=[st.page_array()[: pages_needed(n, cfg.page_size)]
                                  for st, n in zip(rows, ends)],
                     slots=[st.slot for st in rows], verify_caps=caps)
    plan = self._plan(sampler, fused, length, tree=tree, host=False, iterations=iterations)
    results, _ = self._dispatch(plan, sb)
    for st in rows:
      st.inflight_tokens += advance
    self._inflight.append({"rows": rows, "results": results, "batch": batch, "width": width,
                           "length": length, "advance": advance, "tree": tree,
                           "caps": caps, "plan_info": info,
                           "dispatch_s": time.perf_counter() - t0})
    depth = 1 if self.runs_ahead else 0
    while len(self._inflight) > depth:
      self._read_oldest(sched, metrics, start)

  def _verify_plan(self, rows: list[RequestState]) -> tuple[np.ndarray, object]:
    """``(caps i32[rows], info)`` of the method's ``plan_verify`` for a fused dispatch.

    Raises:
      ValueError: caps of the wrong shape or outside ``[0, k]``.
    """
    ids = [st.request.request_id for st in rows]
    budgets = np.asarray([self._budget(st) for st in rows], np.int32)
    self._method_state, vplan = self.method.plan_verify(self._method_state, ids, budgets)
    caps = np.asarray(vplan.caps)
    if (caps.shape != (len(rows),) or not np.issubdtype(caps.dtype, np.integer)
        or (caps < 0).any() or (caps > self.k).any()):
      raise ValueError(f"method {self.method.name!r}: VerifyPlan.caps={caps.tolist()} must "
                       f"hold one integer cap in [0, {self.k}] per row ({len(rows)} rows)")
    return caps.astype(np.int32), vplan.info

  def _drain(self, sched, metrics, start) -> None:
    """Reads and commits every call in flight."""
    while self._inflight:
      self._read_oldest(sched, metrics, start)

  def _read_oldest(self, sched, metrics, start) -> None:
    """Waits for the oldest call in flight and commits its iterations in order; rows
    that ended (on the host: stop strings too) have their later work discarded. The
    call's wall time (since the last commit) is split evenly over its iterations."""
    call = self._inflight.pop(0)
    results = np.asarray(call["results"])
    t_start, snap0 = self._window
    rows = call["rows"]
    now = time.perf_counter() - start
    commits = []
    for result in results:
      skip = [st.finish_reason is not None or result[i, -1] < 0 for i, st in enumerate(rows)]
      num_draft = result[: len(rows), -2]
      reach = result[: len(rows), -3] if call["tree"] else None
      # The budgets this iteration had on the device (the earlier ones are committed).
      budgets = [self._budget(st) for st in rows] if call["caps"] is not None else None
      res = commit_rows(rows, result, num_draft, k=self.k, eos_ids=self.eos_ids,
                        max_model_len=self.config.max_model_len, decode=self.decode,
                        now=now, reach=reach, skip=skip)
      for st in res.finished:
        self._release(sched, st)
      if budgets is not None:
        self._observe_read(call, result, rows, skip, budgets, res.finished)
      committed = [st for st, s in zip(rows, skip) if not s]
      if committed:  # else every row ended before: its time joins the next step's
        commits.append((committed, np.asarray([d for d, s in zip(num_draft, skip) if not s]),
                        res))
    for st in rows:
      if st.finish_reason is None and st.slot is not None:
        st.inflight_tokens -= call["advance"]
        sched.trim(st, len(st.tokens) + st.inflight_tokens + self.k + 1)
    if not commits:
      return
    t_done = time.perf_counter()
    compiled = CompileMonitor.snapshot() != snap0
    per_step = (t_done - t_start) / len(commits)
    for i, (committed, num_draft, res) in enumerate(commits):
      self._record(metrics, committed, call["batch"], call["length"], call["width"], num_draft,
                   res, (t_start + i * per_step, 0.0, call["dispatch_s"] / len(results),
                         t_start + (i + 1) * per_step), compiled=compiled)

  def _observe_read(self, call, result, rows, skip, budgets, finished) -> None:
    """Hands one read iteration of a ``plans_verify`` dispatch to ``Method.observe_read``
    (the rows it committed)."""
    live = [i for i, s in enumerate(skip) if not s]
    if not live:
      return
    self._method_state = self.method.observe_read(self._method_state, ReadResult(
        request_ids=[rows[i].request.request_id for i in live],
        num_accepted=result[live, -1].copy(), num_verified=result[live, -2].copy(),
        budgets=np.asarray([budgets[i] for i in live], np.int32),
        caps=call["caps"][live], plan_info=call["plan_info"],
        finished=frozenset(st.request.request_id for st in finished)))

  def _validate_draft(self, draft, rows: int, budgets: np.ndarray) -> np.ndarray:
    """Checks a method's ``Draft`` and returns the verified counts ``i32[rows]``
    (``min(num_tokens, budget)``: the engine keeps the first nodes within the budget).

    Raises:
      ValueError: counts outside ``[0, tokens.shape[1]]``, or (host drafts) a counted id
        outside ``[0, vocab)``.
    """
    num = np.asarray(draft.num_tokens)
    width = draft.tokens.shape[1]
    if num.shape[0] < rows or (num[:rows] < 0).any() or (num[:rows] > width).any():
      raise ValueError(f"method {self.method.name!r}: Draft.num_tokens={num[:rows].tolist()} "
                       f"must be in [0, {width}] (the draft's width) for each of {rows} rows")
    kept = np.minimum(num[:rows], budgets).astype(np.int32)
    if isinstance(draft.tokens, np.ndarray):
      vocab = self.target.config.vocab_size
      for i in range(rows):
        ids = draft.tokens[i, : kept[i]]
        if ids.size and (ids.min() < 0 or ids.max() >= vocab):
          raise ValueError(f"method {self.method.name!r}: row {i} drafted ids {ids.tolist()}; "
                           f"counted draft tokens must be in [0, {vocab})")
    return kept

  @staticmethod
  def _replay_acceptance(rows) -> np.ndarray:
    """``VerifyResult.replay_acceptance`` of a host-path step, before its commit: per row
    and source, the recorded trace at the row's output position minus 1 (1 past a
    trace's end, as ``specjax.slots.SlotState.replay_acc`` pads it)."""
    out = []
    for st in rows:
      i = st.num_output
      traces = (st.request.replay_acc_len, *st.request.replay_sources)
      out.append([(t[i] if i < len(t) else 1) - 1 for t in traces])
    return np.asarray(out, np.int32).reshape(len(rows), -1)

  def _replay_source(self, draft, rows: int):
    """The batch's replay-source column (``EngineConfig.replay_sources`` > 1): the
    method's ``Draft.replay_source`` (default 0 per row), else None (no column).

    Raises:
      ValueError: a source outside ``[0, replay_sources)``.
    """
    n = self.config.replay_sources
    if not (self.config.acceptance_replay and n > 1):
      return None
    if draft.replay_source is None:
      return np.zeros(rows, np.int32)
    src = np.asarray(draft.replay_source, np.int32)[:rows]
    if src.shape != (rows,) or (src < 0).any() or (src >= n).any():
      raise ValueError(f"method {self.method.name!r}: Draft.replay_source={src.tolist()} must "
                       f"hold one source in [0, {n}) per row ({rows} rows)")
    return src

  def _host_step(self, sched, method_state, metrics, start, seen_by_method):
    """One synchronous step of a method whose ``propose`` the host calls: propose, one
    fused device call (drafts from the host), commit, observe."""
    cfg = self.config
    t_begin = self._window[0]
    budgets = {st.request.request_id: self._budget(st) for st in sched.running}
    for victim in sched.reserve_step(budgets):
      seen_by_method.discard(victim.request.request_id)
      self._release(sched, victim, preempted=True)
    rows = [st for st in sched.running if st.num_computed >= len(st.tokens) - 1]
    self._assign_slots(rows)
    batch = cfg.decode_batch(len(rows))
    width = self._pages_bucket([len(st.tokens) + budgets[st.request.request_id]
                                for st in rows])
    table = page_table([st.page_array() for st in rows], batch, width)
    temp = np.zeros(batch, np.float32)
    top_k = np.zeros(batch, np.int32)
    top_p = np.ones(batch, np.float32)
    keys = np.zeros((batch, 2), np.uint32)
    for i, st in enumerate(rows):
      sp = st.request.sampling
      temp[i], top_k[i], top_p[i], keys[i] = sp.temperature, sp.top_k, sp.top_p, st.key
    ids = [st.request.request_id for st in rows]
    new = frozenset(i for i in ids if i not in seen_by_method)
    seen_by_method.update(ids)
    ctx = ProposeContext(
        request_ids=ids, token_ids=[st.token_array() for st in rows],
        budgets=np.asarray([budgets[i] for i in ids], np.int32), page_indices=table,
        temperature=temp, top_k=top_k, top_p=top_p, keys=keys, new_requests=new,
    )
    if self.caps.drafts_in_target_kv:  # the method drafts into (and donates) the pool
      ctx.kv_caches, self.kv_caches = self.kv_caches, None
    t0 = time.perf_counter()
    method_state, draft = self.method.propose(method_state, ctx)
    if self.caps.drafts_in_target_kv:
      if draft.kv_caches is None:
        raise ValueError(f"method {self.method.name!r} declares drafts_in_target_kv and "
                         "must return the KV pool as Draft.kv_caches")
      self.kv_caches = draft.kv_caches
    if draft.probs is not None:
      jax.block_until_ready(draft.probs)
    t1 = time.perf_counter()
    kept = self._validate_draft(draft, len(rows), ctx.budgets)
    num_draft = np.zeros(batch, np.int32)
    num_draft[: len(rows)] = kept
    longest = int(num_draft.max(initial=0))
    length = bucket(longest, self.k) if longest else 0
    is_tree = draft.parents is not None and length > 0
    lens = [len(st.tokens) for st in rows]
    host_drafts = None
    device_drafts = None
    if length:
      if isinstance(draft.tokens, np.ndarray):
        host_drafts = np.full((len(rows), length), -1, np.int32)
        for i in range(len(rows)):
          host_drafts[i, : kept[i]] = draft.tokens[i, : kept[i]]
      else:
        device_drafts = draft.tokens
        if device_drafts.shape[0] != batch:
          raise ValueError(f"method {self.method.name!r}: device Draft.tokens must have the "
                           f"padded batch's {batch} rows, got {device_drafts.shape}")
    sampler, fused, _ = self._sampler_plan(rows, is_tree)
    sb = build_batch(
        batch=batch, width=width, length=length,
        page_tables=[st.page_array()[: pages_needed(n + int(d), cfg.page_size)]
                     for st, n, d in zip(rows, lens, kept)],
        slots=[st.slot for st in rows], num_draft=kept, drafts=host_drafts,
        replay_source=self._replay_source(draft, len(rows)))
    tree_arrays = reach = None
    if is_tree:
      parents = np.full((batch, length), -1, np.int32)
      for i in range(len(rows)):
        parents[i, : num_draft[i]] = draft.parents[i, : num_draft[i]]
      validate_tree(parents, num_draft)
      positions = np.zeros(batch, np.int32)
      positions[: len(rows)] = lens
      tree_arrays = (parents, tree_mask(parents, num_draft, length + 1),
                     tree_positions(parents, num_draft, np.maximum(positions - 1, 0), length + 1))
      reach = node_depths(parents, num_draft).max(axis=1)
    probs = None
    if draft.probs is not None and length:
      if draft.probs.shape[0] != batch:
        raise ValueError(f"method {self.method.name!r}: Draft.probs must be [B, L, V] for the "
                         f"padded batch B={batch}, got {draft.probs.shape}")
      probs = draft.probs
    plan = self._plan(sampler, fused, length, tree=is_tree, probs=probs is not None)
    t2 = time.perf_counter()
    results, hidden = self._dispatch(plan, sb, device_drafts, probs, tree_arrays)
    result = np.asarray(results)[0]
    t3 = time.perf_counter()
    replayed = self._replay_acceptance(rows) if cfg.acceptance_replay else None
    res = commit_rows(rows, result, num_draft, k=self.k, eos_ids=self.eos_ids,
                      max_model_len=cfg.max_model_len, decode=self.decode, now=t3 - start,
                      reach=reach)
    for st in res.finished:
      self._release(sched, st)
    method_state = self.method.observe(method_state, VerifyResult(
        request_ids=ids, num_accepted=result[: len(rows), -1].copy(), emitted=res.emitted,
        finished=frozenset(st.request.request_id for st in res.finished),
        target_hidden=hidden, replay_acceptance=replayed,
    ))
    t4 = time.perf_counter()
    self._record(metrics, rows, batch, length, width, num_draft, res,
                 (t_begin, t1 - t0, t3 - t2, t4))
    return method_state

  def _output(self, st: RequestState, start: float) -> RequestOutput:
    arrival = st.request.arrival_time
    out_ids = st.output_ids
    text = None
    if self.decode is not None:
      text = truncate_at_stop(self.decode(out_ids), st.request.sampling.stop)
    n = len(out_ids)
    tpot = (st.finished_at - st.first_token_at) / (n - 1) if n > 1 else 0.0
    return RequestOutput(
        request_id=st.request.request_id, prompt_token_ids=list(st.request.prompt_token_ids),
        output_token_ids=out_ids, text=text, finish_reason=st.finish_reason.value,
        ttft_s=st.first_token_at - arrival, tpot_s=tpot, latency_s=st.finished_at - arrival,
        queue_s=(st.admitted_at or 0.0) - arrival, num_steps=st.num_steps,
        num_draft_tokens=st.num_draft_tokens, num_accepted_tokens=st.num_accepted_tokens,
        num_preemptions=st.num_preemptions, arrival_s=arrival,
    )
