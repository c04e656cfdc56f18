"""Position-aware verify skipping: verify only the draft prefix worth its verify time.

Sources (``methods_reference.md`` §1.8): DSpark (Cheng et al., arXiv 2607.05147, §3.2,
Algorithm 1, §5.2, Appendix A) and vLLM's adaptive verification
(``vllm/v1/worker/gpu/spec_decode/adaptive_verification.py``,
``acceptance_estimator.py``): choose the verify budget from stale information, then
admit draft positions by their survival probability. A wrapper: the ``drafter`` drafts
as usual and this method truncates each row's draft before the target sees it.

Per step, with B rows, row budgets ``b_r`` and draft lengths ``n_r``:
  1. Stale stage (information from completed steps only). Per-position estimates
     ``c_j = P(draft j accepted | drafts < j accepted)`` learned online (Beta-smoothed
     counts, prior mean ``prior_mean``, weight ``prior_weight``; a missing draft counts
     as not accepted), survival ``s_j = c_1 .. c_j``, expected tokens ``E(L) = sum_r (1 +
     sum_{j <= min(b_r, L)} s_j)`` and the cost model ``T(B, L)`` (seconds of a verify
     step of B rows at length L, verify width L + 1: ``specjax.cost_model``'s
     ``CostModel.verify_time``, or a measured ``TableVerifyCost``) give the verify cap
     ``L* = argmax_L E(L) / T(B, L)`` over the engine's length buckets
     ``L = 1, 2, 4, .., k`` (smaller L on ties) and the marginal price of a token
     ``lambda = Theta* (T(B, L*) - T(B, 0)) / (B L*)``, ``Theta* = E(L*) / T(B, L*)``
     (a token pays for itself if its survival exceeds lambda: DSpark's marginal rule).
  2. Live stage (per row, pre-token). Draft confidence ``m_{r,j} = max_v q_{r,j}(v)``
     (the drafter's distribution at position j, computed before d_j is drawn; rows
     without draft probabilities use one bin), binned by ``confidence_bins``; survival
     ``a_{r,j} = prod_{i <= j} c_i[bin(m_{r,i})]`` from per-(position, bin) estimates of
     ``P(accepted | drafted, reached)``. Row r verifies ``l_r`` = the leading positions
     ``j <= min(n_r, L*)`` with ``a_{r,j} >= lambda``, and at least ``min(min_tokens,
     n_r, L*)`` (so position 1 keeps being observed).

Non-anticipating (DSpark §3.2.2, "admission decisions must not depend on future candidate
tokens"): L* and lambda are fixed before this step's drafts exist; draft j of row r is
admitted iff j <= n_r (the drafter's own length rule, itself pre-token), j <= L* and
``a_{r,i} >= lambda`` for all i <= j, where ``a_{r,i}`` depends on d_1 .. d_{i-1} only.
So no token's admission depends on its own value or later ones (the retrospective
global argmax of DSpark's Appendix A counterexample is avoided by taking the budget from
stale statistics, as vLLM and TensorRT-LLM do), and the shared verification stays
lossless. Greedy outputs equal AR for any rule.

Observations (vLLM's rule, 0-based position j): a position is labelled only if the
chain reached it and it was verified; label 1 iff accepted. The stale estimate also
labels a missing draft (j >= n_r) inside the cap as 0; a drafted position truncated by
lambda is censored.

Seeded requests: the verified lengths depend on the batch partners and on earlier
requests of the run (shared estimates, the batch's cost). Over a drafter without draft
probabilities (n-gram, the default) that changes nothing: the coupled rule of
``specjax.verify`` emits a seeded request's AR tokens whatever was drafted. Over one with
q (a draft model) its exact tokens may change with its partners; its distribution does
not (as in vLLM), unless the drafter's ``coupled_sampling`` option sends its drafts to the
coupled rule too. Wrapping ``hsddw`` counts a truncated
draft as rejected in its threshold. Cost by B rows, not the padded batch bucket.

Two paths (``capabilities().runs_on``, recorded by ``describe()``):

* Fused (a fused drafter without draft probabilities, e.g. the device n-gram, the
  default; unless ``host_path``): the drafter runs inside the engine's device step and
  iterations stay asynchronous. Before each dispatch the engine asks ``plan_verify``
  for per-row verify caps (``specjax.method.VerifyPlan``): stage 1 as above, and stage
  2 with its one confidence bin is row-independent, so row r's admitted length is
  ``min(n_r, budget_r, cap)`` with ``cap = min(L*, max(l_lambda, min_tokens))``, ``l_lambda``
  the leading positions ``j <= L*`` whose survival is >= lambda: a cap the device applies
  to the drafter's budget. The step verifies at the bucket of the largest cap. The
  estimates learn from each read iteration (``observe_read``). Staleness: the host
  reads call t-1 while call t runs, so call t+1's caps come from calls <= t-1 (one
  call staler than the host path; with ``EngineConfig.steps_per_dispatch`` N, one cap
  holds for the N iterations of a call). The drafter's own count n_r is not read back,
  only ``min(n_r, budget, cap)``: a reached position at or past the cap is censored
  (the host path labels it 0 when it was not drafted), so a drafter that often stops
  short of the cap gets slightly higher stale estimates here. Non-anticipating as
  above: the caps exist before the dispatch's drafts do. The drafter sees the cap as
  its budget; drafters whose draft is cut by the budget and otherwise unchanged by it
  (n-gram) draft the host path's tokens; others (suffix decoding's scored search)
  may draft differently under a smaller budget. Steps verify at least one draft
  width, also when nothing was drafted (no host sees the drafts first), as any fused
  proposer's steps do. Seeded requests: only drafters without q run here, so the
  coupled rule applies (above).
* Host (host drafters, drafters with draft probabilities, whose live stage needs the
  per-row confidences, and ``host_path=True``): the truncation is a host decision after
  the drafter's ``propose`` (a fused drafter's host ``propose``), one synchronous step
  each (the drafter's host cost plus the read and commit).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from specjax.cost_model import LinearVerifyCost, load
from specjax.method import Draft, InnerMethodOption, Method, VerifyPlan

__all__ = ["VerifySkip", "VerifySkipState", "choose_cap", "length_buckets"]


_DEFAULT_COST = LinearVerifyCost()


def _label(cost) -> str:
  """A cost model's name (``CostModel``), else its repr."""
  name = getattr(cost, "name", None)
  return name if isinstance(name, str) else repr(cost)


def length_buckets(k: int) -> list[int]:
  """The engine's verify length buckets up to k: 1, 2, 4, .., k (e.g. k = 6: 1, 2, 4, 6)."""
  out, b = [], 1
  while b < k:
    out.append(b)
    b *= 2
  return out + [k]


def choose_cap(survival: np.ndarray, budgets: np.ndarray, cost: Callable[[int, int], float],
               lengths: Sequence[int]) -> tuple[int, float, float]:
  """``(L*, Theta*, lambda)`` of the stale stage (module docstring, step 1).

  Args:
    survival: ``f32[k]`` s_j, non-increasing.
    budgets: ``i32[B]`` row budgets.
    cost: ``T(B, L)`` in seconds.
    lengths: candidate caps (increasing, >= 0; 0 verifies no draft, with
      ``min_tokens=0``).

  Example: s = [0.9, 0.45], one row of budget 2, T(1, L) = 1 + L: E(1) / T = 1.9 / 2 =
  0.95, E(2) / T = 2.35 / 3 = 0.78, so L* = 1, Theta* = 0.95, lambda = 0.95 (2 - 1) / 1.
  When L* = 0 wins (``min_tokens=0`` and verifying costs more than it brings), lambda
  is infinite.
  """
  rows = len(budgets)
  cum = np.concatenate([[0.0], np.cumsum(survival)])
  best = None
  for length in lengths:
    expected = float(np.sum(1.0 + cum[np.minimum(budgets, length)]))
    theta = expected / cost(rows, length)
    if best is None or theta > best[1] * (1 + 1e-12):
      best = (length, theta)
  length, theta = best
  if length == 0:  # nothing verified: no draft token pays for itself
    return 0, theta, float("inf")
  lam = theta * (cost(rows, length) - cost(rows, 0)) / (rows * length)
  return length, theta, float(lam)


@dataclasses.dataclass
class VerifySkipState:
  """Per-run state: the drafter's, the online counts and the step in flight."""

  inner: Any
  reach: np.ndarray  # f64[k] stale-stage labels per position
  accept: np.ndarray  # f64[k]
  reach_bin: np.ndarray  # f64[k, bins] live-stage labels per (position, bin)
  accept_bin: np.ndarray
  last: dict  # request id -> (verified, drafted, budget, cap, bins i32[verified])
  # steps, drafted (host path only), verified, caps (L* per step or dispatch), row_caps
  # (fused path: the dispatch's largest admitted cap)
  counters: dict
  costs: dict = dataclasses.field(default_factory=dict)  # (B, L) -> T(B, L) seconds, memo


@dataclasses.dataclass(frozen=True, kw_only=True)
class VerifySkip(Method):
  """Wraps ``drafter`` and verifies the prefix chosen by the non-anticipating rule.

  Attributes:
    k: most draft tokens (the drafter is built with the same k).
    drafter: the chain drafter, a ``Method`` (through the registry: a method name, default
      "ngram", built with the same k).
    cost_model: ``T(B, L)`` seconds: a ``specjax.cost_model.CostModel`` (its
      ``verify_time``; e.g. ``LinearVerifyCost(...)``), a preset name or ``.json`` file
      of one (``specjax.cost_model.load``), a ``TableVerifyCost`` or any callable
      ``(batch, length) -> seconds``; None: ``LinearVerifyCost()``.
    prior_mean: prior acceptance per position, in (0, 1).
    prior_weight: pseudo-observations of the prior (> 0).
    confidence_bins: increasing edges in (0, 1) of the draft max-probability bins.
    min_tokens: drafts always verified when present (0 or 1).
    host_path: run on the synchronous host path even over a fused drafter without
      draft probabilities (for comparison; module docstring).

  Raises:
    ValueError: an option out of range (named in the message), a drafter that is not a
      chain ``Method`` with k >= ``k``, a ``TableVerifyCost`` whose lengths stop short of
      ``k``; while running, a cost model time that is not finite and > 0.
  """

  name = "verify_skip"
  inner_methods = (InnerMethodOption("drafter", "ngram"),)
  k: int = 4
  drafter: Method | None = None
  cost_model: Any = None
  prior_mean: float = 0.8
  prior_weight: float = 2.0
  confidence_bins: tuple[float, ...] = (0.5, 0.8, 0.95)
  min_tokens: int = 1
  host_path: bool = False
  _inner: Method = dataclasses.field(init=False, repr=False, compare=False, default=None)

  def __post_init__(self):
    if self.k < 1:
      raise ValueError(f"num_speculative_tokens k={self.k} must be >= 1")
    if not 0 < self.prior_mean < 1:
      raise ValueError(f"prior_mean={self.prior_mean} must be in (0, 1)")
    if not (np.isfinite(self.prior_weight) and self.prior_weight > 0):
      raise ValueError(f"prior_weight={self.prior_weight} must be a finite number > 0")
    edges = tuple(float(e) for e in self.confidence_bins)
    if any(not 0 < e < 1 for e in edges) or list(edges) != sorted(set(edges)):
      raise ValueError(f"confidence_bins={self.confidence_bins!r} must be increasing values "
                       "in (0, 1)")
    object.__setattr__(self, "confidence_bins", edges)
    if self.min_tokens not in (0, 1):
      raise ValueError(f"min_tokens={self.min_tokens} must be 0 or 1")
    if isinstance(self.cost_model, str):
      object.__setattr__(self, "cost_model", load(self.cost_model))
    if self.cost_model is not None and not callable(self.cost_model):
      raise ValueError(f"cost_model={self.cost_model!r} must be callable (batch, length) -> s, "
                       "a preset name or a .json file")
    inner = self.drafter
    if not isinstance(inner, Method) or inner.num_speculative_tokens < 1 \
        or inner.host_capabilities().tree or isinstance(inner, VerifySkip):
      raise ValueError(f"drafter={self.drafter!r} must be a chain drafter Method (k >= 1, no "
                       "trees, not verify_skip itself; by name through methods.registry)")
    if inner.num_speculative_tokens < self.k:
      raise ValueError(f"k={self.k} must be <= its drafter's k="
                       f"{inner.num_speculative_tokens} (it verifies at most what is drafted)")
    table_lengths = getattr(self.cost_model, "lengths", None)  # a TableVerifyCost
    if table_lengths is not None and max(table_lengths) < self.k:
      raise ValueError(f"cost_model lengths={tuple(table_lengths)} must reach k={self.k} "
                       "(a verify of up to k drafts is priced)")
    object.__setattr__(self, "_inner", inner)
    if not isinstance(self.host_path, bool):
      raise ValueError(f"host_path={self.host_path!r} must be a bool")

  @property
  def num_speculative_tokens(self) -> int:
    return self.k

  @property
  def fused(self) -> bool:
    """Runs in the engine's fused loop (module docstring: a fused drafter without draft
    probabilities, and not ``host_path``)."""
    caps = self._inner.capabilities()
    return caps.runs_on == "fused" and not caps.emits_draft_probs and not self.host_path

  def capabilities(self):
    if self.fused:
      return dataclasses.replace(self._inner.capabilities(), plans_verify=True)
    return self._inner.host_capabilities()

  def describe(self) -> dict:
    return {"method": self.name, "k": self.k, "drafter": self._inner.name,
            "cost_model": _label(self.cost_model or _DEFAULT_COST),
            "prior_mean": self.prior_mean, "prior_weight": self.prior_weight,
            "confidence_bins": self.confidence_bins, "min_tokens": self.min_tokens,
            "host_path": self.host_path, "runs_on": self.capabilities().runs_on}

  def init_state(self, runtime):
    bins = len(self.confidence_bins) + 1
    return VerifySkipState(
        self._inner.init_state(runtime), np.zeros(self.k), np.zeros(self.k),
        np.zeros((self.k, bins)), np.zeros((self.k, bins)), {},
        dict(steps=0, drafted=0, verified=0, caps=[], row_caps=[]))

  def _estimate(self, accept, reach):
    a = self.prior_mean * self.prior_weight
    return (accept + a) / (reach + self.prior_weight)

  def _stale_stage(self, state: VerifySkipState, budgets: np.ndarray) -> tuple[int, float]:
    """``(L*, lambda)`` of step 1 from the learned per-position estimates."""
    model = self.cost_model or _DEFAULT_COST

    def cost(batch: int, length: int) -> float:  # T(B, L) is a pure function: memoized
      key = (batch, length)
      if key not in state.costs:
        value = model(batch, length)
        try:
          seconds = float(value)
        except (TypeError, ValueError):
          seconds = float("nan")
        if not np.isfinite(seconds) or seconds <= 0:
          raise ValueError(f"cost_model={_label(model)} gave T({batch}, {length})={value!r}; "
                           "step seconds must be finite and > 0")
        state.costs[key] = seconds
      return state.costs[key]

    survival = np.cumprod(self._estimate(state.accept, state.reach))
    lengths = length_buckets(self.k)
    if self.min_tokens == 0:
      lengths = [0, *lengths]
    cap, _, lam = choose_cap(survival, budgets, cost, lengths)
    return cap, lam

  def _learn(self, state: VerifySkipState, accepted: int, verified: int, drafted: int,
             budget: int, cap: int, bins) -> None:
    """Adds one row's labels (module docstring, Observations): ``drafted`` the row's
    draft count (at least ``verified``; larger than any position when unknown)."""
    for j in range(min(accepted + 1, verified)):  # live stage: drafted, reached, verified
      state.reach_bin[j, bins[j]] += 1
      state.accept_bin[j, bins[j]] += j < accepted
    for j in range(min(accepted + 1, cap, budget)):  # stale stage
      if j < verified:
        state.reach[j] += 1
        state.accept[j] += j < accepted
      elif j >= drafted:  # no draft at a reached position: not accepted
        state.reach[j] += 1

  # ------------------------------------------------------------ fused path
  def plan_verify(self, state: VerifySkipState, request_ids, budgets):
    """The caps of the next fused dispatch (module docstring, fused path): ``budgets
    i32[rows]`` the host's (upper-bound) row budgets. ``VerifyPlan.info`` is L*."""
    budgets = np.clip(np.asarray(budgets), 0, self.k).astype(np.int32)
    cap, lam = self._stale_stage(state, budgets) if budgets.max(initial=0) else (0, 0.0)
    live = np.cumprod(self._estimate(state.accept_bin[:, 0], state.reach_bin[:, 0]))
    keep = int(np.sum(np.cumprod(live[:cap] >= lam)))
    row_cap = min(cap, max(keep, self.min_tokens))
    caps = np.minimum(budgets, row_cap).astype(np.int32)
    c = state.counters
    c["steps"] += 1
    c["caps"].append(cap)
    c["row_caps"].append(int(caps.max(initial=0)))
    return state, VerifyPlan(caps, info=cap)

  def observe_read(self, state: VerifySkipState, result):
    zeros = np.zeros(self.k, np.int32)  # one confidence bin
    for i in range(len(result.request_ids)):
      verified, budget = int(result.num_verified[i]), int(result.budgets[i])
      # Fewer verified than the cap allowed: the drafter drafted exactly that many.
      short = verified < min(int(result.caps[i]), budget)
      drafted = verified if short else self.k + 1
      self._learn(state, int(result.num_accepted[i]), verified, drafted, budget,
                  int(result.plan_info), zeros)
      state.counters["verified"] += verified
    return state

  def init_device(self, runtime):
    return self._inner.init_device(runtime)

  def propose_device(self, params, state, rows, *, all_greedy):
    """The drafter's fused proposer; ``rows.budgets`` already hold the caps."""
    return self._inner.propose_device(params, state, rows, all_greedy=all_greedy)

  def prefill_device(self, params, state, tokens, meta, hidden=()):
    return self._inner.prefill_device(params, state, tokens, meta, hidden)

  def observe_device(self, params, state, rows, hidden, meta):
    return self._inner.observe_device(params, state, rows, hidden, meta)

  def reset_device(self, params, state, slots, num_tokens):
    return self._inner.reset_device(params, state, slots, num_tokens)

  def release_device(self, params, state, slot_tokens, slots, num_tokens):
    return self._inner.release_device(params, state, slot_tokens, slots, num_tokens)

  def end_device(self, runtime, params, state):
    self._inner.end_device(runtime, params, state)

  # ------------------------------------------------------------ host path
  def propose(self, state: VerifySkipState, ctx):
    rows = len(ctx.request_ids)
    state.inner, draft = self._inner.propose(state.inner, ctx)
    budgets = np.minimum(np.maximum(np.asarray(ctx.budgets[:rows]), 0), self.k).astype(np.int32)
    drafted = np.minimum(np.asarray(draft.num_tokens[:rows]), budgets).astype(np.int32)
    if drafted.max(initial=0) == 0:
      for rid in ctx.request_ids:
        state.last[rid] = (0, 0, 0, 0, np.zeros(0, np.int32))
      return state, Draft(draft.tokens, np.zeros(rows, np.int32), probs=draft.probs)
    cap, lam = self._stale_stage(state, budgets)
    if draft.probs is not None:  # pre-token confidence: max of q at each position
      conf = np.asarray(jnp.max(draft.probs[:rows, : self.k], axis=-1), np.float64)
      conf = np.pad(conf, ((0, 0), (0, self.k - conf.shape[1])))
    else:
      conf = np.ones((rows, self.k))
    bins = np.searchsorted(np.asarray(self.confidence_bins), conf, side="right")
    if draft.probs is None:
      bins[:] = 0
    live = self._estimate(state.accept_bin, state.reach_bin)  # [k, bins]
    alive = np.cumprod(live[np.arange(self.k)[None], bins], axis=1)  # a_{r,j}: [rows, k]
    verified = np.zeros(rows, np.int32)
    for i, rid in enumerate(ctx.request_ids):
      top = min(int(drafted[i]), cap)
      keep = int(np.sum(np.cumprod(alive[i, :top] >= lam)))
      verified[i] = max(keep, min(self.min_tokens, top))
      state.last[rid] = (int(verified[i]), int(drafted[i]), int(budgets[i]), cap,
                         bins[i, : verified[i]].astype(np.int32))
    c = state.counters
    c["steps"] += 1
    c["drafted"] += int(drafted.sum())
    c["verified"] += int(verified.sum())
    c["caps"].append(cap)
    tokens = draft.tokens
    if isinstance(tokens, np.ndarray):
      tokens = tokens.copy()
      for i in range(rows):
        tokens[i, verified[i]:] = -1
    return state, Draft(tokens, verified, probs=draft.probs)

  def observe(self, state: VerifySkipState, result):
    for i, rid in enumerate(result.request_ids):
      verified, drafted, budget, cap, bins = state.last.pop(rid, (0, 0, 0, 0, None))
      self._learn(state, int(result.num_accepted[i]), verified, drafted, budget, cap, bins)
    state.inner = self._inner.observe(state.inner, result)
    return state

  def observe_prefill(self, state, result):
    state.inner = self._inner.observe_prefill(state.inner, result)
    return state
