"""TurboSpec: closed-loop speculation control by goodput (Liu et al. 2024, arXiv
2406.14066 "Optimizing Speculative Decoding for Serving LLMs Using Goodput" / v3
"TurboSpec"); the estimator is vLLM ``adaptive_k``'s per-position EMA
(methods_reference.md §1.3). The paper's exact equations were not available; this is
the standard instantiation stated there.

Wraps any chain drafter. State per request: ``alpha[j]`` (j = 1..k), an EMA of the
conditional acceptance of draft position j (prior ``prior``, factor ``beta``; updated
from each verification by ``goodput.update_position_ema``). Per step, before drafting:
the prefix survival of slot (r, j) is ``a[r, j] = prod_{i<=j} alpha[r, i]``; slots are
added in descending ``a`` (ties: position, then row), and the step's predicted goodput
``(rows + sum of admitted a) / T`` is evaluated after each, with ``T`` from the step
cost model (batched tokens = rows + admitted slots, KV = the rows' lengths, draft
forwards = the longest admitted length). The best prefix sets each row's draft length
(0..min(k, budget)); when no slot pays (e.g. verification costly under load) every
row drafts 0 and the step is plain decoding. The drafter then drafts those lengths.

Cost model: ``specjax.cost_model.CostModel``, injected (``cost_model``: a model, a
preset name or JSON file, or ``StepCostModel``'s fields), or profiled at ``init_state`` on
this hardware (``goodput.profile_cost_model``: the target's forward timed at a few
widths). The drafter's draft cost is the model's for its method name (or ``ANY_METHOD``).

Lossless: lengths depend on history and load only, never on the step's drafts. Note:
they do depend on the batch (load), so over a drafter with draft probabilities (the
draft model) a seeded SAMPLED request's exact tokens can change with its partners (its
distribution does not; ``specjax.verify`` keeps the optimal rule for q-drafts); over one
without (n-gram), or with its ``coupled_sampling`` option on, the coupled rule emits its
AR tokens; greedy rows are unaffected.

Runs on the synchronous host path: per-row draft lengths come from host EMAs and a step-
cost model before each step, and the EMAs need each step's acceptance, so step n+1
cannot be planned before step n is read. Cost: one synchronous step (the device idles
during the host's planning, propose and commit).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from methods.goodput import cached_profile, resolve_cost_model, update_position_ema
from methods.wrapped import WrappedDrafter
from specjax.cost_model import ANY_METHOD, CostModel

__all__ = ["TurboSpec", "plan_lengths"]


def plan_lengths(alphas: np.ndarray, budgets: np.ndarray, kv_tokens: int,
                 cost: CostModel, drafter: str = ANY_METHOD) -> np.ndarray:
  """Per-row draft lengths ``i32[R]`` that maximise predicted goodput.

  Args:
    alphas: ``f[R, k]`` conditional acceptance estimates per row and position.
    budgets: ``i32[R]`` most drafts per row (<= k).
    kv_tokens: KV positions the step's rows read.
    cost: the step cost model (``CostModel.step_time``: ``rows`` rows, ``rows`` + admitted
      slots query tokens, the longest admitted length as ``drafter``'s draft work).
    drafter: the method whose draft cost ``cost`` charges.

  Example: one row, alpha (0.9, 0.1), cost 1 + 0.1 per batched token: length 0 gives
  1 / 1.1 = 0.91, length 1 gives 1.9 / 1.2 = 1.58, length 2 gives 1.99 / 1.3 = 1.53 ->
  length 1.
  """
  rows, k = alphas.shape
  surv = np.cumprod(alphas, axis=1)
  slots = [(-surv[r, j], j, r) for r in range(rows) for j in range(min(k, int(budgets[r])))]
  slots.sort()
  lengths = np.zeros(rows, np.int32)
  gain = float(rows)
  best = gain / cost.step_time(rows, rows, kv_tokens)
  best_m, longest = 0, 0
  for m, (neg, j, _r) in enumerate(slots, 1):
    gain -= neg
    longest = max(longest, j + 1)
    g = gain / cost.step_time(rows, rows + m, kv_tokens, {drafter: (rows, longest)})
    if g > best:
      best, best_m = g, m
  for _, j, r in slots[:best_m]:  # survival is non-increasing in j: prefixes per row
    lengths[r] = max(lengths[r], j + 1)
  return lengths


@dataclasses.dataclass
class _State:
  inner: Any
  cost: CostModel
  alpha: dict  # request id -> f64[k]
  drafted: dict  # request id -> draft tokens kept in the last step


@dataclasses.dataclass(frozen=True, kw_only=True)
class TurboSpec(WrappedDrafter):
  """Goodput-driven per-request draft lengths around ``drafter`` (module docstring).

  Attributes:
    beta: EMA factor in (0, 1] (vLLM adaptive_k: 0.3).
    prior: initial alpha of a new request, in [0, 1] (vLLM adaptive_k: 0.85).
    cost_model: a ``specjax.cost_model.CostModel`` (e.g. ``StepCostModel(...)``), the
      dict of ``StepCostModel``'s fields, a preset name or ``.json`` file
      (``specjax.cost_model.load``), or None to profile one at start-up.
    profile_context: KV length (tokens) of the start-up profile.
  """

  name = "turbospec"
  beta: float = 0.3
  prior: float = 0.85
  cost_model: CostModel | dict | str | None = None
  profile_context: int = 512

  def __post_init__(self):
    if not 0 < self.beta <= 1:
      raise ValueError(f"beta={self.beta} must be in (0, 1]")
    if not 0 <= self.prior <= 1:
      raise ValueError(f"prior={self.prior} must be in [0, 1]")
    if self.profile_context < 1:
      raise ValueError(f"profile_context={self.profile_context} must be >= 1")
    super().__post_init__()
    object.__setattr__(self, "cost_model", resolve_cost_model(self.cost_model, self.inner.name))

  def init_state(self, runtime):
    cost = self.cost_model or cached_profile(self, runtime, self.k, self.profile_context)
    return _State(self.inner.init_state(runtime), cost, {}, {})

  def propose(self, state: _State, ctx):
    for rid in ctx.new_requests:
      state.alpha[rid] = np.full(self.k, self.prior)
    alphas = np.stack([state.alpha.setdefault(rid, np.full(self.k, self.prior))
                       for rid in ctx.request_ids])
    budgets = np.minimum(np.asarray(ctx.budgets, np.int32), self.k)
    kv = int(sum(len(t) for t in ctx.token_ids))
    lengths = plan_lengths(alphas, budgets, kv, state.cost, self.inner.name)
    inner, draft = self.inner.propose(state.inner, dataclasses.replace(ctx, budgets=lengths))
    state.inner = inner
    kept = np.minimum(np.asarray(draft.num_tokens)[: len(ctx.request_ids)], lengths)
    state.drafted = dict(zip(ctx.request_ids, kept.tolist()))
    return state, draft

  def observe(self, state: _State, result):
    for b, rid in enumerate(result.request_ids):
      if rid in result.finished:
        state.alpha.pop(rid, None)
        continue
      n = state.drafted.get(rid, 0)
      if n:
        state.alpha[rid] = update_position_ema(state.alpha[rid], n, int(result.num_accepted[b]),
                                               self.beta)
    state.inner = self.inner.observe(state.inner, result)
    return state

  def observe_prefill(self, state: _State, result):
    state.inner = self.inner.observe_prefill(state.inner, result)
    return state
