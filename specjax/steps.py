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
from specjax.verify import fused_rejection_sample, rejection_sample, tree_rejection_sample

__all__ = ["SAMPLERS", "SplitModel", "StepPlan", "engine_step", "split_model", "forward_step", "fused_verify_step", "gather_rows",
           "move_kv_step", "tree_verify_step", "verify_step"]


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
    length: L, the verify width minus one (0 = plain decode); the bucket of the longest
      draft proposed in the step, not k.
    sampler: "greedy" (every row greedy: argmax rule only), "jnp"
      (``rejection_sample``: temperature, top-k, top-p), "fused"
      (``fused_rejection_sample``: temperature only), "fused+jnp" (both; rows flagged in
      the batch's ``jnp_rows`` column take the jnp result).
    tree: the step verifies tree drafts (``tree_rejection_sample``; sampler is
      "greedy" or "jnp").
    fused_implementation: ``pallas_kernels.verify`` implementation(s) for "fused".
    attention_implementation: paged-attention implementation(s).
    hidden_layers: target hidden-state layers returned (rows in commit order).
    has_draft_probs: the step gets ``draft_probs f32[B, L, V]``.
    synthetic_acceptance: None, or per-position acceptance probabilities
      ``(a_1, .., a_L')``: the accepted length is drawn as the leading run of
      Bernoulli(a_j) successes (positions past the tuple use its last value), capped at
      the row's drafts, instead of comparing draft and target (vLLM's "synthetic"
      rejection sampling; for timing the engine loop with random weights; NOT lossless).
    num_layers, max_num_seqs: static sizes (KV moves of tree paths; the padded
      last-token carry).
  """

  length: int
  sampler: str
  tree: bool = False
  fused_implementation: tuple[str, ...] = ("reference",)
  attention_implementation: str | tuple[str, ...] = "reference"
  hidden_layers: tuple[int, ...] = ()
  has_draft_probs: bool = False
  synthetic_acceptance: tuple[float, ...] | None = None
  num_layers: int = 1
  max_num_seqs: int = 1

  def __post_init__(self):
    if self.sampler not in SAMPLERS:
      raise ValueError(f"sampler={self.sampler!r} must be one of {SAMPLERS}")
    if self.tree and self.sampler not in ("greedy", "jnp"):
      raise ValueError(f"tree steps verify with 'greedy' or 'jnp', not sampler={self.sampler!r}")


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


@functools.partial(jax.jit, static_argnames=("graphdef", "plan"),
                   donate_argnames=("kv_caches",))
def engine_step(graphdef, params, kv_caches, prev_last, ints, floats, draft_tokens,
                draft_probs, tree_arrays, *, plan: StepPlan):
  """One engine iteration on the device: target forward over ``[pending, d_1 .. d_L]``
  per row, verification / sampling, tree-path KV fix-ups, all in one call.

  Args:
    graphdef, params: the target (``split_model``).
    kv_caches: the target's paged KV (donated).
    prev_last: ``i32[max_num_seqs]`` the last emitted token of each row of the previous
      step (its ``last`` output); rows whose ``prev_row`` column is >= 0 take their
      pending token from it, so a step can be dispatched before the host has read the
      previous one (asynchronous AR decoding).
    ints, floats: the packed host batch (``specjax.batch.StepBatch``): ``i32[B, C]``
      and ``f32[B, 2]``.
    draft_tokens: ``i32[B, >= L]`` device drafts (e.g. a draft model's), or None: the
      host drafts packed in ``ints``.
    draft_probs: ``f32[B, L, V]`` or None (``plan.has_draft_probs``).
    tree_arrays: None, or ``(parents i32[B, L], tree_mask bool[B, L+1, L+1], positions
      i32[B, L+1])`` for tree steps.
    plan: ``StepPlan`` (static).

  Returns:
    ``(kv_caches, result i32[B, L+2], last i32[max_num_seqs], hidden)``: ``result[b,
    :L+1]`` the output tokens (-1 padded; row b emits ``result[b, :a+1]``), ``result[b,
    L+1]`` = a, the number of accepted drafts; ``last`` the final emitted token per row
    (zero padded to ``max_num_seqs``); ``hidden`` a tuple of ``[B, L+1, D]`` target
    hidden states, rows in commit order.
  """
  from specjax.batch import unpack_batch  # noqa: PLC0415 (batch imports this module's plan)

  length = plan.length
  b = unpack_batch(ints, floats, length)
  pending = jnp.where(b.prev_row >= 0, prev_last[jnp.maximum(b.prev_row, 0)], b.pending)
  valid = jnp.arange(length)[None] < b.num_draft[:, None]
  source = b.drafts if draft_tokens is None else draft_tokens[:, :length]
  drafts = jnp.where(valid, source, -1).astype(jnp.int32)
  tokens = jnp.concatenate([pending[:, None], jnp.maximum(drafts, 0)], axis=1)
  meta = AttentionMetadata(b.page_indices, b.kv_lens, b.q_lens)
  parents = None
  if plan.tree:
    parents, mask, tree_pos = tree_arrays
    meta = AttentionMetadata(b.page_indices, b.kv_lens, b.q_lens, tree_mask=mask,
                             positions=tree_pos)
  model = nnx.merge(graphdef, params)
  logits_idx = jnp.broadcast_to(jnp.arange(length + 1, dtype=jnp.int32),
                                (tokens.shape[0], length + 1))
  kv_caches, out = model(kv_caches, tokens, meta, hidden_layers=plan.hidden_layers,
                         logits_indices=logits_idx,
                         implementation=plan.attention_implementation)
  logits, hidden = out.logits, out.hidden
  probs = draft_probs[:, :length] if plan.has_draft_probs and length else None
  greedy = plan.sampler == "greedy"
  if plan.tree:
    toks, acc, nodes = tree_rejection_sample(
        logits, drafts, parents, b.num_draft, probs, b.temperature, b.top_k, b.top_p,
        b.keys, b.positions, all_greedy=greedy)
  elif plan.sampler in ("fused", "fused+jnp"):
    toks, acc = fused_rejection_sample(logits, drafts, b.num_draft, probs, b.temperature,
                                       b.keys, b.positions,
                                       implementation=plan.fused_implementation)
    if plan.sampler == "fused+jnp":
      toks_j, acc_j = rejection_sample(logits, drafts, b.num_draft, probs, b.temperature,
                                       b.top_k, b.top_p, b.keys, b.positions,
                                       all_greedy=False)
      sel = b.jnp_rows > 0
      toks, acc = jnp.where(sel[:, None], toks_j, toks), jnp.where(sel, acc_j, acc)
  else:
    toks, acc = rejection_sample(logits, drafts, b.num_draft, probs, b.temperature, b.top_k,
                                 b.top_p, b.keys, b.positions, all_greedy=greedy)
  if plan.synthetic_acceptance is not None and length:
    acc = _synthetic_accepted(b.keys, b.positions, b.num_draft, plan.synthetic_acceptance,
                              length)
    arg = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    last_tok = jnp.take_along_axis(arg, acc[:, None], axis=1)[:, 0]
    j = jnp.arange(length + 1)[None]
    padded = jnp.concatenate([drafts, jnp.full((drafts.shape[0], 1), -1, jnp.int32)], axis=1)
    toks = jnp.where(j < acc[:, None], padded, -1)
    toks = jnp.where(j == acc[:, None], last_tok[:, None], toks).astype(jnp.int32)
  if plan.tree:
    kv_caches, hidden = _tree_path_fixups(kv_caches, b.page_indices, nodes, acc, b.positions,
                                          hidden, plan.num_layers)
  last = jnp.take_along_axis(toks, acc[:, None], axis=1)[:, 0]
  last = jnp.zeros(plan.max_num_seqs, jnp.int32).at[: last.shape[0]].set(last)
  result = jnp.concatenate([toks, acc[:, None].astype(jnp.int32)], axis=1)
  return kv_caches, result, last, tuple(hidden)
