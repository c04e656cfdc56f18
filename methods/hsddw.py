"""HSDDW: hierarchical speculative decoding with dynamic windows (Syu and Lee, Findings of
NAACL 2025, "Hierarchical Speculative Decoding with Dynamic Window",
aclanthology.org/2025.findings-naacl.462; read as its abstract and a secondary summary,
no code: ``methods_reference.md`` §1.6).

Three models per step. A fast drafter M1 (``m1``, n-gram prompt lookup by default, any
host chain drafter without draft probabilities) proposes up to k tokens ``m_0 ..``. The
draft model M2 (``--draft``) screens that block in ONE forward over ``[pending, m_0 ..
m_{n-1}]`` and picks its own token ``c_j`` at every position j (argmax, or a sample from
its processed distribution ``q_j`` with the request's draft key at that position). M2
keeps M1's tokens while they equal its own picks (``m_j == c_j`` for ``j < a``); at the
first difference its pick ``c_a`` is the correction that extends the block, and M2 then
drafts on autoregressively from it (the ``draft_model`` KV and keys). So every block
token is ``d_j = c_j``: M1 only lets M2 compute several of its tokens in one forward.
Drafting stops at the dynamic window: token ``d_j`` is drafted while every earlier
position had M2 entropy ``H(softmax(M2 logits)) <= tau`` (nats); the token at which the
entropy first exceeds tau is the last one (it is drafted, then the block is verified),
and a block never exceeds the row's budget (<= k). The target verifies the whole block
with the shared rejection sampler, q = M2's ``q_j`` (with ``coupled_sampling``, M2's
samples are the verifier's Gumbel race over ``q_j`` and the block goes without q to the
coupled rule of ``specjax.verify``).

Worked example (k = 4, tau = 1.0, budget 4): M1 proposes [7, 9, 3]; M2's screen picks c =
[7, 9, 5, 8] with entropies [0.2, 0.4, 0.9, 1.7]. Then a = 2 (7 and 9 kept), the
correction 5 is the third token and, as 0.2, 0.4, 0.9 <= 1.0, M2 runs one AR forward on
5, drafting d_3 (entropy 2.1 > tau: the last token, though the budget allows no more
anyway). Block [7, 9, 5, d_3]; M2 ran 2 forwards for 4 tokens.

Lossless (every variant): each block token is ``c_j``, a deterministic function (greedy)
or an exact sample of ``q_j`` given the tokens before it, and whether position j is
drafted depends only on entropies at positions < j (pre-token), so the target's shared
verification reproduces the target distribution. Greedy output equals greedy AR.

What the paper leaves open, and the choices made here:
  * tau's update: "the average entropy of tokens that were actually rejected by the
    target in the current sequence". Here ``tau_r = (prior_weight * initial_threshold +
    sum of rejected entropies) / (prior_weight + number rejected)``
    (``updated_threshold``): a rejected token is a step's first rejected draft, its
    entropy M2's at that position; tau starts at ``initial_threshold`` and lives per
    request (dropped when it ends).
  * Whether the token that trips the entropy gate is drafted: yes (above), so a drafting
    row drafts at least one token.
  * Which entropy: M2's softmax at temperature 1 (its own distribution), not the
    processed sampling distribution (greedy rows would otherwise always read 0).
  * "M2-verified tokens committed without the target" would be lossy; here the target
    verifies every committed token (the lossless reading).
  * How M2 verifies M1: the speculative rule with M1's one-hot q, realised as "M2 picks
    c_j; keep m_j iff m_j == c_j" (acceptance prob q_j(m_j); a mismatch is a sample of
    the residual), so it is greedy matching at temperature 0.

Counters (``HSDDWState.counters``): ``m1_proposed`` (M1 tokens screened),
``m1_accepted`` (M1 tokens kept in blocks), ``m2_tokens`` (block tokens M2 drafted
itself: corrections and AR tokens), ``m2_forwards`` (M2 forwards, screen included), and
``rejected`` (threshold updates).

Runs on the synchronous host path: M1 is a host drafter whose block M2 then screens, so
each step needs the previous step's committed tokens on the host. Cost: one synchronous
step each (M1's own host time plus the read and commit).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from methods.draft_model import DraftKV
from pallas_kernels.paged_attention.metadata import AttentionMetadata
from specjax.method import Capabilities, Draft, InnerMethodOption, Method
from specjax.sampling import draft_sample, is_greedy, processed_probs

__all__ = ["HSDDW", "HSDDWState", "hsddw_draft_step", "updated_threshold"]


def updated_threshold(initial: float, prior_weight: float, rejected_entropies) -> float:
  """tau of a request: the mean entropy of its rejected drafts, shrunk to ``initial``.

  ``(prior_weight * initial + sum(rejected_entropies)) / (prior_weight + n)``; e.g.
  initial 2.0, prior_weight 1, rejected entropies [1.0, 0.4] -> (2.0 + 1.4) / 3 = 1.1333.
  With ``prior_weight`` 0 it is the plain mean, and ``initial`` before any rejection.
  """
  h = np.asarray(rejected_entropies, np.float64)
  if prior_weight + h.size == 0:
    return float(initial)
  return float((prior_weight * initial + h.sum()) / (prior_weight + h.size))


def _leading_run(ok):
  """``bool[B, L] -> i32[B]`` length of the leading run of True."""
  return jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)


@functools.partial(
    jax.jit, static_argnames=("graphdef", "k", "all_greedy", "implementation", "coupled"),
    donate_argnames=("kv_caches",))
def hsddw_draft_step(graphdef, params, kv_caches, screen_tokens, meta: AttentionMetadata,
                     num_pending, num_m1, budgets, thresholds, temperature, top_k, top_p, keys,
                     positions, *, k, all_greedy, implementation, coupled=False):
  """M2 screens M1's blocks in one forward, then drafts on while the window allows.

  Args:
    screen_tokens: ``i32[B, 2 + k]`` row b: its ``num_pending[b]`` (1 or 2) tokens not
      yet in M2's KV, then its ``num_m1[b]`` M1 tokens, zero padded.
    meta: M2's paged metadata of the screen: q_lens = num_pending + num_m1 (0 for rows
      that do not draft), kv_lens after writing them.
    num_pending, num_m1, budgets: ``i32[B]`` (num_m1 <= budgets <= k; budget 0 = no
      draft).
    thresholds: ``f32[B]`` tau per row (nats).
    temperature, top_k, top_p, keys: the batch's sampling arrays.
    positions: ``i32[B]`` absolute position of the first draft token (= committed
      tokens).
    k: static block width; all_greedy: static, skips draft probabilities.
    coupled: static; M2 picks each ``c_j`` by the verifier's Gumbel race over ``q_j`` at
      its position (``specjax.sampling.draft_sample``) and no probs are returned.

  Returns:
    ``(kv_caches, tokens i32[B, k] (-1 past num), num i32[B], fed i32[B] (block tokens
    now in M2's KV), entropies f32[B, k], m1_kept i32[B], num_forwards i32[], probs
    f32[B, k, V] or None (all greedy, or coupled))``.
  """
  model = nnx.merge(graphdef, params)
  batch = screen_tokens.shape[0]
  drafting = budgets > 0

  def pick(logits, pos):  # logits [B, R, V]; pos i32[B, R]
    log_p = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    entropy = -jnp.sum(jnp.exp(log_p) * log_p, axis=-1)
    if all_greedy:
      return jnp.argmax(logits, axis=-1).astype(jnp.int32), entropy, None
    rows = logits.shape[1]
    probs = processed_probs(logits, temperature, top_k, top_p)
    toks = jnp.stack([draft_sample(probs[:, r], keys, pos[:, r], coupled=coupled)
                      for r in range(rows)], axis=1)
    return toks, entropy, None if coupled else probs

  # Screen: logits of the pending token and of each M1 token (prediction j at column
  # num_pending - 1 + j; columns past num_m1 read padding and are never kept).
  cols = jnp.arange(k + 1, dtype=jnp.int32)[None]
  idx = jnp.minimum(jnp.maximum(num_pending - 1, 0)[:, None] + cols, screen_tokens.shape[1] - 1)
  kv_caches, out = model(kv_caches, screen_tokens, meta, logits_indices=idx,
                         implementation=implementation)
  choice, entropy, probs = pick(out.logits, positions[:, None] + cols)
  m1 = jnp.take_along_axis(
      screen_tokens, jnp.minimum(num_pending[:, None] + cols[:, :k], 1 + k), axis=1)
  kept = _leading_run((m1 == choice[:, :k]) & (cols[:, :k] < num_m1[:, None]))
  calm = entropy[:, :k] <= thresholds[:, None]
  gate = _leading_run(calm)  # first position whose entropy exceeds tau
  num = jnp.where(drafting, jnp.minimum(jnp.minimum(kept, gate) + 1, budgets), 0)
  fed = jnp.minimum(num, kept)
  active = drafting & (gate > kept) & (kept + 1 < budgets)
  j = cols[:, :k]
  tokens = jnp.where(j < num[:, None], choice[:, :k], -1)
  ent = entropy[:, :k]
  q = None if probs is None else probs[:, :k]

  def cond(carry):
    return jnp.any(carry[5]) & (carry[6] < k)

  def body(carry):
    caches, tokens, ent, q, num, active, i, fed = carry
    last = jnp.take_along_axis(tokens, jnp.maximum(num - 1, 0)[:, None], axis=1)[:, 0]
    step_meta = AttentionMetadata(meta.page_indices, jnp.where(active, positions + num, 0),
                                  active.astype(jnp.int32))
    caches, o = model(caches, jnp.maximum(last, 0)[:, None], step_meta,
                      logits_indices=jnp.zeros((batch, 1), jnp.int32),
                      implementation=implementation)
    tok, h, p = pick(o.logits, (positions + num)[:, None])
    put = active[:, None] & (j == num[:, None])
    tokens = jnp.where(put, tok, tokens)
    ent = jnp.where(put, h, ent)
    if q is not None:
      q = jnp.where(put[..., None], p, q)
    fed = jnp.where(active, num, fed)
    num = num + active.astype(jnp.int32)
    active = active & (h[:, 0] <= thresholds) & (num < budgets)
    return caches, tokens, ent, q, num, active, i + 1, fed

  carry = (kv_caches, tokens, ent, q, num, active, jnp.int32(0), fed)
  kv_caches, tokens, ent, q, num, _, iters, fed = jax.lax.while_loop(cond, body, carry)
  return (kv_caches, tokens, num, fed, ent, jnp.minimum(kept, num), iters + 1, q)


@dataclasses.dataclass
class HSDDWState:
  """Per-run state: M2's KV, M1's state, per-request thresholds and counters."""

  draft_kv: DraftKV
  m1_state: Any
  rejected: dict  # request id -> list of rejected-draft entropies
  last_entropy: dict  # request id -> f32[num] entropies of the block in flight
  counters: dict


@dataclasses.dataclass(frozen=True, kw_only=True)
class HSDDW(Method):
  """Hierarchical drafting: M1 (``m1``) -> M2 (``--draft``) -> target, dynamic window.

  Attributes:
    k: most tokens per block (and M1's draft length).
    m1: the host chain drafter, a ``Method`` with the same k (through the registry: a
      method name, default "ngram"); it must run on the host, need no draft model and
      emit no draft probabilities.
    initial_threshold: tau before any rejection, in nats (> 0).
    prior_weight: weight of ``initial_threshold`` in the running mean (>= 0; 0: tau is
      the plain mean once a draft was rejected).
    coupled_sampling: M2 picks its sampled tokens by the verifier's Gumbel race over
      ``q_j`` and the block is verified by the coupled rule instead of min(1, p/q) (as
      ``methods.draft_model.DraftModel.coupled_sampling``).
  """

  name = "hsddw"
  inner_methods = (InnerMethodOption("m1", "ngram"),)
  k: int = 4
  m1: Method | None = None
  initial_threshold: float = 2.0
  prior_weight: float = 1.0
  coupled_sampling: bool = False

  def __post_init__(self):
    if self.k < 1:
      raise ValueError(f"num_speculative_tokens k={self.k} must be >= 1")
    if not (np.isfinite(self.initial_threshold) and self.initial_threshold > 0):
      raise ValueError(f"initial_threshold={self.initial_threshold} must be a finite "
                       "number > 0 (nats)")
    if not (np.isfinite(self.prior_weight) and self.prior_weight >= 0):
      raise ValueError(f"prior_weight={self.prior_weight} must be a finite number >= 0")
    if not isinstance(self.coupled_sampling, bool):
      raise ValueError(f"coupled_sampling={self.coupled_sampling!r} must be True (drafts "
                       "verified by the coupled rule) or False (by min(1, p/q))")
    m1 = self.m1
    caps = m1.host_capabilities() if isinstance(m1, Method) else None
    if caps is None or caps.runs_on != "host" or caps.emits_draft_probs or caps.tree \
        or caps.needs_draft_model or m1.num_speculative_tokens < 1:
      raise ValueError(f"m1={self.m1!r} must be a host chain drafter Method (e.g. NGram; by "
                       "name through methods.registry) that needs no draft model and emits "
                       "no draft probabilities")

  @property
  def num_speculative_tokens(self) -> int:
    return self.k

  def capabilities(self) -> Capabilities:
    return Capabilities(runs_on="device", emits_draft_probs=not self.coupled_sampling,
                        needs_draft_model=True)

  def describe(self) -> dict:
    return {"method": self.name, "k": self.k, "m1": self.m1.name,
            "initial_threshold": self.initial_threshold, "prior_weight": self.prior_weight,
            "coupled_sampling": self.coupled_sampling}

  def init_state(self, runtime):
    counters = dict(m1_proposed=0, m1_accepted=0, m2_tokens=0, m2_forwards=0, rejected=0)
    return HSDDWState(DraftKV.create(runtime), self.m1.init_state(runtime), {}, {}, counters)

  def threshold(self, state: HSDDWState, request_id) -> float:
    """tau of a request now (``updated_threshold`` of its rejected entropies)."""
    return updated_threshold(self.initial_threshold, self.prior_weight,
                             state.rejected.get(request_id, ()))

  def propose(self, state: HSDDWState, ctx):
    dkv = state.draft_kv
    rt = dkv.runtime
    rows = len(ctx.request_ids)
    batch = ctx.page_indices.shape[0]
    budgets = np.minimum(np.maximum(np.asarray(ctx.budgets[:rows], np.int32), 0), self.k)
    if budgets.max(initial=0) == 0:  # nobody drafts: no M1 or M2 call
      dkv.idle(ctx)
      for rid in ctx.request_ids:
        state.last_entropy[rid] = np.zeros(0, np.float32)
      return state, Draft(np.full((rows, self.k), -1, np.int32), np.zeros(rows, np.int32))
    state.m1_state, m1_draft = self.m1.propose(
        state.m1_state, dataclasses.replace(ctx, budgets=budgets))
    num_m1 = np.zeros(batch, np.int32)
    num_m1[:rows] = np.minimum(np.asarray(m1_draft.num_tokens[:rows]), budgets)
    pending, q_lens, kv_lens = dkv.sync(ctx, budgets)
    screen = np.zeros((batch, 2 + self.k), np.int32)
    row_budgets = np.zeros(batch, np.int32)
    row_budgets[:rows] = budgets
    num_m1 = np.where(row_budgets > 0, num_m1, 0)
    for i in range(rows):
      q, n = int(q_lens[i]), int(num_m1[i])
      screen[i, :q] = pending[i, :q]
      screen[i, q: q + n] = m1_draft.tokens[i, :n]
    thresholds = np.full(batch, self.initial_threshold, np.float32)
    thresholds[:rows] = [self.threshold(state, rid) for rid in ctx.request_ids]
    meta = AttentionMetadata(ctx.page_indices, np.where(q_lens > 0, kv_lens + num_m1, 0),
                             np.where(q_lens > 0, q_lens + num_m1, 0).astype(np.int32))
    all_greedy = bool(np.all(is_greedy(ctx.temperature[:rows])))
    out = hsddw_draft_step(
        rt.draft.graphdef, rt.draft.params, dkv.kv_caches, screen, meta, q_lens, num_m1,
        row_budgets, thresholds, ctx.temperature, ctx.top_k, ctx.top_p, ctx.keys, kv_lens,
        k=self.k, all_greedy=all_greedy, implementation=rt.attention_implementation,
        coupled=self.coupled_sampling)
    dkv.kv_caches, tokens, num, fed, ent, kept, iters, probs = out
    tokens, num, fed = np.array(tokens)[:rows], np.asarray(num)[:rows], np.asarray(fed)[:rows]
    ent, kept = np.asarray(ent)[:rows], np.asarray(kept)[:rows]
    c = state.counters
    c["m1_proposed"] += int(num_m1[:rows].sum())
    c["m1_accepted"] += int(kept.sum())
    c["m2_tokens"] += int((num - kept).sum())
    c["m2_forwards"] += int(iters)
    for i, (rid, t) in enumerate(zip(ctx.request_ids, ctx.token_ids)):
      state.last_entropy[rid] = ent[i, : num[i]].copy()
      if budgets[i] > 0:
        dkv.written[rid] = len(t) + int(fed[i])
    return state, Draft(tokens, num.astype(np.int32), probs=probs)

  def observe(self, state: HSDDWState, result):
    for i, rid in enumerate(result.request_ids):
      ent = state.last_entropy.get(rid)
      a = int(result.num_accepted[i])
      if ent is not None and a < ent.size:  # draft a (0-based) was rejected
        state.rejected.setdefault(rid, []).append(float(ent[a]))
        state.counters["rejected"] += 1
    state.m1_state = self.m1.observe(state.m1_state, result)
    state.draft_kv.drop(result.finished)
    for rid in result.finished:
      state.rejected.pop(rid, None)
      state.last_entropy.pop(rid, None)
    return state
