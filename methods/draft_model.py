"""Draft-model speculative decoding (Leviathan et al. 2023; Chen et al. 2023).

A smaller model with the same tokenizer drafts k tokens autoregressively with its own
paged KV cache, which shares the target's page table (same page ids, its own arrays).
After verification its KV is rolled back to the accepted length by bookkeeping only:
each request's valid draft KV length is ``min(written, committed - 1)``.

A row drafts at most its budget (``ProposeContext.budgets``): a step runs
``max(budgets)`` draft forwards (none when every budget is 0), and a row takes part
only in the first ``budget`` of them, so no position past the budget (e.g. at or past
``max_model_len``) is computed or written.

With ``stop_entropy`` set (SVIP, ``methods.svip``) a row also stops after the first
draft whose draft distribution has entropy above it; the loop then ends as soon as
every row has stopped, so the step may run fewer than ``max(budgets)`` forwards.

By default (``fused=True``, no ``stop_entropy``) the drafting runs inside the engine's
one device call per iteration (``propose_device``): the draft KV pool and each slot's
written length live on the device, every step runs k draft forwards (rows past their
budget are masked out), the draft KV of a prompt is filled in the target's prefill call
(``prefill_device``), and iterations run asynchronously. ``fused=False`` (and SVIP,
whose ``lax.while_loop`` would make the host wait for the device) is the host-called
path above, one synchronous step each.

Sampled rows draw each draft from the draft model's processed distribution q with the
request's draft-stream key and hand q to the verifier (Leviathan et al.'s min(1, p/q)
rule). With ``coupled_sampling=True`` the draft at position j is instead the Gumbel-max
race over q with the noise the verifier races p with at j
(``specjax.sampling.draft_sample``) and goes to the verifier without q (the coupled
rule of ``specjax.verify``): lossless, a seeded request emits its seeded AR tokens
whatever its batch partners, at a lower acceptance.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.llama import init_kv_caches
from pallas_kernels.paged_attention.metadata import AttentionMetadata
from specjax.method import Capabilities, DeviceDraft, Draft, Method
from specjax.sampling import draft_sample, is_greedy, processed_probs
from specjax.steps import forward_step

__all__ = ["DraftDeviceState", "DraftKV", "DraftModel", "DraftParams", "continue_chain",
           "draft_pick", "draft_tokens_step", "draft_until_uncertain_step", "entropy_nats"]


@functools.partial(
    jax.jit,
    static_argnames=("graphdef", "k", "num_steps", "all_greedy", "implementation", "coupled"),
    donate_argnames=("kv_caches",),
)
def draft_tokens_step(graphdef, params, kv_caches, pending, meta: AttentionMetadata, budgets,
                      temperature, top_k, top_p, keys, positions, *, k, num_steps, all_greedy,
                      implementation, coupled=False):
  """Drafts ``budgets[b]`` tokens for row b in ``num_steps`` draft forwards.

  Args:
    pending: ``i32[B, 2]`` tokens not yet in the draft KV (1 or 2 per row, q_lens says).
    meta: q_lens = pending counts (0 = padding or budget-0 row), kv_lens after writing them.
    budgets: ``i32[B]`` draft tokens per row (<= num_steps; 0 for rows with q_lens 0).
      Forward i (0-based) produces draft i + 1 and includes only rows with budget > i.
    positions: ``i32[B]`` absolute position of the first draft token.
    k: static width of the outputs (the method's k).
    num_steps: static number of draft forwards, ``max(budgets)`` (1 <= num_steps <= k).
    coupled: static; sample with the verifier's noise and return no probs
      (``draft_pick``).

  Returns:
    ``(kv_caches, tokens i32[B, k], probs f32[B, k, V] or None when all_greedy or
    coupled)``; entries at and past a row's budget are garbage (tokens -1 past
    ``num_steps``, probs 0).
  """
  model = nnx.merge(graphdef, params)
  pick = draft_pick(temperature, top_k, top_p, keys, all_greedy, coupled)

  def forward(caches, tok, step_meta):  # tok i32[B, 1] -> (caches, logits f32[B, V])
    caches, o = model(caches, tok, step_meta, logits_indices=jnp.zeros_like(tok),
                      implementation=implementation)
    return caches, o.logits[:, 0]

  idx = jnp.maximum(meta.q_lens - 1, 0)[:, None]
  kv_caches, out = model(kv_caches, pending, meta, logits_indices=idx,
                         implementation=implementation)
  tok, probs = pick(out.logits[:, 0], positions)
  return continue_chain(forward, pick, kv_caches, tok, probs, meta, budgets, positions, k=k,
                        num_steps=num_steps)


def draft_pick(temperature, top_k, top_p, keys, all_greedy: bool, coupled: bool = False):
  """``pick(logits f32[B, V], positions i32[B]) -> (tokens i32[B], probs)`` of a chain
  drafter: argmax (probs None) when every row is greedy, else a sample of the row's
  processed distribution q (``probs f32[B, V]``) at that position
  (``specjax.sampling.draft_sample``): with its draft-stream key, or, ``coupled``, by
  the verifier's Gumbel race over q (probs None: the draft is verified without q)."""
  def pick(logits, pos):
    if all_greedy:
      return jnp.argmax(logits, axis=-1).astype(jnp.int32), None
    probs = processed_probs(logits[:, None], temperature, top_k, top_p)[:, 0]
    return draft_sample(probs, keys, pos, coupled=coupled), None if coupled else probs

  return pick


def continue_chain(forward, pick, kv_caches, tok, probs, meta: AttentionMetadata, budgets,
                   positions, *, k: int, num_steps: int):
  """Draft forwards 2 .. ``num_steps`` of a chain drafter with its own paged KV (a draft
  model, LayerSkip's early exit), after the first forward drafted ``tok`` (``probs``).

  Forward i (1-based from 1) feeds draft d_i at position ``positions + i - 1`` to draft
  d_{i+1}, for the rows with budget > i (the others write nothing).

  Args:
    forward: ``(caches, tok i32[B, 1], step_meta) -> (caches, logits f32[B, V])``.
    pick: ``draft_pick``'s function. meta: the first forward's metadata (kv_lens after it).
    probs: the first draft's q ``f32[B, V]``, or None (``pick`` gives no q: all greedy,
      or coupled).

  Returns:
    ``(kv_caches, tokens i32[B, k], probs f32[B, k, V] or None)``: tokens -1 past
    ``num_steps``, probs 0 there; None where ``pick`` gives none.
  """
  def body(carry, i):
    caches, tok = carry
    active = budgets > i  # feeds d_i at position positions + i - 1 to draft d_{i+1}
    step_meta = AttentionMetadata(meta.page_indices, jnp.where(active, meta.kv_lens + i, 0),
                                  active.astype(jnp.int32))
    caches, logits = forward(caches, tok[:, None], step_meta)
    nxt, p = pick(logits, positions + i)
    return (caches, nxt), (nxt, p)

  (kv_caches, _), (toks, ps) = jax.lax.scan(body, (kv_caches, tok), jnp.arange(1, num_steps))
  tokens = jnp.concatenate([tok[:, None], toks.T], axis=1)
  tokens = jnp.pad(tokens, ((0, 0), (0, k - num_steps)), constant_values=-1)
  if probs is None:
    return kv_caches, tokens, None
  probs = jnp.concatenate([probs[:, None], jnp.moveaxis(ps, 0, 1)], axis=1)
  return kv_caches, tokens, jnp.pad(probs, ((0, 0), (0, k - num_steps), (0, 0)))


def entropy_nats(logits: jax.Array) -> jax.Array:
  """``f32[..., V]`` logits -> ``f32[...]`` entropy of their softmax, in nats."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return -jnp.sum(jnp.where(logp > -jnp.inf, jnp.exp(logp) * logp, 0.0), axis=-1)


@functools.partial(
    jax.jit, static_argnames=("graphdef", "k", "all_greedy", "implementation", "stop_entropy",
                              "coupled"),
    donate_argnames=("kv_caches",),
)
def draft_until_uncertain_step(graphdef, params, kv_caches, pending, meta: AttentionMetadata,
                               budgets, temperature, top_k, top_p, keys, positions, num_steps,
                               *, k, all_greedy, implementation, stop_entropy, coupled=False):
  """``draft_tokens_step`` with SVIP's entropy stop: row b ends after draft t (1-based)
  when ``H(softmax(raw draft logits of t)) > stop_entropy`` (nats; before temperature /
  top-k / top-p): draft t is kept and no later one is computed. A ``lax.while_loop``
  over draft forwards ends when every row has stopped (budget or entropy) or after
  ``num_steps`` (a traced ``i32``, so one compile serves every length) forwards; row b
  takes part in forward i (feeding d_i) only while it is live, as in the fixed scan.
  ``coupled`` (static): drafts as ``draft_pick``'s coupled pick, no probs.

  Returns:
    ``(kv_caches, tokens i32[B, k] (-1 past num_tokens), probs f32[B, k, V] or None when
    all_greedy or coupled, num_tokens i32[B])``.
  """
  model = nnx.merge(graphdef, params)
  batch = pending.shape[0]
  no_probs = all_greedy or coupled
  vocab = 0 if no_probs else model.cfg.vocab_size

  def pick(logits, pos):  # logits [B, V] -> (tokens, probs [B, V] or [B, 0], stop bool[B])
    stop = entropy_nats(logits) > stop_entropy
    if all_greedy:
      tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
      return tok, jnp.zeros((logits.shape[0], 0), jnp.float32), stop
    probs = processed_probs(logits[:, None], temperature, top_k, top_p)[:, 0]
    tok = draft_sample(probs, keys, pos, coupled=coupled)
    return tok, probs[:, :vocab], stop

  idx = jnp.maximum(meta.q_lens - 1, 0)[:, None]
  kv_caches, out = model(kv_caches, pending, meta, logits_indices=idx,
                         implementation=implementation)
  tok, p0, stop = pick(out.logits[:, 0], positions)
  has = budgets > 0
  tokens = jnp.full((batch, k), -1, jnp.int32).at[:, 0].set(jnp.where(has, tok, -1))
  probs = jnp.zeros((batch, k, vocab), jnp.float32)
  probs = probs.at[:, 0].set(p0)
  num = has.astype(jnp.int32)
  live = has & (budgets > 1) & ~stop

  def cond(carry):
    i, live = carry[0], carry[2]
    return (i < num_steps) & jnp.any(live)

  def body(carry):
    i, caches, live, tok, tokens, probs, num = carry
    # Forward i feeds d_i at position positions + i - 1 to draft d_{i+1} (live rows only).
    step_meta = AttentionMetadata(meta.page_indices, jnp.where(live, meta.kv_lens + i, 0),
                                  live.astype(jnp.int32))
    caches, o = model(caches, tok[:, None], step_meta,
                      logits_indices=jnp.zeros_like(tok)[:, None], implementation=implementation)
    nxt, p, stop = pick(o.logits[:, 0], positions + i)
    tokens = tokens.at[:, i].set(jnp.where(live, nxt, -1))
    probs = probs.at[:, i].set(jnp.where(live[:, None], p, 0.0))
    num = num + live.astype(jnp.int32)
    live = live & (budgets > i + 1) & ~stop
    return i + 1, caches, live, jnp.where(live, nxt, tok), tokens, probs, num

  carry = (jnp.int32(1), kv_caches, live, tok, tokens, probs, num)
  _, kv_caches, _, _, tokens, probs, num = jax.lax.while_loop(cond, body, carry)
  return kv_caches, tokens, None if no_probs else probs, num


@dataclasses.dataclass
class DraftKV:
  """A draft model's paged KV next to the target's (same page table) and its bookkeeping.

  Shared by the methods that draft with ``--draft`` (``DraftModel``, ``methods.hsddw``).
  """

  runtime: object
  kv_caches: jax.Array  # [num_layers * num_pages, page_size, 2K, H] (init_kv_caches)
  written: dict  # request id -> draft KV positions written (a valid prefix of tokens + draft)

  @classmethod
  def create(cls, runtime) -> DraftKV:
    return cls(runtime, init_kv_caches(runtime.draft.config, runtime.num_pages,
                                       runtime.page_size), {})

  def idle(self, ctx) -> None:
    """Bookkeeping of a step in which no row drafts (no draft forward)."""
    for rid in ctx.new_requests:
      self.written[rid] = 0
    for rid, t in zip(ctx.request_ids, ctx.token_ids):
      self.written[rid] = min(self.written.get(rid, 0), len(t) - 1)

  def sync(self, ctx, budgets: np.ndarray):
    """Brings the draft KV of every drafting row (budget > 0) up to its committed tokens
    but the last one or two, and returns what the row must still feed.

    Rows lagging by more than one token (new or preempted requests) are caught up by
    one draft prefill; a budget-0 row is caught up when it next drafts.

    Returns:
      ``(pending i32[B, 2], q_lens i32[B], kv_lens i32[B])`` over the padded batch:
      row i's ``q_lens[i]`` (1 or 2; 0 for budget-0 and padding rows) tokens not yet
      in the draft KV, and its KV length once they are written (= ``len(tokens)``).
    """
    rt = self.runtime
    batch = ctx.page_indices.shape[0]
    for rid in ctx.new_requests:
      self.written[rid] = 0
    valid = [min(self.written.get(rid, 0), len(t) - 1)
             for rid, t in zip(ctx.request_ids, ctx.token_ids)]
    lag = [len(t) - 1 - v if b > 0 else 0 for t, v, b in zip(ctx.token_ids, valid, budgets)]
    if max(lag, default=0) > 1:
      t_len = 16
      while t_len < max(lag):
        t_len *= 2
      tokens = np.zeros((batch, t_len), np.int32)
      q_lens = np.zeros(batch, np.int32)
      kv_lens = np.zeros(batch, np.int32)
      for i, (t, v) in enumerate(zip(ctx.token_ids, valid)):
        if lag[i] > 1:
          tokens[i, : lag[i]] = t[v: len(t) - 1]
          q_lens[i], kv_lens[i] = lag[i], len(t) - 1
          valid[i] = len(t) - 1
      meta = AttentionMetadata(ctx.page_indices, kv_lens, q_lens)
      self.kv_caches, _, _ = forward_step(
          rt.draft.graphdef, rt.draft.params, self.kv_caches, tokens, meta,
          np.maximum(q_lens - 1, 0)[:, None], implementation=rt.attention_implementation)
    pending = np.zeros((batch, 2), np.int32)
    q_lens = np.zeros(batch, np.int32)
    kv_lens = np.zeros(batch, np.int32)
    for i, (rid, t, v) in enumerate(zip(ctx.request_ids, ctx.token_ids, valid)):
      self.written[rid] = v
      if budgets[i] <= 0:
        continue
      n_pend = len(t) - v  # 1 or 2
      pending[i, :n_pend] = t[v:]
      q_lens[i], kv_lens[i] = n_pend, len(t)
    return pending, q_lens, kv_lens

  def drop(self, finished) -> None:
    for rid in finished:
      self.written.pop(rid, None)


@dataclasses.dataclass(frozen=True)
class DraftParams:
  """The draft model as a fused proposer's params: ``params`` (arrays) plus the static
  ``graphdef`` and attention ``implementation`` (pytree metadata)."""

  params: object
  graphdef: object
  implementation: object


jax.tree_util.register_dataclass(DraftParams, data_fields=["params"],
                                 meta_fields=["graphdef", "implementation"])


@dataclasses.dataclass(frozen=True)
class DraftDeviceState:
  """A fused draft model's device state: its paged KV (``[num_layers * num_pages,
  page_size, 2K, H]``, the target's page ids) and ``written i32[S]``, per decode slot the
  draft KV positions written (a valid prefix of tokens + drafts; positions at or past
  the committed length minus one are rechecked against the commit)."""

  kv_caches: jax.Array
  written: jax.Array


jax.tree_util.register_dataclass(DraftDeviceState, data_fields=["kv_caches", "written"],
                                 meta_fields=[])


@dataclasses.dataclass(frozen=True, kw_only=True)
class DraftModel(Method):
  """k-token autoregressive drafting with a second model (``--draft``).

  Attributes:
    k: most draft tokens per row.
    stop_entropy: None, or a row stops after the first draft whose untempered draft
      distribution has entropy above this many nats (``draft_until_uncertain_step``;
      SVIP).
    fused: draft inside the engine's device step (module docstring); False: the
      host-called path (ignored with ``stop_entropy``, which always uses it).
    coupled_sampling: False (default): sampled drafts carry q and are verified by the
      optimal min(1, p/q) rule. True: each draft is the Gumbel-max race over q with the
      verifier's noise at its position and is verified by the coupled rule
      (``specjax.verify``): a seeded request emits its seeded AR tokens whatever its
      batch partners, at an acceptance of P(argmax(log q + g) = argmax(log p + g)) <=
      sum(min(p, q)). Greedy rows are unaffected.
  """

  name = "draft_model"
  k: int = 4
  stop_entropy: float | None = None
  fused: bool = True
  coupled_sampling: bool = False

  def __post_init__(self):
    if self.k < 1:
      raise ValueError(f"num_speculative_tokens k={self.k} must be >= 1")
    if self.stop_entropy is not None and not self.stop_entropy >= 0:
      raise ValueError(f"stop_entropy={self.stop_entropy} must be None or >= 0 (nats)")
    if not isinstance(self.fused, bool):
      raise ValueError(f"fused={self.fused!r} must be True (drafts in the engine's device step) "
                       "or False (host-called)")
    if not isinstance(self.coupled_sampling, bool):
      raise ValueError(f"coupled_sampling={self.coupled_sampling!r} must be True (drafts "
                       "verified by the coupled rule) or False (by min(1, p/q))")

  @property
  def num_speculative_tokens(self) -> int:
    return self.k

  def capabilities(self) -> Capabilities:
    fused = self.fused and self.stop_entropy is None
    return Capabilities(runs_on="fused" if fused else "device",
                        emits_draft_probs=not self.coupled_sampling, needs_draft_model=True)

  def host_capabilities(self) -> Capabilities:
    """Its ``propose`` (called by a composite method) is the host-called device path."""
    return dataclasses.replace(self.capabilities(), runs_on="device")

  def init_state(self, runtime):
    return DraftKV.create(runtime)

  # ------------------------------------------------------------------ fused path
  def init_device(self, runtime):
    draft = runtime.draft
    params = DraftParams(draft.params, draft.graphdef, runtime.attention_implementation)
    state = DraftDeviceState(
        init_kv_caches(draft.config, runtime.num_pages, runtime.page_size),
        jnp.zeros(runtime.max_num_seqs, jnp.int32))
    return params, state

  def prefill_device(self, params: DraftParams, state: DraftDeviceState, tokens, meta,
                     hidden=()):
    """Writes the draft KV of the target's prefill chunk (same pages and positions)."""
    kv, _, _ = forward_step(params.graphdef, params.params, state.kv_caches, tokens, meta,
                            np.zeros((tokens.shape[0], 1), np.int32),
                            implementation=params.implementation)
    return dataclasses.replace(state, kv_caches=kv)

  def reset_device(self, params, state: DraftDeviceState, slots, num_tokens):
    """A new request's draft KV holds its prompt but the pending token (its prefill)."""
    written = state.written.at[jnp.where(slots >= 0, slots, state.written.shape[0])].set(
        jnp.asarray(num_tokens) - 1, mode="drop")
    return dataclasses.replace(state, written=written)

  def propose_device(self, params: DraftParams, state: DraftDeviceState, rows, *, all_greedy):
    """k draft forwards for every drafting row (``draft_tokens_step``), after feeding the
    one or two committed tokens its draft KV lacks. Example: committed length 20, a
    previous step wrote the draft KV through position 19 (``written`` 20): valid prefix
    min(20, 19) = 19 positions, so token 19 (the pending one) is fed alone; after a step
    in which every draft was accepted, the last draft and the bonus token are fed."""
    n_tok = rows.num_tokens
    num_slots = state.written.shape[0]
    valid = jnp.minimum(state.written[jnp.maximum(rows.slots, 0)], n_tok - 1)
    # lag <= 2 while a row drafts: each step feeds all but its last draft, and a commit
    # adds at most that draft and the bonus token beyond them (a budget-0 row ends).
    lag = jnp.clip(n_tok - valid, 1, 2)
    drafting = rows.budgets > 0
    col = jnp.arange(2)[None]
    idx = jnp.clip((n_tok - lag)[:, None] + col, 0, rows.tokens.shape[1] - 1)
    pending = jnp.where(col < lag[:, None], jnp.take_along_axis(rows.tokens, idx, axis=1), 0)
    meta = AttentionMetadata(rows.page_indices, jnp.where(drafting, n_tok, 0),
                             jnp.where(drafting, lag, 0))
    kv, tokens, probs = draft_tokens_step(
        params.graphdef, params.params, state.kv_caches, pending, meta, rows.budgets,
        rows.temperature, rows.top_k, rows.top_p, rows.keys, n_tok, k=self.k,
        num_steps=self.k, all_greedy=all_greedy, implementation=params.implementation,
        coupled=self.coupled_sampling)
    written = jnp.where(drafting, n_tok + rows.budgets - 1, valid)
    target = jnp.where(rows.active, rows.slots, num_slots)
    state = DraftDeviceState(kv, state.written.at[target].set(written, mode="drop"))
    return state, DeviceDraft(jnp.where(jnp.arange(self.k)[None] < rows.budgets[:, None],
                                        tokens, -1), rows.budgets, probs)

  def propose(self, state: DraftKV, ctx):
    rt = state.runtime
    rows = len(ctx.request_ids)
    batch = ctx.page_indices.shape[0]
    budgets = np.minimum(np.maximum(np.asarray(ctx.budgets[:rows], np.int32), 0), self.k)
    num_steps = int(budgets.max(initial=0))
    if num_steps == 0:  # nobody drafts: no draft forward at all
      state.idle(ctx)
      return state, Draft(np.full((rows, self.k), -1, np.int32), np.zeros(rows, np.int32))
    pending, q_lens, kv_lens = state.sync(ctx, budgets)
    row_budgets = np.zeros(batch, np.int32)
    row_budgets[:rows] = budgets
    all_greedy = bool(np.all(is_greedy(ctx.temperature[:rows])))
    meta = AttentionMetadata(ctx.page_indices, kv_lens, q_lens)
    if self.stop_entropy is None:
      state.kv_caches, tokens, probs = draft_tokens_step(
          rt.draft.graphdef, rt.draft.params, state.kv_caches, pending, meta, row_budgets,
          ctx.temperature, ctx.top_k, ctx.top_p, ctx.keys, kv_lens,
          k=self.k, num_steps=num_steps, all_greedy=all_greedy,
          implementation=rt.attention_implementation, coupled=self.coupled_sampling,
      )
      num = budgets
    else:
      state.kv_caches, tokens, probs, num = draft_until_uncertain_step(
          rt.draft.graphdef, rt.draft.params, state.kv_caches, pending, meta, row_budgets,
          ctx.temperature, ctx.top_k, ctx.top_p, ctx.keys, kv_lens, np.int32(num_steps),
          k=self.k, all_greedy=all_greedy, implementation=rt.attention_implementation,
          stop_entropy=self.stop_entropy, coupled=self.coupled_sampling)
      num = np.minimum(np.asarray(num, np.int32)[:rows], budgets)
    tokens = np.array(tokens)[:rows]
    for i, (rid, t) in enumerate(zip(ctx.request_ids, ctx.token_ids)):
      b = int(num[i])
      tokens[i, b:] = -1
      if b > 0:  # fed: the pending tokens and drafts d_1 .. d_{b-1}
        state.written[rid] = len(t) + b - 1
    return state, Draft(tokens, num, probs=probs)

  def observe(self, state: DraftKV, result):
    state.drop(result.finished)
    return state
