"""Adaptive drafter choice: per request and step, one of several drafters drafts.

Generalises Arctic Inference's hybrid rule (use the suffix draft when its score is at
least the model drafter's draft length, else the model draft; ``methods_reference.md``
§1.1): every member drafter j gets an expected accepted length E_j for the row, from
information available before the target verifies, and the row takes the largest
(ties: the member listed first; no member with E_j > 0: no draft):

* a member with ``scored_propose`` (suffix decoding) drafts first and reports a score
  per row (its expected accepted length under its own counts): ``E = score * c_j``,
  with the calibration ``c_j = (sum accepted + w) / (sum score + w)`` learned online;
* another host member (n-gram) drafts first: ``E = sum_{i < n} a_j[i]`` for its n tokens;
* the device member (a draft model) is not run until chosen: ``E = sum_{i < budget}
  a_j[i]``, and it then drafts only the rows that chose it (budget 0 elsewhere).

``a_j[i]`` is member j's estimated probability that its first i + 1 drafts are all
accepted: ``(rows accepting >= i + 1 + w * prior) / (rows drafting >= i + 1 + w)``, made
non-increasing in i, learned in ``observe`` from the rows j drafted (``prior`` 1: a
model draft is worth its length before anything is observed, Arctic's rule). Estimates
persist across ``generate`` calls of one engine (``RuntimeInfo.method_cache``).

Counterfactual observation: a host member drafts every row whether chosen or not, so
``observe`` also learns from the drafts it made for rows another member drafted (without
it a member whose first rows went badly is never chosen, so never observed, again: the
choice locks in). Position i's outcome is known when the target's token there is, i.e.
for the committed tokens ``e_0 .. e_a`` (``a`` accepted drafts and the bonus/recovered
token): draft ``d`` accepts ``m`` = its longest prefix equal to ``e``'s; ``m`` is exact
if ``d`` diverges inside the known tokens or ends there, otherwise only the known
positions are counted (censored; ``counterfactual_acceptance``). Under sampling ``P(e_i
= d_i)`` is ``p(d_i)``, a one-hot draft's acceptance probability, so the count is
unbiased. Under acceptance replay the row's other traces give the exact count
(``VerifyResult.replay_acceptance``). A scored member's calibration learns only from
exact counts. The device member drafts only its chosen rows and is observed only there.

Lossless: the choice uses only pre-verification information and each member's draft is
what that member would have sent (rows that chose a deterministic drafter get a one-hot
q when the step also carries draft-model probabilities, the same q the verifier assumes
without probabilities). Chains and trees mix: chains become one-branch trees when any
row's draft is a tree.

Supported members: host drafters (``suffix``, ``ngram``) and at most one device
drafter called from the host (``draft_model``, or a learned head such as ``eagle3``,
whose target features every verify step hands to it for all rows, so its state follows
rows other members drafted).

Acceptance replay (measurement, ``EngineConfig.replay_sources`` = number of members):
row i's step replays the trace of the member that drafted it (``Draft.replay_source`` =
its index in ``drafters``), e.g. the seed traces' n-gram and EAGLE-3 acceptance of one
request, so the choice is judged on each member's own recorded acceptance.

Which member drafted each row is counted per ``generate`` call in
``AdaptiveStats.chosen`` (member name or "none" -> rows); the engine's
``runtime.method_cache[method]`` holds the ``AdaptiveStats`` of its latest call
(``Adaptive.stats(engine.runtime)`` returns it).

Seeded sampled requests: the choice depends on shared estimates (the batch, earlier
requests). With members without draft probabilities (the default ``suffix``, ``ngram``)
the coupled rule of ``specjax.verify`` emits a seeded request's AR tokens whatever was
drafted; with a ``draft_model`` member (drafts with q, the optimal rule) its exact tokens
may change with its partners (its distribution does not), unless that member is built
with ``coupled_sampling=True``.

Runs on the synchronous host path: the choice among members is made on the host from
their host drafts and online estimates. Cost: one synchronous step each; fused members
(n-gram) run their host ``propose`` here.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from specjax.method import (
    Capabilities,
    Draft,
    InnerMethodOption,
    Method,
    ProposeContext,
    VerifyResult,
)
from specjax.tree import chain_parents

__all__ = ["Adaptive", "AdaptiveStats", "counterfactual_acceptance"]


def counterfactual_acceptance(draft, committed) -> tuple[int, int]:
  """What a chain draft that was not verified would have accepted, judged against the
  tokens the step committed (module docstring).

  Args:
    draft: the member's draft tokens (ints, length n >= 0).
    committed: the tokens the step committed (ints; the chosen draft's accepted tokens
      then the bonus/recovered token, possibly cut by a stop rule).

  Returns:
    ``(known, accepted)``: the draft positions whose outcome is known (n when exact,
    ``len(committed)`` when censored) and how many leading drafts are accepted among them.
  """
  n, known = len(draft), len(committed)
  m = 0
  while m < min(n, known) and int(draft[m]) == int(committed[m]):
    m += 1
  if m < min(n, known) or n <= known:  # diverged inside the known tokens, or ended there
    return n, m
  return known, m


@dataclasses.dataclass
class _Estimate:
  """Online acceptance statistics of one member (persist across calls)."""

  drafted: np.ndarray  # i64[k]: rows that drafted >= i + 1 tokens
  accepted: np.ndarray  # i64[k]: rows that accepted >= i + 1 tokens
  score_sum: float = 0.0  # scored members: sum of the chosen rows' scores
  accepted_sum: float = 0.0  # and of their accepted lengths


@dataclasses.dataclass
class AdaptiveStats:
  """Per-engine record of an ``Adaptive`` method.

  Attributes:
    estimates: member name -> ``_Estimate`` (learned online, kept across calls).
    chosen: member name (or "none") -> rows it drafted in the latest ``generate`` call.
    expected: member name -> sum of the chosen rows' expected accepted lengths (same call).
    accepted: member name -> sum of the chosen rows' accepted drafts (same call).
    drafted: member name -> sum of the chosen rows' draft tokens (same call).
    counterfactual: member name -> rows it drafted but another member's draft was
      verified, observed for its estimate (same call; module docstring).
  """

  estimates: dict
  chosen: dict = dataclasses.field(default_factory=dict)
  expected: dict = dataclasses.field(default_factory=dict)
  accepted: dict = dataclasses.field(default_factory=dict)
  drafted: dict = dataclasses.field(default_factory=dict)
  counterfactual: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class _State:
  members: tuple
  member_states: list
  stats: AdaptiveStats
  last: dict = dataclasses.field(default_factory=dict)  # request id -> (member, n, score)
  # request id -> [(member, draft tokens, score)] of the unchosen host members' drafts
  others: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Adaptive(Method):
  """Per-row choice among the ``drafters`` by expected accepted length.

  Attributes:
    k: the most draft tokens per row (every member drafts this k).
    drafters: the member methods, in tie-break order, each with this k (through the
      registry: method names, a sequence or one comma-separated string, default
      "suffix,ngram").
    prior: prior per-position acceptance of the unscored members, in (0, 1].
    prior_weight: pseudo-rows behind the prior (> 0).
  """

  name = "adaptive"
  inner_methods = (InnerMethodOption("drafters", ("suffix", "ngram")),)
  k: int = 4
  drafters: tuple[Method, ...] | None = None
  prior: float = 1.0
  prior_weight: float = 2.0

  def __post_init__(self):
    if isinstance(self.drafters, list):
      object.__setattr__(self, "drafters", tuple(self.drafters))
    if not isinstance(self.k, int) or self.k < 1:
      raise ValueError(f"num_speculative_tokens k={self.k!r} must be an int >= 1")
    if not (isinstance(self.prior, (int, float)) and 0 < self.prior <= 1):
      raise ValueError(f"prior={self.prior!r} must be in (0, 1]")
    if not (isinstance(self.prior_weight, (int, float)) and math.isfinite(self.prior_weight)
            and self.prior_weight > 0):
      raise ValueError(f"prior_weight={self.prior_weight!r} must be a finite number > 0")
    members = self.drafters
    if not isinstance(members, tuple) or not members \
        or not all(isinstance(m, Method) for m in members):
      raise ValueError(f"drafters={members!r} must be a non-empty tuple of Methods (by name "
                       "through methods.registry)")
    names = tuple(m.name for m in members)
    if len(set(names)) != len(names):
      raise ValueError(f"drafters={names!r} must be distinct methods")
    nested = [m.name for m in members if isinstance(m, Adaptive)]
    if nested:
      raise ValueError(f"drafters={names!r}: a member must be a method other than "
                       f"{self.name!r}")
    devices = [m.name for m in members if m.host_capabilities().runs_on != "host"]
    bad = [m.name for m in members
           if m.num_speculative_tokens == 0 or (m.host_capabilities().target_hidden_layers
               and m.host_capabilities().runs_on == "host")]
    if bad or len(devices) > 1:
      raise ValueError(f"drafters={names!r}: adaptive composes drafting host methods "
                       "(suffix, ngram) and at most one device drafter (draft_model, eagle3); "
                       f"refused: {bad or devices}")
    wrong_k = [m.name for m in members if m.num_speculative_tokens != self.k]
    if wrong_k:
      raise ValueError(f"drafters={names!r}: members {wrong_k} must draft k={self.k} tokens")

  @property
  def num_speculative_tokens(self) -> int:
    return self.k

  def capabilities(self) -> Capabilities:
    caps = [m.host_capabilities() for m in self.drafters]
    return Capabilities(
        runs_on="device" if any(c.runs_on != "host" for c in caps) else "host",
        emits_draft_probs=any(c.emits_draft_probs for c in caps),
        tree=any(c.tree for c in caps),
        needs_draft_model=any(c.needs_draft_model for c in caps),
        target_hidden_layers=next((c.target_hidden_layers for c in caps
                                   if c.target_hidden_layers), ()))

  def describe(self) -> dict:
    """The config with the members by name (``"drafters": ("suffix", "ngram")``)."""
    return {"method": self.name, "k": self.k, "drafters": tuple(m.name for m in self.drafters),
            "prior": self.prior, "prior_weight": self.prior_weight}

  @staticmethod
  def stats(runtime) -> AdaptiveStats | None:
    """The ``AdaptiveStats`` of the engine whose ``runtime`` this is (None before any run)."""
    return next((v for k, v in runtime.method_cache.items() if isinstance(k, Adaptive)), None)

  def init_state(self, runtime) -> _State:
    members = self.drafters
    old = runtime.method_cache.get(self)
    estimates = old.estimates if old is not None else {
        m.name: _Estimate(np.zeros(self.k, np.int64), np.zeros(self.k, np.int64))
        for m in members}
    stats = runtime.method_cache[self] = AdaptiveStats(estimates)
    for m in members:
      for counter in (stats.chosen, stats.expected, stats.accepted, stats.drafted,
                      stats.counterfactual):
        counter[m.name] = 0
    stats.chosen["none"] = 0
    return _State(members, [m.init_state(runtime) for m in members], stats)

  # ------------------------------------------------------------------ estimates
  def _prefix_acceptance(self, est: _Estimate) -> np.ndarray:
    """``f64[k]`` a[i] (module docstring), non-increasing."""
    w = self.prior_weight
    a = (est.accepted + w * self.prior) / (est.drafted + w)
    return np.minimum.accumulate(a)

  def _calibration(self, est: _Estimate) -> float:
    """Accepted per unit of score (1 before anything is observed: a score is already an
    expected accepted length)."""
    w = self.prior_weight
    return (est.accepted_sum + w) / (est.score_sum + w)

  # ------------------------------------------------------------------ propose
  def propose(self, state: _State, ctx: ProposeContext):
    rows = len(ctx.request_ids)
    budgets = np.minimum(np.maximum(np.asarray(ctx.budgets[:rows]), 0), self.k)
    num_members = len(state.members)
    expected = np.zeros((num_members, rows))
    drafts: list = [None] * num_members
    scores: list = [None] * num_members
    deferred = []
    for j, m in enumerate(state.members):
      est = state.stats.estimates[m.name]
      cum = np.concatenate([[0.0], np.cumsum(self._prefix_acceptance(est))])
      if hasattr(m, "scored_propose"):
        state.member_states[j], drafts[j], scores[j] = m.scored_propose(state.member_states[j], ctx)
        expected[j] = scores[j] * self._calibration(est)
      elif m.host_capabilities().runs_on == "host":
        state.member_states[j], drafts[j] = m.propose(state.member_states[j], ctx)
        expected[j] = cum[np.minimum(np.asarray(drafts[j].num_tokens[:rows]), budgets)]
      else:
        deferred.append(j)
        expected[j] = cum[budgets]
    best = np.argmax(expected, axis=0)  # first max: listed order breaks ties
    choice = np.where(expected[best, np.arange(rows)] > 0, best, -1)
    for j in deferred:  # a device member drafts only the rows that chose it
      mask = choice == j
      sub = dataclasses.replace(ctx, budgets=np.where(mask, ctx.budgets[:rows], 0).astype(np.int32))
      state.member_states[j], drafts[j] = state.members[j].propose(state.member_states[j], sub)
    return state, self._combine(state, ctx, choice, drafts, scores, expected, budgets)

  def _combine(self, state, ctx, choice, drafts, scores, expected, budgets) -> Draft:
    rows = len(choice)
    tokens = np.full((rows, self.k), -1, np.int32)
    num = np.zeros(rows, np.int32)
    parents = None
    if any(d is not None and d.parents is not None and (choice == j).any()
           for j, d in enumerate(drafts)):
      parents = chain_parents(rows, self.k)
    probs_from = None
    for i, j in enumerate(choice):
      rid = ctx.request_ids[i]
      state.others[rid] = [
          (o, np.asarray(d.tokens[i, :n_o]), None if scores[o] is None else float(scores[o][i]))
          for o, d in enumerate(drafts) if o != j and d is not None
          and state.members[o].host_capabilities().runs_on == "host"
          and (n_o := int(min(d.num_tokens[i], budgets[i]))) > 0]
      if j < 0:
        state.stats.chosen["none"] += 1
        state.last[rid] = (-1, 0, 0.0)
        continue
      d = drafts[j]
      n = int(min(d.num_tokens[i], budgets[i]))
      tokens[i, :n] = np.asarray(d.tokens[i, :n])
      num[i] = n
      if parents is not None and d.parents is not None:
        parents[i, :n] = d.parents[i, :n]
      if d.probs is not None:
        probs_from = j
      name = state.members[j].name
      state.stats.chosen[name] += 1
      state.stats.drafted[name] += n
      state.stats.expected[name] += float(expected[j, i])
      state.last[rid] = (int(j), n, 0.0 if scores[j] is None else float(scores[j][i]))
    probs = None
    if probs_from is not None:
      src = drafts[probs_from].probs  # f32[B, k, V] on the device
      batch = src.shape[0]
      padded = np.full((batch, self.k), -1, np.int32)
      padded[:rows] = tokens
      use = np.zeros(batch, bool)
      use[:rows] = choice == probs_from
      one_hot = jax.nn.one_hot(jnp.asarray(padded), src.shape[-1], dtype=src.dtype)
      probs = jnp.where(jnp.asarray(use)[:, None, None], src, one_hot)
    return Draft(tokens, num, probs=probs, parents=parents,
                 replay_source=np.maximum(choice, 0).astype(np.int32))

  # ------------------------------------------------------------------ observe
  def observe(self, state: _State, result: VerifyResult) -> _State:
    for i, rid in enumerate(result.request_ids):
      j, n, score = state.last.pop(rid, (-1, 0, 0.0))
      for o, draft, o_score in state.others.pop(rid, ()):
        self._observe_unchosen(state, o, draft, o_score, result, i)
      if j < 0:
        continue
      name = state.members[j].name
      a = int(min(result.num_accepted[i], n))
      self._learn(state, j, n, a, score)
      state.stats.accepted[name] += a
    state.member_states = [m.observe(s, result)
                           for m, s in zip(state.members, state.member_states)]
    return state

  def _learn(self, state: _State, j: int, known: int, accepted: int, score,
             exact: bool = True) -> None:
    """Member j's estimate learns that ``accepted`` of its first ``known`` drafts were
    accepted (scored members' calibration only from exact counts)."""
    est = state.stats.estimates[state.members[j].name]
    est.drafted[:known] += 1
    est.accepted[:accepted] += 1
    if exact and score is not None and hasattr(state.members[j], "scored_propose"):
      est.score_sum += score
      est.accepted_sum += accepted

  def _observe_unchosen(self, state: _State, j: int, draft, score, result: VerifyResult,
                        i: int) -> None:
    """Counterfactual observation of member j's unverified draft of row i (module
    docstring)."""
    n = len(draft)
    if result.replay_acceptance is not None:  # source j = member j (Draft.replay_source)
      if j >= result.replay_acceptance.shape[1]:  # no trace of j's: nothing to learn
        return
      known, accepted = n, int(min(max(result.replay_acceptance[i, j], 0), n))
    else:
      known, accepted = counterfactual_acceptance(draft, result.emitted[i])
    self._learn(state, j, known, accepted, score, exact=known == n)
    state.stats.counterfactual[state.members[j].name] += 1

  def observe_prefill(self, state: _State, result):
    state.member_states = [m.observe_prefill(s, result)
                           for m, s in zip(state.members, state.member_states)]
    return state
