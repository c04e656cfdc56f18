"""The engine: a Python host loop around jitted prefill / propose / verify steps.

Each iteration admits arrived requests, prefills the new ones (KV only: the last
prompt token stays pending), asks the method for drafts, runs one target forward over
``[pending, d_1 .. d_L]`` per row, verifies with the shared rejection sampler, and
commits tokens one by one with the stop rules. Offline (all arrivals at 0) and online
(Poisson arrival times) runs share all of it.

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

from models.llama import init_kv_caches
from pallas_kernels.paged_attention.metadata import AttentionMetadata
from specjax.config import AUTO_VERIFY_IMPLEMENTATION, EngineConfig
from specjax.kv_cache import page_table, pages_needed
from specjax.method import Method, PrefillResult, ProposeContext, RuntimeInfo, VerifyResult
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
from specjax.steps import (
  SplitModel,
  forward_step,
  fused_verify_step,
  gather_rows,
  move_kv_step,
  split_model,
  tree_verify_step,
  verify_step,
)
from specjax.tree import node_depths, path_moves, tree_mask, tree_positions, validate_tree

__all__ = ["Engine", "bucket"]


def bucket(n: int, cap: int, minimum: int = 1, growth: int = 2) -> int:
  """Smallest ``minimum * growth**i`` >= n, capped at ``cap`` (e.g. 5 -> 8; growth 4,
  minimum 4: 5 -> 16)."""
  b = minimum
  while b < n:
    b *= growth
  return max(n, min(b, cap))


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
    CompileMonitor.install()
    self.kv_caches = init_kv_caches(self.target.config, config.total_pages, config.page_size)
    cfg = self.target.config
    itemsize = jnp.dtype(self.kv_caches.dtype).itemsize
    self.kv_bytes_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize
    self.runtime = RuntimeInfo(
        target=self.target, draft=self.draft, num_pages=config.total_pages,
        page_size=config.page_size, max_model_len=config.max_model_len,
        attention_implementation=config.attention_implementation,
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
      if self.config.verify_implementation not in (None, "auto") and (sp.top_k or sp.top_p < 1):
        raise ValueError(
            f"request {r.request_id!r}: top_k={sp.top_k}, top_p={sp.top_p} need the jnp "
            f"rejection sampler; verify_implementation={self.config.verify_implementation} "
            "handles temperature only (set it to 'auto' or None)")
      vocab = self.target.config.vocab_size
      if min(r.prompt_token_ids) < 0 or max(r.prompt_token_ids) >= vocab:
        raise ValueError(f"request {r.request_id!r}: token ids must be in [0, {vocab})")

  def _fused_verify_plan(self, rows: list[RequestState], is_tree: bool, all_greedy: bool):
    """``(implementation, jnp_rows)`` for this verify step (see
    ``EngineConfig.verify_implementation``): the ``pallas_kernels.verify``
    implementation(s) of the fused sampler, or None for the jnp samplers only; and, under
    "auto" in a step that mixes temperature-only and top-k/top-p requests, the
    ``bool[len(rows)]`` rows that take the jnp sampler's result instead (so a request is
    sampled the same way whatever its batch partners are), else None.

    Raises:
      NotImplementedError: an explicitly named fused implementation and a tree draft.
    """
    impl = self.config.verify_implementation
    if impl == "auto":
      if is_tree or all_greedy:
        return None, None
      jnp_rows = np.array([bool(st.request.sampling.top_k) or st.request.sampling.top_p < 1
                           for st in rows])
      if jnp_rows.all():
        return None, None
      return AUTO_VERIFY_IMPLEMENTATION, (jnp_rows if jnp_rows.any() else None)
    if impl is not None and is_tree:
      raise NotImplementedError(
          f"verify_implementation={impl} verifies chains only; this method drafted a tree "
          "(use verify_implementation='auto' or None)")
    return impl, None

  def _batch_arrays(self, rows: list[RequestState], batch: int):
    temp = np.zeros(batch, np.float32)
    top_k = np.zeros(batch, np.int32)
    top_p = np.ones(batch, np.float32)
    keys = np.zeros((batch, 2), np.uint32)
    for i, st in enumerate(rows):
      sp = st.request.sampling
      temp[i], top_k[i], top_p[i], keys[i] = sp.temperature, sp.top_k, sp.top_p, st.key
    return temp, top_k, top_p, keys

  def _pages_bucket(self, rows: list[RequestState], num_tokens: list[int]) -> int:
    # Page-table width buckets grow 4x (4, 16, 64, ... pages): fewer step shapes to
    # compile for a slightly wider (masked) attention gather.
    need = max(pages_needed(n, self.config.page_size) for n in num_tokens)
    return bucket(need, self.config.pages_per_seq, minimum=4, growth=4)

  def _prefill(self, rows: list[RequestState], metrics: RunMetrics, method_state):
    """Writes KV for every token but the pending last one (no sampling).

    Methods that read target hidden states get them through ``observe_prefill``.
    Returns the method state.
    """
    cfg = self.config
    starts = [st.num_computed for st in rows]
    ends = [len(st.tokens) - 1 for st in rows]
    t_len = bucket(max(e - s for s, e in zip(starts, ends)), cfg.max_model_len,
                   cfg.min_prefill_bucket)
    batch = bucket(len(rows), cfg.max_num_seqs)
    tokens = np.zeros((batch, t_len), np.int32)
    q_lens = np.zeros(batch, np.int32)
    kv_lens = np.zeros(batch, np.int32)
    for i, (st, s, e) in enumerate(zip(rows, starts, ends)):
      tokens[i, : e - s] = st.tokens[s:e]
      q_lens[i], kv_lens[i] = e - s, e
    width = self._pages_bucket(rows, ends)
    meta = AttentionMetadata(page_table([st.pages for st in rows], batch, width), kv_lens, q_lens)
    t0 = time.perf_counter()
    self.kv_caches, logits, hidden = forward_step(
        self.target.graphdef, self.target.params, self.kv_caches, tokens, meta,
        np.maximum(q_lens - 1, 0)[:, None], hidden_layers=self.caps.target_hidden_layers,
        implementation=cfg.attention_implementation,
    )
    jax.block_until_ready(logits)
    metrics.prefill_s += time.perf_counter() - t0
    metrics.num_prefill_tokens += int(q_lens.sum())
    for st, e in zip(rows, ends):
      st.num_computed = e
    if self.caps.target_hidden_layers:
      method_state = self.method.observe_prefill(method_state, PrefillResult(
          request_ids=[st.request.request_id for st in rows],
          starts=np.asarray(starts, np.int32), num_tokens=q_lens[: len(rows)].copy(),
          target_hidden=hidden,
      ))
    return method_state

  def _budget(self, st: RequestState) -> int:
    sp = st.request.sampling
    return max(0, min(self.k, self.config.max_model_len - len(st.tokens),
                      sp.max_tokens - st.num_output - 1))

  # ------------------------------------------------------------------ main loop
  def generate(self, requests: Sequence[Request], progress=None):
    """Runs all requests to completion.

    Args:
      requests: the workload; ``arrival_time`` > 0 gives online (timed) arrivals.
      progress: optional callable ``(num_new_output_tokens) -> None`` (e.g. tqdm.update).

    Returns:
      ``(outputs: list[RequestOutput] in request order, metrics: RunMetrics)``.
    """
    self._validate(requests)
    self._progress = progress
    cfg = self.config
    sched = Scheduler(cfg, reserve_tokens=self.k)
    states = []
    for r in requests:
      seed = r.sampling.seed if r.sampling.seed is not None else default_key_seed(cfg.seed, r.request_id)
      st = RequestState(r, np.asarray(request_key(seed)), list(r.prompt_token_ids))
      states.append(st)
      sched.add(st)
    method_state = self.method.init_state(self.runtime)
    metrics = RunMetrics(kv_bytes_per_token=self.kv_bytes_per_token)
    c0, s0 = CompileMonitor.snapshot()
    start = time.perf_counter()
    seen_by_method: set = set()
    while sched.has_work:
      now = time.perf_counter() - start
      sched.admit(now)
      if not sched.running:
        nxt = sched.next_arrival()
        time.sleep(max(0.0, nxt - now) if nxt is not None else 0.0)
        continue
      need = [st for st in sched.running if st.num_computed < len(st.tokens) - 1]
      # One sequence per prefill call: batching prompts of different lengths would pad
      # each to the longest (a 40-token prompt next to a 1334-token one costs 1334).
      for st in need:
        method_state = self._prefill([st], metrics, method_state)
      method_state = self._decode_step(sched, method_state, metrics, start, seen_by_method)
    metrics.wall_s = time.perf_counter() - start
    c1, s1 = CompileMonitor.snapshot()
    metrics.num_compiles, metrics.compile_s = c1 - c0, s1 - s0
    metrics.num_preemptions = sched.num_preemptions
    assert sched.allocator.num_used == 0, "pages leaked"
    return [self._output(st, start) for st in states], metrics

  def _decode_step(self, sched, method_state, metrics, start, seen_by_method):
    cfg = self.config
    t_begin = time.perf_counter()
    compiles_before = CompileMonitor.snapshot()
    budgets = {st.request.request_id: self._budget(st) for st in sched.running}
    for victim in sched.reserve_step(budgets):
      seen_by_method.discard(victim.request.request_id)
    rows = list(sched.running)
    batch = bucket(len(rows), cfg.max_num_seqs)
    width = self._pages_bucket(rows, [len(st.tokens) + budgets[st.request.request_id]
                                      for st in rows])
    table = page_table([st.pages for st in rows], batch, width)
    temp, top_k, top_p, keys = self._batch_arrays(rows, batch)
    ids = [st.request.request_id for st in rows]
    new = frozenset(i for i in ids if i not in seen_by_method)
    seen_by_method.update(ids)
    ctx = ProposeContext(
        request_ids=ids, token_ids=[np.asarray(st.tokens, np.int32) for st in rows],
        budgets=np.asarray([budgets[i] for i in ids], np.int32), page_indices=table,
        temperature=temp, top_k=top_k, top_p=top_p, keys=keys, new_requests=new,
    )
    t0 = time.perf_counter()
    method_state, draft = self.method.propose(method_state, ctx)
    if draft.probs is not None:
      jax.block_until_ready(draft.probs)
    t1 = time.perf_counter()
    num_draft = np.zeros(batch, np.int32)
    num_draft[: len(rows)] = np.minimum(draft.num_tokens, ctx.budgets)
    length = self.k if num_draft.any() else 0
    is_tree = draft.parents is not None and length > 0
    tokens = np.zeros((batch, length + 1), np.int32)
    draft_tokens = np.full((batch, length), -1, np.int32)
    q_lens = np.zeros(batch, np.int32)
    kv_lens = np.zeros(batch, np.int32)
    positions = np.zeros(batch, np.int32)
    for i, st in enumerate(rows):
      n = int(num_draft[i])
      tokens[i, 0] = st.tokens[-1]
      tokens[i, 1: 1 + n] = draft.tokens[i, :n]
      draft_tokens[i, :n] = draft.tokens[i, :n]
      q_lens[i] = 1 + n
      kv_lens[i] = len(st.tokens) + n
      positions[i] = len(st.tokens)
    meta = AttentionMetadata(table, kv_lens, q_lens)
    parents = reach = None
    if is_tree:
      parents = np.full((batch, length), -1, np.int32)
      for i in range(len(rows)):
        parents[i, : num_draft[i]] = draft.parents[i, : num_draft[i]]
      validate_tree(parents, num_draft)
      meta = AttentionMetadata(
          table, kv_lens, q_lens, tree_mask=tree_mask(parents, num_draft, length + 1),
          positions=tree_positions(parents, num_draft, np.maximum(positions - 1, 0), length + 1))
      reach = node_depths(parents, num_draft).max(axis=1)
    logits_idx = np.broadcast_to(np.arange(length + 1, dtype=np.int32), (batch, length + 1))
    self.kv_caches, logits, hidden = forward_step(
        self.target.graphdef, self.target.params, self.kv_caches, tokens, meta, logits_idx,
        hidden_layers=self.caps.target_hidden_layers,
        implementation=cfg.attention_implementation,
    )
    jax.block_until_ready(logits)
    t2 = time.perf_counter()
    probs = None
    if draft.probs is not None and length:
      probs = draft.probs[:, :length] if draft.probs.shape[0] == batch else None
      assert probs is not None, "draft probs must be [B, L, V] for the padded batch"
    all_greedy = all(st.request.sampling.greedy for st in rows)
    fused, jnp_rows = self._fused_verify_plan(rows, is_tree, all_greedy)
    if is_tree:
      out, acc, nodes = tree_verify_step(logits, draft_tokens, parents, num_draft, probs, temp,
                                         top_k, top_p, keys, positions, all_greedy=all_greedy)
      hidden = self._commit_tree_path(np.asarray(nodes), np.asarray(acc), positions, table,
                                      hidden)
    elif fused is not None:
      out, acc = fused_verify_step(logits, draft_tokens, num_draft, probs, temp, keys, positions,
                                   implementation=fused)
      if jnp_rows is not None:
        out_j, acc_j = verify_step(logits, draft_tokens, num_draft, probs, temp, top_k, top_p,
                                   keys, positions, all_greedy=False)
        sel = np.zeros(len(acc_j), bool)
        sel[: len(jnp_rows)] = jnp_rows
        out, acc = np.where(sel[:, None], out_j, out), np.where(sel, acc_j, acc)
    else:
      out, acc = verify_step(logits, draft_tokens, num_draft, probs, temp, top_k, top_p, keys,
                             positions, all_greedy=all_greedy)
    out, acc = np.asarray(out), np.asarray(acc)
    t3 = time.perf_counter()
    now = t3 - start
    emitted_rows, finished = [], set()
    acc_pos = np.zeros(max(self.k, 1), np.int32)
    drafted_pos = np.zeros(max(self.k, 1), np.int32)
    n_emitted = 0
    for i, st in enumerate(rows):
      a, n = int(acc[i]), int(num_draft[i])
      drafted_pos[: n if reach is None else reach[i]] += 1  # rows reaching each depth
      emitted = []
      for tok in out[i, : a + 1]:
        emitted.append(int(tok))
        if st.append(int(tok), eos_ids=self.eos_ids, max_model_len=cfg.max_model_len,
                     decode=self.decode):
          break
      if st.first_token_at is None:
        st.first_token_at = now
      st.num_computed = len(st.tokens) - 1
      st.num_steps += 1
      st.num_draft_tokens += n
      st.num_accepted_tokens += min(a, len(emitted))
      acc_pos[: min(a, len(emitted))] += 1  # drafts after a stop are not counted
      n_emitted += len(emitted)
      emitted_rows.append(emitted)
      if st.finish_reason is not None:
        st.finished_at = now
        finished.add(st.request.request_id)
        sched.finish(st)
    method_state = self.method.observe(method_state, VerifyResult(
        request_ids=ids, num_accepted=acc[: len(rows)], emitted=emitted_rows,
        finished=frozenset(finished), target_hidden=hidden,
    ))
    t4 = time.perf_counter()
    compiled = CompileMonitor.snapshot() != compiles_before
    metrics.steps.append(StepRecord(
        num_rows=len(rows), batch_bucket=batch, query_bucket=length + 1, pages_bucket=width,
        num_draft_tokens=int(num_draft.sum()),
        num_accepted=int(sum(min(int(acc[i]), len(e)) for i, e in enumerate(emitted_rows))),
        num_emitted=n_emitted, accepted_per_position=acc_pos[: self.k],
        drafted_per_position=drafted_pos[: self.k],
        draft_s=t1 - t0, verify_s=t2 - t1, rejection_s=t3 - t2,
        host_s=(t0 - t_begin) + (t4 - t3), step_s=t4 - t_begin, compiled=compiled,
    ))
    if self._progress is not None:
      self._progress(n_emitted)
    return method_state

  _progress = None

  def _commit_tree_path(self, nodes, num_accepted, positions, table, hidden):
    """Moves the accepted tree path's KV to ``root + depth`` and returns the step's
    hidden states with the path's rows in commit order (root, depth 1, 2, ..).

    Args:
      nodes: ``i32[B, L]`` accepted node indices by depth (-1 padded).
      num_accepted: ``i32[B]``.
      positions: ``i32[B]`` the verify positions (root position + 1).
      table: the step's page table.
      hidden: tuple of ``[B, L+1, D]`` (may be empty).
    """
    starts = np.maximum(positions - 1, 0)
    src, dst, any_move = path_moves(nodes, num_accepted, starts)
    if any_move:
      self.kv_caches = move_kv_step(self.kv_caches, table, src, dst,
                                    num_layers=self.target.config.num_layers)
    if not hidden:
      return hidden
    batch, length = nodes.shape
    rows = np.broadcast_to(np.arange(length + 1, dtype=np.int32), (batch, length + 1)).copy()
    on_path = np.arange(length)[None] < num_accepted[:, None]
    rows[:, 1:] = np.where(on_path, nodes + 1, rows[:, 1:])
    return gather_rows(tuple(hidden), rows)

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
        num_preemptions=st.num_preemptions,
    )
