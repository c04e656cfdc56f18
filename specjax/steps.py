"""Jitted device step functions: the target forward, the shared verification and the
KV/hidden-state fix-ups after tree verification.

Hot-loop steps are plain ``jax.jit`` functions over ``(params, kv_caches, batch)``
with the caches donated; the NNX module is split once at load (``split_model``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from models.llama import unstack_layer_params
from pallas_kernels.paged_attention import copy_kv
from pallas_kernels.paged_attention.metadata import AttentionMetadata
from specjax.method import DeviceRows
from specjax.slots import SlotState, slot_rows
from specjax.tree import device_tree_arrays
from specjax.verify import fused_rejection_sample, rejection_sample, tree_rejection_sample

__all__ = ["SAMPLERS", "SplitModel", "StepPlan", "commit_on_device", "engine_step", "forward_step",
           "fused_verify_step", "gather_rows", "move_kv_step", "split_model", "tree_verify_step",
           "verify_step"]


class SplitModel(NamedTuple):
  """A model split once for jitted steps: static ``graphdef`` + ``params`` pytree."""

  config: Any
  graphdef: Any
  params: Any


def split_model(model: nnx.Module, unroll_layers: bool = True) -> SplitModel:
  """Splits ``model`` once for the jitted steps.

  Args:
    model: a ``models.llama.Transformer``.
    unroll_layers: give each layer its own weight arrays so the step runs its layers
      unrolled (faster steps, slower compiles; see ``models.llama.unstack_layer_params``);
      False keeps the stacked weights and the layer scan.
  """
  graphdef, params = nnx.split(model)
  if unroll_layers:
    params = unstack_layer_params(params)
  return SplitModel(model.cfg, graphdef, params)


@functools.partial(
    jax.jit,
    static_argnames=("graphdef", "hidden_layers", "implementation"),
    donate_argnames=("kv_caches",),
)
def forward_step(
    graphdef,
    params,
    kv_caches,
    tokens: jax.Array,
    meta: AttentionMetadata,
    logits_indices: jax.Array,
    *,
    hidden_layers: tuple[int, ...] = (),
    implementation: str | tuple[str, ...] = "reference",
):
  """One ragged model call (prefill chunk, decode, or verify).

  Args:
    graphdef, params: from ``split_model``.
    kv_caches: per-layer paged KV (donated).
    tokens: ``i32[B, T]``.
    meta: ``AttentionMetadata`` of the padded batch.
    logits_indices: ``i32[B, R]`` rows of T whose logits are returned.

  Returns:
    ``(kv_caches, logits f32[B, R, V], hidden tuple of [B, T, D])``.
  """
  model = nnx.merge(graphdef, params)
  kv_caches, out = model(
      kv_caches, tokens, meta, hidden_layers=hidden_layers, logits_indices=logits_indices,
      implementation=implementation,
  )
  return kv_caches, out.logits, out.hidden


verify_step = jax.jit(rejection_sample, static_argnames=("all_greedy",))
fused_verify_step = jax.jit(fused_rejection_sample, static_argnames=("implementation",
                                                                     "interpret"))
tree_verify_step = jax.jit(tree_rejection_sample, static_argnames=("all_greedy",))


@functools.partial(jax.jit, static_argnames=("num_layers",), donate_argnames=("kv_caches",))
def move_kv_step(kv_caches, page_indices, src_positions, dst_positions, *, num_layers: int):
  """Copies KV positions ``src -> dst`` of every row in every layer (tree paths).

  Args:
    kv_caches: ``[num_layers * num_pages, page_size, 2K, H]`` (``init_kv_caches``), donated.
    page_indices: ``i32[B, pages_per_seq]``, -1 padded (the same ids in every layer).
    src_positions, dst_positions: ``i32[B, M]``, -1 = no copy.
    num_layers: static.

  Returns:
    The updated caches. Layer l's pages are rows ``l * num_pages ..`` of the one array,
    so the copy runs once over ``num_layers * B`` rows whose tables are offset by
    ``l * num_pages`` (e.g. num_pages 64, layer 2: page 5 -> 133; -1 stays -1).
  """
  num_pages = kv_caches.shape[0] // num_layers
  offsets = (jnp.arange(num_layers, dtype=page_indices.dtype) * num_pages)[:, None, None]
  tables = jnp.where(page_indices[None] >= 0, page_indices[None] + offsets, -1)
  flat = lambda x: x.reshape(-1, x.shape[-1])
  tile = lambda x: flat(jnp.broadcast_to(x[None], (num_layers, *x.shape)))
  return copy_kv(kv_caches, flat(tables), tile(src_positions), tile(dst_positions))


@jax.jit
def gather_rows(hidden: tuple, rows: jax.Array) -> tuple:
  """``hidden`` tuple of ``[B, T, D]`` -> the same with ``out[b, i] = h[b, rows[b, i]]``
  (``rows i32[B, T]``); puts a tree path's hidden states in commit order."""
  return tuple(jnp.take_along_axis(h, rows[:, :, None], axis=1) for h in hidden)


# --------------------------------------------------------------------- the fused step
SAMPLERS = ("greedy", "jnp", "fused", "fused+jnp")


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepPlan:
  """Static choices of one compiled engine step (hashable: a static jit argument).

  Attributes:
    length: L, the verify width minus one (0 = plain decode). Host drafts: the bucket of
      the longest draft proposed in the step. Fused proposers: the bucket of k (the
      drafts are not known to the host when it dispatches).
    k: the method's most draft tokens per row (the device's budget cap).
    sampler: "greedy" (every row greedy: argmax rule only), "jnp"
      (``rejection_sample``: temperature, top-k, top-p), "fused"
      (``fused_rejection_sample``: temperature only), "fused+jnp" (both; rows with
      top-k or top-p take the jnp result).
    tree: the step verifies tree drafts (``tree_rejection_sample``; sampler is
      "greedy" or "jnp"): the host's (``tree_arrays``) or a fused proposer's
      (``DeviceDraft.parents``; mask and positions made on the device).
    host_drafts: the drafts come from the host (the batch's columns, or the
      ``draft_tokens`` argument), not from a fused proposer.
    verify_caps: a fused proposer's step whose batch carries per-row verify caps (the
      num_draft column, ``specjax.batch.build_batch``; ``Capabilities.plans_verify``):
      each row's budget, as the proposer sees it and as verification applies it, is
      ``min(budget, cap)``.
    num_iterations: engine iterations run by this one call (``lax.scan``; each row's
      pages must cover ``num_iterations * (length + 1)`` more tokens). A row that ends
      in iteration i is inactive (no writes, no tokens) in the later ones.
    fused_implementation: ``pallas_kernels.verify`` implementation(s) for "fused".
    attention_implementation: paged-attention implementation(s).
    hidden_layers: target hidden-state layers returned (rows in commit order; of the
      last iteration).
    proposer_hidden_layers: target hidden-state layers a fused proposer reads in each
      iteration (``Method.observe_device``); not returned.
    has_draft_probs: the step gets ``draft_probs f32[B, L, V]`` (host-side proposers).
    synthetic_acceptance: None, or per-position acceptance probabilities
      ``(a_1, .., a_L')``: the accepted length is drawn as the leading run of
      Bernoulli(a_j) successes (positions past the tuple use its last value), capped at
      the row's drafts, instead of comparing draft and target (vLLM's "synthetic"
      rejection sampling; for timing the engine loop with random weights; NOT lossless).
    replay: accept ``min(replay_acc[slot, source, i] - 1, drafts)`` at each row's
      output position i (``EngineConfig.acceptance_replay``; NOT lossless); chains only.
    replay_sources: traces per slot under ``replay``; above 1 a host-drafts step's batch
      carries each row's source (``specjax.batch.build_batch``'s ``replay_source``), other
      steps replay source 0.
    num_layers: static layer count (KV moves of tree paths).
  """

  length: int
  sampler: str
  k: int = 0
  tree: bool = False
  host_drafts: bool = True
  verify_caps: bool = False
  num_iterations: int = 1
  fused_implementation: tuple[str, ...] = ("reference",)
  attention_implementation: str | tuple[str, ...] = "reference"
  hidden_layers: tuple[int, ...] = ()
  proposer_hidden_layers: tuple[int, ...] = ()
  has_draft_probs: bool = False
  synthetic_acceptance: tuple[float, ...] | None = None
  replay: bool = False
  replay_sources: int = 1
  num_layers: int = 1

  @property
  def replay_source_column(self) -> bool:
    """Whether the packed batch carries a replay-source column."""
    return self.replay and self.replay_sources > 1 and self.host_drafts

  def __post_init__(self):
    if self.sampler not in SAMPLERS:
      raise ValueError(f"sampler={self.sampler!r} must be one of {SAMPLERS}")
    if self.tree and self.sampler not in ("greedy", "jnp"):
      raise ValueError(f"tree steps verify with 'greedy' or 'jnp', not sampler={self.sampler!r}")
    if self.proposer_hidden_layers and (self.host_drafts or self.hidden_layers):
      raise ValueError("proposer_hidden_layers need a fused proposer and no returned "
                       f"hidden_layers (host_drafts={self.host_drafts}, "
                       f"hidden_layers={self.hidden_layers})")
    if self.num_iterations < 1:
      raise ValueError(f"num_iterations={self.num_iterations} must be >= 1")
    if self.verify_caps and self.host_drafts:
      raise ValueError("verify_caps cap a fused proposer's drafts (host_drafts=False)")
    if (self.replay or self.synthetic_acceptance is not None) and self.tree:
      raise ValueError("replayed and synthetic acceptance take chain drafts, not trees")
    if self.num_iterations > 1 and (self.host_drafts and self.length
                                    or self.hidden_layers):
      raise ValueError("several iterations per call need a fused proposer or plain decoding "
                       f"(length={self.length}, host_drafts={self.host_drafts}, "
                       f"tree={self.tree}, hidden_layers={self.hidden_layers})")


STREAM_SYNTHETIC = 3


def _synthetic_accepted(keys, positions, num_draft, rates: tuple[float, ...], length: int):
  """``i32[B]`` leading run of Bernoulli(rates[j]) draws, capped at ``num_draft``; the
  draw of position j uses ``fold_in(fold_in(key, positions + j), 3)``, so it depends on
  the request and position only."""
  table = jnp.asarray([rates[min(j, len(rates) - 1)] for j in range(length)], jnp.float32)
  pos = positions[:, None] + jnp.arange(length)[None]
  fold = jax.vmap(jax.vmap(lambda k, p: jax.random.uniform(
      jax.random.fold_in(jax.random.fold_in(k, p), STREAM_SYNTHETIC), (), jnp.float32),
      in_axes=(None, 0)))
  u = fold(keys, pos)
  ok = (u < table[None]) & (jnp.arange(length)[None] < num_draft[:, None])
  return jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)


def _tree_path_fixups(kv_caches, page_indices, nodes, accepted, positions, hidden,
                      num_layers: int):
  """Moves the accepted tree path's KV to ``root + depth`` (``specjax.tree.path_moves``
  on the device) and puts the path's hidden-state rows in commit order."""
  batch, length = nodes.shape
  starts = jnp.maximum(positions - 1, 0)
  depth = jnp.arange(1, length + 1, dtype=jnp.int32)[None]
  on_path = depth <= accepted[:, None]
  src = starts[:, None] + nodes + 1
  dst = starts[:, None] + depth
  move = on_path & (src != dst)
  kv_caches = move_kv_step(kv_caches, page_indices, jnp.where(move, src, -1),
                                       jnp.where(move, dst, -1), num_layers=num_layers)
  if hidden:
    rows = jnp.broadcast_to(jnp.arange(length + 1, dtype=jnp.int32), (batch, length + 1))
    rows = rows.at[:, 1:].set(jnp.where(on_path, nodes + 1, rows[:, 1:]))
    hidden = gather_rows(tuple(hidden), rows)
  return kv_caches, hidden


def _verify(plan: StepPlan, logits, drafts, parents, num_draft, probs, rows, positions,
            replay_source=None):
  """The shared verifier of a step: ``(tokens i32[B, L+1] (-1 padded), accepted i32[B],
  tree nodes or None)``; no method is known here."""
  greedy = plan.sampler == "greedy"
  temperature, top_k, top_p, keys = rows["temperature"], rows["top_k"], rows["top_p"], rows["keys"]
  nodes = None
  if plan.tree:
    toks, acc, nodes = tree_rejection_sample(
        logits, drafts, parents, num_draft, probs, temperature, top_k, top_p, keys, positions,
        all_greedy=greedy)
  elif plan.sampler in ("fused", "fused+jnp"):
    toks, acc = fused_rejection_sample(logits, drafts, num_draft, probs, temperature, keys,
                                       positions, implementation=plan.fused_implementation)
    if plan.sampler == "fused+jnp":
      toks_j, acc_j = rejection_sample(logits, drafts, num_draft, probs, temperature, top_k,
                                       top_p, keys, positions, all_greedy=False)
      sel = (top_k > 0) | (top_p < 1)
      toks, acc = jnp.where(sel[:, None], toks_j, toks), jnp.where(sel, acc_j, acc)
  else:
    toks, acc = rejection_sample(logits, drafts, num_draft, probs, temperature, top_k, top_p,
                                 keys, positions, all_greedy=greedy)
  length = plan.length
  if plan.replay and length:  # row b at output position i accepts replay_acc[b, s, i] - 1
    traces = rows["replay_acc"]  # [B, N, R]
    if replay_source is None:
      trace = traces[:, 0]
    else:
      src = jnp.clip(replay_source, 0, traces.shape[1] - 1)
      trace = jnp.take_along_axis(traces, src[:, None, None], axis=1)[:, 0]
    out_pos = jnp.clip(positions - rows["num_prompt"], 0, trace.shape[1] - 1)
    recorded = jnp.take_along_axis(trace, out_pos[:, None], axis=1)[:, 0]
    acc = jnp.clip(recorded - 1, 0, num_draft).astype(jnp.int32)
  elif plan.synthetic_acceptance is not None and length:
    acc = _synthetic_accepted(keys, positions, num_draft, plan.synthetic_acceptance, length)
  if (plan.replay or plan.synthetic_acceptance is not None) and length:
    arg = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    last_tok = jnp.take_along_axis(arg, acc[:, None], axis=1)[:, 0]
    j = jnp.arange(length + 1)[None]
    padded = jnp.concatenate([drafts, jnp.full((drafts.shape[0], 1), -1, jnp.int32)], axis=1)
    toks = jnp.where(j < acc[:, None], padded, -1)
    toks = jnp.where(j == acc[:, None], last_tok[:, None], toks).astype(jnp.int32)
  return toks, acc, nodes


def commit_on_device(slots: SlotState, row_slots, rows: dict, toks, active):
  """Appends each active row's emitted tokens to its slot with the stop rules, on the
  device, exactly as ``specjax.request.RequestState.append`` does on the host: token j
  of a row is kept, then the row ends if it is a stop id, if the output reaches
  ``max_tokens`` or the sequence ``max_model_len``; later tokens are dropped.

  Example: num_tokens 10, num_prompt 8, max_tokens 4, tokens [5, 6, 7, -1] (3 emitted):
  5 is output token 3, 6 is output token 4 = max_tokens, so [5, 6] are kept, 7 dropped,
  the slot gets num_tokens 12 and finished.

  Args:
    slots: the ``SlotState``; row_slots ``i32[B]``; rows: ``slot_rows(slots, row_slots)``.
    toks: ``i32[B, T]`` emitted tokens (-1 past each row's count).
    active: ``bool[B]`` rows that take part.

  Returns:
    ``(slots, kept i32[B, T] (-1 past the kept tokens), num_kept i32[B])``.
  """
  num_slots, max_len = slots.num_slots, slots.max_model_len
  n_tok, stop_ids = rows["num_tokens"], rows["stop_ids"]
  j = jnp.arange(toks.shape[1])[None]
  emitted = active[:, None] & (toks >= 0)
  is_stop = jnp.any((toks[:, :, None] == stop_ids[:, None, :]) & (stop_ids[:, None, :] >= 0),
                    axis=-1)
  num_out = (n_tok - rows["num_prompt"])[:, None]
  at_limit = (num_out + j + 1 >= rows["max_tokens"][:, None]) | (n_tok[:, None] + j + 1 >= max_len)
  stop = (is_stop | at_limit) & emitted
  ends = jnp.any(stop, axis=1)
  count = jnp.sum(emitted, axis=1).astype(jnp.int32)
  num_kept = jnp.where(ends, jnp.argmax(stop, axis=1) + 1, count).astype(jnp.int32)
  keep = j < num_kept[:, None]
  kept = jnp.where(keep, toks, -1)
  target_row = jnp.where(keep, row_slots[:, None], num_slots)  # out of range: dropped
  tokens = slots.tokens.at[target_row, jnp.minimum(n_tok[:, None] + j, max_len - 1)].set(
      kept, mode="drop")
  slot_of_active = jnp.where(active, row_slots, num_slots)
  num_tokens = slots.num_tokens.at[slot_of_active].add(num_kept, mode="drop")
  finished = slots.finished.at[jnp.where(active & ends, row_slots, num_slots)].set(
      True, mode="drop")
  return dataclasses.replace(slots, tokens=tokens, num_tokens=num_tokens,
                             finished=finished), kept, num_kept


def _iteration(plan: StepPlan, proposer, graphdef, params, proposer_params, batch, draft_tokens,
               draft_probs, tree_arrays, carry):
  """One engine iteration: propose (fused), forward, verify, commit on the device."""
  kv_caches, slots, pstate = carry
  length = plan.length
  rows = slot_rows(slots, batch.slots)
  active = rows["active"]
  n_tok = rows["num_tokens"]
  num_out = n_tok - rows["num_prompt"]
  budgets = jnp.minimum(jnp.minimum(plan.k, slots.max_model_len - n_tok),
                        rows["max_tokens"] - num_out - 1)
  budgets = jnp.where(active, jnp.maximum(budgets, 0), 0).astype(jnp.int32)
  if plan.verify_caps:  # the method's per-row caps of this dispatch
    budgets = jnp.minimum(budgets, jnp.maximum(batch.num_draft, 0)).astype(jnp.int32)
  probs = None
  if not length:
    source = jnp.zeros((n_tok.shape[0], 0), jnp.int32)
    num_draft = jnp.zeros_like(n_tok)
  elif plan.host_drafts:
    source = batch.drafts if draft_tokens is None else draft_tokens[:, :length]
    num_draft = batch.num_draft
    probs = draft_probs[:, :length] if plan.has_draft_probs else None
  else:
    view = DeviceRows(slots=batch.slots, active=active, tokens=rows["tokens"], num_tokens=n_tok,
                      budgets=budgets, page_indices=batch.page_indices,
                      temperature=rows["temperature"], top_k=rows["top_k"], top_p=rows["top_p"],
                      keys=rows["keys"], slot_tokens=slots.tokens,
                      slot_num_tokens=slots.num_tokens)
    pstate, draft = proposer.propose_device(proposer_params, pstate, view,
                                            all_greedy=plan.sampler == "greedy")
    source, num_draft = draft.tokens[:, :length], draft.num_tokens
    if draft.probs is not None:
      probs = draft.probs[:, :length]
    if plan.tree:
      if draft.parents is None:
        raise ValueError("a fused tree step needs DeviceDraft.parents")
      tree_arrays = draft.parents[:, :length]
  num_draft = jnp.minimum(jnp.minimum(num_draft, budgets), length).astype(jnp.int32)
  valid = jnp.arange(length)[None] < num_draft[:, None]
  drafts = jnp.where(valid, source, -1).astype(jnp.int32)
  pending = jnp.take_along_axis(rows["tokens"], jnp.maximum(n_tok - 1, 0)[:, None], axis=1)
  tokens = jnp.concatenate([pending, jnp.maximum(drafts, 0)], axis=1)
  q_lens = jnp.where(active, 1 + num_draft, 0).astype(jnp.int32)
  kv_lens = jnp.where(active, n_tok + num_draft, 0).astype(jnp.int32)
  meta = AttentionMetadata(batch.page_indices, kv_lens, q_lens)
  parents = reach = None
  if plan.tree:
    if plan.host_drafts:
      parents, mask, tree_pos = tree_arrays
    else:  # the first num_draft nodes of the proposer's tree (a prefix is a tree)
      parents = jnp.where(valid, tree_arrays, -1).astype(jnp.int32)
      depths, mask, tree_pos = device_tree_arrays(parents, num_draft,
                                                  jnp.maximum(n_tok - 1, 0), length + 1)
      reach = jnp.max(depths, axis=1, initial=0)
    meta = AttentionMetadata(batch.page_indices, kv_lens, q_lens, tree_mask=mask,
                             positions=tree_pos)
  model = nnx.merge(graphdef, params)
  logits_idx = jnp.broadcast_to(jnp.arange(length + 1, dtype=jnp.int32),
                                (tokens.shape[0], length + 1))
  kv_caches, out = model(kv_caches, tokens, meta,
                         hidden_layers=plan.hidden_layers or plan.proposer_hidden_layers,
                         logits_indices=logits_idx,
                         implementation=plan.attention_implementation)
  hidden = out.hidden
  if plan.proposer_hidden_layers and not plan.tree:  # e.g. a learned head's features
    pstate = proposer.observe_device(proposer_params, pstate, view, tuple(hidden), meta)
    hidden = ()
  toks, acc, nodes = _verify(plan, out.logits, drafts, parents, num_draft, probs, rows, n_tok,
                             batch.replay_source)
  if plan.tree:
    kv_caches, hidden = _tree_path_fixups(kv_caches, batch.page_indices, nodes, acc, n_tok,
                                          hidden, plan.num_layers)
    if plan.proposer_hidden_layers:  # the accepted path's rows, in commit order
      pstate = proposer.observe_device(proposer_params, pstate, view, tuple(hidden), meta)
      hidden = ()
  slots, kept, _ = commit_on_device(slots, batch.slots, rows, toks, active)
  tail = [num_draft[:, None], jnp.where(active, acc, -1)[:, None]]
  if reach is not None:
    tail.insert(0, reach[:, None])
  result = jnp.concatenate([kept, *tail], axis=1).astype(jnp.int32)
  return (kv_caches, slots, pstate), result, tuple(hidden)


@functools.partial(jax.jit, static_argnames=("graphdef", "plan", "proposer"),
                   donate_argnames=("kv_caches", "slots", "proposer_state"))
def engine_step(graphdef, params, kv_caches, slots, proposer_params, proposer_state, ints,
                draft_tokens, draft_probs, tree_arrays, *, plan: StepPlan, proposer=None):
  """``plan.num_iterations`` engine iterations in one device call: per iteration and
  row, the fused proposer's drafts (or the host's), the target forward over
  ``[pending, d_1 .. d_L]``, verification / sampling, tree-path KV fix-ups and the
  commit into the row's slot with the stop rules (``commit_on_device``). Nothing here
  waits for the host, so the next call can be dispatched before this one is read.

  Args:
    graphdef, params: the target (``split_model``).
    kv_caches: the target's paged KV (donated).
    slots: the ``specjax.slots.SlotState`` (donated).
    proposer_params, proposer_state: the fused proposer's pytrees (``Method.init_device``;
      the state is donated), or ``()``.
    ints: the packed host batch (``specjax.batch.build_batch``), ``i32[B, W + 2 + L']``.
    draft_tokens: ``i32[B, >= L]`` device drafts of a host-called proposer, or None.
    draft_probs: ``f32[B, L, V]`` or None (``plan.has_draft_probs``).
    tree_arrays: None, or ``(parents i32[B, L], tree_mask bool[B, L+1, L+1], positions
      i32[B, L+1])`` for tree steps of host drafts (a fused proposer's trees: None).
    plan: ``StepPlan`` (static). proposer: the fused ``Method`` (static) or None.

  Returns:
    ``(kv_caches, slots, proposer_state, result i32[N, B, L+3], hidden)``: per iteration
    n and row b, ``result[n, b, :L+1]`` the committed tokens (-1 padded; the stop rules
    already applied), ``result[n, b, -2]`` the drafts verified, ``result[n, b, -1]`` the
    accepted drafts (-1: the row was inactive: padding, or finished on the device); a
    fused proposer's tree steps have one more column, ``result[n, b, L+1]``, the deepest
    node verified (``[N, B, L+4]``);
    ``hidden`` a tuple of ``[B, L+1, D]`` target hidden states of the last iteration.
  """
  from specjax.batch import unpack_batch  # noqa: PLC0415 (batch imports the kernel metadata)

  batch = unpack_batch(ints, plan.length if plan.host_drafts else 0,
                       plan.replay_source_column)
  step = functools.partial(_iteration, plan, proposer, graphdef, params, proposer_params, batch,
                           draft_tokens, draft_probs, tree_arrays)
  carry = (kv_caches, slots, proposer_state)
  if plan.num_iterations == 1:
    carry, result, hidden = step(carry)
    results = result[None]
  else:  # a scan, not a while_loop: a device-side loop condition blocks the dispatch
    def body(c, _):
      c, r, _ = step(c)
      return c, r
    carry, results = jax.lax.scan(body, carry, None, length=plan.num_iterations)
    hidden = ()
  kv_caches, slots, proposer_state = carry
  return kv_caches, slots, proposer_state, results, hidden
