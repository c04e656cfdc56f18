"""SV: speculative verification (Kim et al. 2025, "Speculative Verification: Exploiting
Information Gain to Refine Speculative Decoding", arXiv 2509.24328; methods_reference.md
§1.5; no public code, so the estimator below is ours).

A companion model M_c with the target's vocabulary reads the context and the drafts
(its own paged KV, sharing the target's page table like ``draft_model``). For draft
position i, with P_d the draft distribution and P_c the companion's (both after the
row's temperature / top-k / top-p; greedy rows: P_d the one-hot draft, P_c the
untempered softmax):

* ``S_i = sum_v min(P_d(v), P_c(v))`` (draft-companion overlap, 1 - TV);
* ``A_i = min(1, P_c(x_i) / P_d(x_i))`` (the companion's acceptance of x_i).

Acceptance estimate (calibration, ours): ``p_i = (succ[b] + n0 * c_b) / (n[b] + n0)``
for the bin b of the row's feature u_i among ``num_bins`` equal bins of [0, 1], c_b
the bin centre (prior p = u: exact if the companion were the target, since
``E_{x~P_d} min(1, P_t(x)/P_d(x)) = sum min(P_d, P_t)``), succ / n the verified
outcomes seen in that bin. Position i counts as examined if the verifier reached it
(i <= accepted + 1, i <= verified) and as a success if it was accepted.

Verified length: ``gamma* = argmax E(gamma) / T(gamma)``, ``E(gamma) = 1 + sum_{j<=gamma}
prod_{i<=j} p_i``, ``T`` the row's step time (``specjax.cost_model.CostModel.step_time``
with 1 row, gamma + 1 tokens, its KV length, the draft forwards made as the drafter's
draft work), by the paper's incremental
search: gamma grows while goodput rises and stops at the first drop. Drafts past gamma*
are not verified.

Lossless under sampling: only a rule whose admission of x_i ignores x_i's own value is
exact (DSpark Appendix A). A_i depends on x_i, so sampled rows use u_i = S_i only; S_i
depends on x_{<i} alone, and the early-stopping search admits x_j from p_1..p_j, i.e.
from x_{<j} (a global argmax would let S_{j+1}, which depends on x_j, decide x_j). The
calibration tables of sampled rows are per request (history of that request only), so a
seeded request does not depend on its partners. Greedy rows use u_i = A_i with one
table shared by all greedy rows (any length rule is exact at T = 0). With a one-hot
greedy draft S_i = A_i = P_c(x_i), so at T = 0 the two features coincide.

Real models: with Qwen2.5-Coder-0.5B as draft and Qwen2.5-Coder-1.5B as target (vocab
151936 both), the companion must be a THIRD, draft-sized model of that vocabulary: the
paper's companion costs about the draft (1.3-5.3% of compute). Making the 1.5B the
companion would cost a target forward per step (companion = target), and the 0.5B
draft as companion gives S = A = 1 (no information). E.g. Qwen2.5-0.5B-Instruct (same
tokenizer, different training data) as companion; or, with a larger target such as
Qwen2.5-Coder-7B (vocab rows 152064: the engine's equal-vocab check would need the
padded rows handled), the 1.5B as companion for the 0.5B draft.

Runs on the synchronous host path: the companion's calibration tables and the per-row
gamma search run on the host between steps. Cost: one synchronous step each.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from methods.goodput import cached_profile, expected_committed, resolve_cost_model
from methods.wrapped import WrappedDrafter
from models.llama import init_kv_caches
from pallas_kernels.paged_attention.metadata import AttentionMetadata
from specjax.cost_model import CostModel
from specjax.engine import bucket
from specjax.sampling import is_greedy, processed_probs
from specjax.steps import SplitModel, forward_step, split_model

__all__ = ["SpeculativeVerification", "choose_gamma", "overlap_features"]


@jax.jit
def overlap_features(draft_probs, draft_tokens, companion_logits, temperature, top_k, top_p):
  """``(S f32[B, L], A f32[B, L])`` of the module docstring.

  Args:
    draft_probs: ``f32[B, L, V]`` P_d, or None for one-hot drafts.
    draft_tokens: ``i32[B, L]`` (-1 padding gives S = A = 0).
    companion_logits: ``f32[B, L, V]`` companion logits predicting each draft.
    temperature, top_k, top_p: ``[B]``; greedy rows score P_c untempered.
  """
  vocab = companion_logits.shape[-1]
  greedy = is_greedy(temperature)
  p_c = processed_probs(companion_logits, jnp.where(greedy, 1.0, temperature),
                        jnp.where(greedy, 0, top_k), jnp.where(greedy, 1.0, top_p))
  one_hot = jax.nn.one_hot(jnp.maximum(draft_tokens, 0), vocab, dtype=jnp.float32)
  p_d = one_hot if draft_probs is None else jnp.where(greedy[:, None, None], one_hot,
                                                      draft_probs)
  valid = draft_tokens >= 0
  s = jnp.where(valid, jnp.sum(jnp.minimum(p_d, p_c), axis=-1), 0.0)
  pc_x = jnp.sum(p_c * one_hot, axis=-1)
  pd_x = jnp.sum(p_d * one_hot, axis=-1)
  a = jnp.where(valid & (pd_x > 0), jnp.minimum(1.0, pc_x / jnp.where(pd_x > 0, pd_x, 1.0)),
                0.0)
  return s, a


def choose_gamma(p_hat: np.ndarray, step_time) -> int:
  """Incremental search: the largest gamma such that goodput rose at every step up to it.

  Args:
    p_hat: ``f[n]`` acceptance estimates of the drafted positions.
    step_time: ``gamma -> seconds``.

  Example: p_hat (0.9, 0.2), step_time 1 + 0.25 gamma: goodput 1.0, 1.52, 1.44 -> 1.
  """
  surv = np.cumprod(p_hat)
  gamma, best = 0, 1.0 / step_time(0)
  while gamma < len(p_hat):
    g = expected_committed(surv[: gamma + 1]) / step_time(gamma + 1)
    if g <= best:
      break
    gamma, best = gamma + 1, g
  return gamma


@dataclasses.dataclass
class _State:
  inner: Any
  companion: SplitModel
  caches: Any
  written: dict  # request id -> companion KV positions written
  cost: CostModel
  greedy_table: np.ndarray  # f64[2, num_bins]: successes, examined
  tables: dict  # request id -> f64[2, num_bins] (sampled rows)
  pending: dict  # request id -> (table key, bins i32[gamma], gamma)
  implementation: Any  # attention implementation of the companion forward


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpeculativeVerification(WrappedDrafter):
  """Companion-scored verified length around a chain drafter (module docstring).

  Attributes:
    companion: a ``models.zoo`` name or checkpoint path of the companion.
    companion_model: or the companion itself (a ``Transformer`` or ``SplitModel``).
    cost_model: a ``specjax.cost_model.CostModel`` (e.g. ``StepCostModel(...)``), the
      dict of ``StepCostModel``'s fields, a preset name or ``.json`` file
      (``specjax.cost_model.load``), or None to profile one at start-up.
    num_bins: calibration bins over [0, 1].
    prior_strength: n0, pseudo-observations of the prior in each bin (> 0).
    profile_context: KV length of the start-up profile.
  """

  name = "sv"
  companion: str | None = None
  companion_model: Any = dataclasses.field(default=None, compare=False, repr=False)
  cost_model: CostModel | dict | str | None = None
  num_bins: int = 8
  prior_strength: float = 2.0
  profile_context: int = 512

  def __post_init__(self):
    if (self.companion is None) == (self.companion_model is None):
      raise ValueError(f"companion={self.companion!r}: give exactly one of companion (a "
                       "model name or path) and companion_model")
    if self.num_bins < 1:
      raise ValueError(f"num_bins={self.num_bins} must be >= 1")
    if not self.prior_strength > 0:
      raise ValueError(f"prior_strength={self.prior_strength} must be > 0")
    super().__post_init__()
    object.__setattr__(self, "cost_model", resolve_cost_model(self.cost_model, self.inner.name))


  def init_state(self, runtime):
    model = self.companion_model
    if model is None:  # loaded once per method instance (every generate() calls init_state)
      dtype = str(jax.tree.leaves(runtime.target.params)[0].dtype)
      model = self.__dict__.get("_loaded", {}).get(dtype)
      if model is None:
        from models.zoo import load_model  # noqa: PLC0415 (heavy; only when named)

        model = split_model(load_model(self.companion, dtype).model)
        object.__setattr__(self, "_loaded", {dtype: model})
    companion = model if isinstance(model, SplitModel) else split_model(model)
    if companion.config.vocab_size != runtime.target.config.vocab_size:
      raise ValueError(f"companion vocab_size={companion.config.vocab_size} must equal the "
                       f"target's {runtime.target.config.vocab_size}")
    cost = self.cost_model or cached_profile(self, runtime, self.k, self.profile_context)
    caches = init_kv_caches(companion.config, runtime.num_pages, runtime.page_size)
    return _State(self.inner.init_state(runtime), companion, caches, {}, cost,
                  np.zeros((2, self.num_bins)), {}, {}, runtime.attention_implementation)

  def _p_hat(self, table: np.ndarray, bins: np.ndarray) -> np.ndarray:
    centres = (bins + 0.5) / self.num_bins
    n0 = self.prior_strength
    return (table[0, bins] + n0 * centres) / (table[1, bins] + n0)

  def _companion_logits(self, state: _State, ctx, tokens: np.ndarray, num: np.ndarray):
    """Companion forward over each row's unwritten tokens + its drafts; returns logits
    ``f32[B, k, V]`` predicting d_1 .. d_k (row i's first at input index lag_i - 1)."""
    batch = ctx.page_indices.shape[0]
    rows = len(ctx.request_ids)
    lags = np.zeros(batch, np.int32)
    for i, (rid, t) in enumerate(zip(ctx.request_ids, ctx.token_ids)):
      valid = min(state.written.get(rid, 0), len(t) - 1)
      lags[i] = len(t) - valid if num[i] else 0
    q_lens = np.where(np.arange(batch) < rows, lags + np.pad(num, (0, batch - rows)), 0)
    q_lens = np.where(lags > 0, q_lens, 0).astype(np.int32)
    t_len = bucket(int(q_lens.max()), 1 << 30, minimum=8)
    inputs = np.zeros((batch, t_len), np.int32)
    kv_lens = np.zeros(batch, np.int32)
    for i, (rid, t) in enumerate(zip(ctx.request_ids, ctx.token_ids)):
      if not lags[i]:
        continue
      seq = np.concatenate([t[len(t) - lags[i]:], tokens[i, : num[i]]])
      inputs[i, : len(seq)] = seq
      kv_lens[i] = len(t) + num[i]
      state.written[rid] = len(t) + int(num[i])
    idx = np.clip(np.maximum(lags - 1, 0)[:, None] + np.arange(self.k)[None], 0,
                  np.maximum(q_lens - 1, 0)[:, None]).astype(np.int32)
    meta = AttentionMetadata(ctx.page_indices, kv_lens, q_lens)
    state.caches, logits, _ = forward_step(
        state.companion.graphdef, state.companion.params, state.caches, inputs, meta, idx,
        implementation=state.implementation)
    return logits

  def propose(self, state: _State, ctx):
    # A request new to the drafter (first seen, or back from a preemption): its
    # companion KV is rebuilt; its calibration table (popped when it finishes) is kept,
    # so a preemption does not change its verified lengths.
    for rid in ctx.new_requests:
      state.written[rid] = 0
    state.inner, draft = self.inner.propose(state.inner, ctx)
    rows = len(ctx.request_ids)
    batch = ctx.page_indices.shape[0]
    num = np.minimum(np.asarray(draft.num_tokens)[:rows], ctx.budgets[:rows]).astype(np.int32)
    state.pending = {}
    if not num.any():
      return state, draft
    tokens = np.full((batch, self.k), -1, np.int32)
    host = np.asarray(draft.tokens)[:rows, : self.k]
    for i in range(rows):
      tokens[i, : num[i]] = host[i, : num[i]]
    logits = self._companion_logits(state, ctx, tokens, num)
    probs = None if draft.probs is None else draft.probs[:, : self.k]
    s, a = overlap_features(probs, tokens, logits, ctx.temperature, ctx.top_k, ctx.top_p)
    s, a = np.asarray(s), np.asarray(a)
    greedy = is_greedy(np.asarray(ctx.temperature[:rows]))
    gammas = np.zeros(rows, np.int32)
    for i, (rid, seq) in enumerate(zip(ctx.request_ids, ctx.token_ids)):
      n = int(num[i])
      if not n:
        continue
      u = a[i, :n] if greedy[i] else s[i, :n]
      bins = np.minimum((u * self.num_bins).astype(np.int32), self.num_bins - 1)
      key = None if greedy[i] else rid
      table = state.greedy_table if key is None else state.tables.setdefault(
          rid, np.zeros((2, self.num_bins)))
      kv = len(seq)
      drafted = {self.inner.name: (1, n)}
      gammas[i] = choose_gamma(self._p_hat(table, bins),
                               lambda g, kv=kv, d=drafted: state.cost.step_time(
                                   1, g + 1, kv, d, length=g, speculative=True))
      state.pending[rid] = (key, bins[: gammas[i]], int(gammas[i]))
    return state, dataclasses.replace(draft, num_tokens=gammas)

  def observe(self, state: _State, result):
    for b, rid in enumerate(result.request_ids):
      key, bins, gamma = state.pending.get(rid, (None, None, 0))
      if rid in result.finished:
        state.tables.pop(rid, None)
        state.written.pop(rid, None)
      elif gamma:
        acc = int(result.num_accepted[b])
        seen = min(gamma, acc + 1)
        table = state.greedy_table if key is None else state.tables[rid]
        np.add.at(table[1], bins[:seen], 1.0)
        np.add.at(table[0], bins[: min(acc, seen)], 1.0)
    state.inner = self.inner.observe(state.inner, result)
    return state

  def observe_prefill(self, state: _State, result):
    state.inner = self.inner.observe_prefill(state.inner, result)
    return state
