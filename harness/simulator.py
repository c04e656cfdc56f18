"""Trace-driven bound simulator of SD speedup over AR (after the seed paper's oracle
simulator, SpecDecode-Bench/simulator; methods_reference.md 1.7).

Inputs are acceptance traces (``harness.traces``: per request, ``acc_len[m][i]`` = tokens a
step starting at output position i commits with method m, i.e. accepted drafts + 1) and a
``specjax.cost_model.CostModel``. A step starting at position i (i output tokens
committed) with ``l`` drafts commits ``min(acc_len[i], l + 1)`` tokens. Decoding starts at i = 1 when the prefill
makes token 0 (``CostModel.prefill_emits_token``: vLLM, the seed) and at i = 0 for
``specjax.engine`` (its prefill leaves the last prompt token pending). Policies, per row
and step:

  * ``ar``: l = 0 (the baseline; plain-decoding overhead, no draft cost).
  * ``fixed`` (method m, k): l = min(k, n - i - 1, draft_len[m][i]) where the trace has
    ``draft_len`` (what the method proposed there; seed traces have none: l = k, as the
    seed's FIXED_k).
  * ``oracle`` (method m): l = acc_len[m][i] - 1: every verified draft is accepted.
  * ``combine`` (methods m_1..): per row the method with the largest acc_len[i] (ties:
    the cheaper draft cost at one row, then the order given), drafting exactly its
    accepted run; each method pays its own draft cost over its rows; a row whose method
    differs from the one it drafted with last pays ``CostModel.switch_s``.

Every commit is also capped at n - i (the request's remaining tokens), as the engine's
budget caps it. Step time = target(kv, q) + sum of draft costs + overhead (+ switches),
with kv = sum of (prompt + i) over the step's rows. Prefill (``include_prefill``) is one
target forward over the admitted prompts plus one AR overhead, for AR and SD alike.

Batching: ``"continuous"`` (offline, like ``specjax.engine``: ``batch_size`` slots,
requests in trace order, a finished row's slot goes to the next request at the next
step) or ``"copies"`` (the seed's: each request alone with ``batch_size - 1`` identical
copies; speedup = mean SD throughput / mean AR throughput over requests).

Not modelled: the draft model catching up on tokens it did not draft, preemption, online
arrivals, chunked prefill under a token budget, tree drafts, sampling (traces are greedy).
"""

from __future__ import annotations

import collections
import dataclasses
import math

import numpy as np

from specjax.cost_model import CostModel, DraftCost, load

__all__ = ["BoundsConfig", "Policy", "SimResult", "compare_engine_loop", "run_bounds", "simulate",
           "speedup_table"]

POLICIES = ("ar", "fixed", "oracle", "combine")
SEMANTICS = ("specjax", "seed")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Policy:
  """How many drafts each row verifies (module docstring).

  Attributes:
    kind: one of ``POLICIES``.
    methods: the trace methods used (``fixed``/``oracle``: exactly one; ``combine``: >= 1).
    k: ``fixed``: the draft length (>= 1); ``oracle``/``combine``: the most drafts per
      step (0 = unbounded).
    fixed_width: ``oracle``/``combine`` with k >= 1 only: every step is charged the verify
      of k drafts a row (what the engine's zero-cost drafter measures: it drafts k and
      the replay accepts the oracle's run) instead of the longest chosen run's: its query
      tokens, the per-row-token overhead at length k and ``verified`` (so the drafts past
      the chosen run count as wasted verification). Commits are unchanged.
  """

  kind: str
  methods: tuple[str, ...] = ()
  k: int = 0
  fixed_width: bool = False

  def __post_init__(self):
    if self.kind not in POLICIES:
      raise ValueError(f"policy kind={self.kind!r} must be one of {POLICIES}")
    n = len(self.methods)
    if self.kind == "ar" and n:
      raise ValueError(f"policy 'ar' takes no methods, got methods={self.methods}")
    if self.kind in ("fixed", "oracle") and n != 1:
      raise ValueError(f"policy {self.kind!r} needs exactly one method, got {self.methods}")
    if self.kind == "combine" and n < 1:
      raise ValueError("policy 'combine' needs at least one method")
    if self.kind == "fixed" and self.k < 1:
      raise ValueError(f"policy 'fixed' needs k >= 1, got k={self.k}")
    if self.k < 0:
      raise ValueError(f"k={self.k} must be >= 0")
    if self.fixed_width and (self.kind not in ("oracle", "combine") or self.k < 1):
      raise ValueError(f"fixed_width=True needs policy 'oracle' or 'combine' with k >= 1, got "
                       f"kind={self.kind!r}, k={self.k}")

  @property
  def label(self) -> str:
    if self.kind == "ar":
      return "ar"
    name = "+".join(self.methods)
    return f"{self.kind}_k{self.k}:{name}" if self.kind == "fixed" else f"{self.kind}:{name}"


@dataclasses.dataclass
class SimResult:
  """Totals of one simulated run (seconds, tokens)."""

  time_s: float = 0.0
  prefill_s: float = 0.0
  verify_s: float = 0.0
  draft_s: float = 0.0
  overhead_s: float = 0.0
  switch_s: float = 0.0
  num_steps: int = 0
  row_steps: int = 0
  committed: int = 0  # tokens committed by decode steps
  verified: int = 0  # sum of l + 1 over row-steps (unpadded)
  num_switches: int = 0
  output_tokens: int = 0
  # Over the decode steps whose batch was full (every slot busy), as the engine measures:
  full_time_s: float = 0.0
  full_steps: int = 0
  full_row_steps: int = 0
  full_committed: int = 0

  @property
  def tau(self) -> float:
    return self.committed / self.row_steps if self.row_steps else float("nan")

  @property
  def full_tokens_per_s(self) -> float:
    """Committed tokens per second over the full-batch steps (NaN without one)."""
    return self.full_committed / self.full_time_s if self.full_time_s else float("nan")

  def add(self, other: SimResult) -> None:
    for f in dataclasses.fields(self):
      setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


@dataclasses.dataclass
class _Row:
  index: int  # request index
  weight: int  # identical copies this row stands for
  pos: int  # output tokens committed
  last_method: str | None = None


def _trace_arrays(records, methods):
  """Per request: n, prompt length, {method: (acc i64[n], draft_len i64[n] or None)}.

  n is the shortest ``acc_len`` of ``methods`` (each method's list is its output length;
  ``generated_token_ids``'s length for AR alone)."""
  out = []
  for r in records:
    for m in methods:
      if m not in r.methods:
        raise ValueError(f"request {r.request_id!r} has no trace for method {m!r}; it has "
                         f"{sorted(r.methods)}")
    n = min((len(r.methods[m].acc_len) for m in methods), default=len(r.generated_token_ids))
    per = {}
    for m in methods:
      t = r.methods[m]
      dl = t.extras.get("draft_len")
      per[m] = (np.asarray(t.acc_len[:n], np.int64),
                None if dl is None else np.asarray(dl[:n], np.int64))
    out.append((n, len(r.prompt_token_ids), per))
  return out


def _choose(policy: Policy, row: _Row, arrays, cost: CostModel) -> tuple[str | None, int, int]:
  """(method or None, drafts l, committed tokens) for one row at its position."""
  n, _, per = arrays[row.index]
  i = row.pos
  remaining = n - i
  if policy.kind == "ar":
    return None, 0, 1
  if policy.kind == "fixed":
    m = policy.methods[0]
    acc, draft_len = per[m]
    length = min(policy.k, remaining - 1)
    if draft_len is not None:
      length = min(length, int(draft_len[i]))
    return m, length, min(int(acc[i]), length + 1)
  best, best_acc = None, 0
  for m in policy.methods:
    a = min(int(per[m][0][i]), remaining)
    if policy.k:
      a = min(a, policy.k + 1)
    if a > best_acc or (a == best_acc and best is not None and a > 1 and
                        _unit_cost(cost, m, a - 1) < _unit_cost(cost, best, a - 1)):
      best, best_acc = m, a
  if best_acc <= 1:
    return None, 0, 1
  return best, best_acc - 1, best_acc


def _unit_cost(cost: CostModel, method: str, length: int) -> float:
  return cost.draft(method).time(1, length, 0.0, 0.0)


def _step(policy, rows, arrays, cost: CostModel, res: SimResult, full: bool) -> None:
  kv = 0
  lengths = []
  by_method: dict = collections.defaultdict(lambda: [0, 0])  # method -> [rows, max l]
  switches = 0
  commits = []
  for row in rows:
    _, prompt_len, _ = arrays[row.index]
    kv += row.weight * (prompt_len + row.pos)
    m, length, commit = _choose(policy, row, arrays, cost)
    lengths.extend([length] * row.weight)
    commits.append(commit)
    if m is not None and length > 0:
      entry = by_method[m]
      entry[0] += row.weight
      entry[1] = max(entry[1], length)
      if policy.kind == "combine" and row.last_method not in (None, m):
        switches += row.weight
      row.last_method = m
  num_rows = len(lengths)
  # What the step verifies: each row's chosen run, or k drafts a row (``fixed_width``).
  verified = [policy.k] * num_rows if policy.fixed_width else lengths
  # The engine's draft-length buckets stop at the method's k (k = 5 verifies 6 tokens a row).
  q = cost.query_tokens(verified, k=policy.k or None)
  parts = cost.step_parts(num_rows, q, kv, by_method,
                          length=max(verified), speculative=policy.kind != "ar",
                          switches=switches)
  verify, draft, overhead, switch = parts
  res.time_s += parts.total
  res.verify_s += verify
  res.draft_s += draft
  res.overhead_s += overhead
  res.switch_s += switch
  res.num_switches += switches
  res.num_steps += 1
  res.row_steps += num_rows
  res.verified += int(np.sum(np.asarray(verified) + 1))
  step_committed = 0
  for row, commit in zip(rows, commits):
    step_committed += row.weight * commit
    row.pos += commit
  res.committed += step_committed
  if full:
    res.full_time_s += parts.total
    res.full_steps += 1
    res.full_row_steps += num_rows
    res.full_committed += step_committed


def _prefill(rows, arrays, cost: CostModel, kv_running: int, res: SimResult) -> None:
  prompt = sum(r.weight * arrays[r.index][1] for r in rows)
  t = cost.target.time(kv_running, prompt) + cost.overhead.ar(sum(r.weight for r in rows))
  res.time_s += t
  res.prefill_s += t


def full_rows(min_occupancy: float, batch_size: int) -> int:
  """The fewest running rows of a step counted as a full batch: ``ceil(min_occupancy *
  batch_size)`` (``min_occupancy`` in (0, 1]; 1: every slot busy)."""
  return math.ceil(min_occupancy * batch_size)


def _run(policy, arrays, order, cost, batch_size, weight, include_prefill,
         min_rows=None) -> SimResult:
  """``min_rows``: the fewest running rows of a step counted as full (default
  ``batch_size``)."""
  min_rows = batch_size if min_rows is None else min_rows
  res = SimResult()
  start = 1 if cost.prefill_emits_token else 0
  queue = collections.deque(order)
  running: list[_Row] = []
  while queue or running:
    new = []
    while queue and len(running) + len(new) < batch_size:
      idx = queue.popleft()
      new.append(_Row(idx, weight, start))
      res.output_tokens += weight * arrays[idx][0]
    if new:
      if include_prefill:
        kv = sum(r.weight * (arrays[r.index][1] + r.pos) for r in running)
        _prefill(new, arrays, cost, kv, res)
      running.extend(r for r in new if arrays[r.index][0] > start)
    if not running:
      continue
    _step(policy, running, arrays, cost, res, full=len(running) >= min_rows)
    running = [r for r in running if r.pos < arrays[r.index][0]]
  return res


def simulate(records, cost: CostModel, policy: Policy, batch_size: int, *,
             batching: str = "continuous", include_prefill: bool = True,
             min_occupancy: float = 1.0) -> dict:
  """Simulates ``policy`` and AR over ``records`` at ``batch_size``; returns one row.

  Returns:
    dict with policy, batch_size, tau, speedup (AR time / SD time; ``copies``: mean SD
    throughput / mean AR throughput), sd/ar times and throughputs, and the SD decode
    time's shares: verify_share, draft_share, overhead_share, switch_share, plus
    wasted_verify_share = 1 - committed / verified tokens (unpadded); full_tau and
    full_speedup: the same over only the decode steps whose batch was full (every slot
    busy; SD committed tokens per second over AR's), what ``harness.seed_study`` and the
    engine measure (NaN if no step was full). With ``min_occupancy`` < 1 a step counts
    as full when at least ``ceil(min_occupancy * batch_size)`` rows run (continuous
    batching).

  Raises:
    ValueError: bad batch size, batching or ``min_occupancy`` (0 < it <= 1), or a trace
      without a method of the policy.
  """
  if batch_size < 1:
    raise ValueError(f"{batch_size=} must be >= 1")
  if batching not in ("continuous", "copies"):
    raise ValueError(f"{batching=} must be 'continuous' or 'copies'")
  if not 0 < min_occupancy <= 1:
    raise ValueError(f"{min_occupancy=} must be in (0, 1]")
  if not records:
    raise ValueError("records must not be empty")
  arrays = [a for a in _trace_arrays(records, policy.methods) if a[0] > 0]  # output only
  if not arrays:
    raise ValueError(f"no request has output for methods {policy.methods}")
  ar_policy = Policy(kind="ar")
  sd, ar = SimResult(), SimResult()
  if batching == "continuous":
    order = list(range(len(arrays)))
    rows = full_rows(min_occupancy, batch_size)
    sd = _run(policy, arrays, order, cost, batch_size, 1, include_prefill, rows)
    ar = _run(ar_policy, arrays, order, cost, batch_size, 1, include_prefill, rows)
    speedup = ar.time_s / sd.time_s
  else:
    sd_tpt, ar_tpt = [], []
    for idx in range(len(arrays)):
      s = _run(policy, arrays, [idx], cost, 1, batch_size, include_prefill)
      a = _run(ar_policy, arrays, [idx], cost, 1, batch_size, include_prefill)
      sd_tpt.append(s.output_tokens / s.time_s)
      ar_tpt.append(a.output_tokens / a.time_s)
      sd.add(s)
      ar.add(a)
    speedup = float(np.mean(sd_tpt) / np.mean(ar_tpt))
  decode = sd.time_s - sd.prefill_s
  share = (lambda x: x / decode) if decode > 0 else (lambda x: float("nan"))
  return {
      "policy": policy.label, "kind": policy.kind, "methods": "+".join(policy.methods),
      "k": policy.k, "batch_size": batch_size, "batching": batching,
      "cost_model": cost.name, "tau": sd.tau, "speedup": speedup,
      "sd_time_s": sd.time_s, "ar_time_s": ar.time_s,
      "sd_tokens_per_s": sd.output_tokens / sd.time_s,
      "ar_tokens_per_s": ar.output_tokens / ar.time_s,
      "sd_steps": sd.num_steps, "ar_steps": ar.num_steps,
      "mean_sd_step_ms": 1e3 * decode / sd.num_steps if sd.num_steps else float("nan"),
      "mean_ar_step_ms": (1e3 * (ar.time_s - ar.prefill_s) / ar.num_steps
                          if ar.num_steps else float("nan")),
      "verify_share": share(sd.verify_s), "draft_share": share(sd.draft_s),
      "overhead_share": share(sd.overhead_s), "switch_share": share(sd.switch_s),
      "num_switches": sd.num_switches,
      "wasted_verify_share": 1 - sd.committed / sd.verified if sd.verified else float("nan"),
      "full_tau": sd.full_committed / sd.full_row_steps if sd.full_row_steps else float("nan"),
      "full_speedup": sd.full_tokens_per_s / ar.full_tokens_per_s,
  }


def speedup_table(records, cost: CostModel, policies, batch_sizes, *,
                  batching: str = "continuous", include_prefill: bool = True):
  """``simulate`` for every policy and batch size, as a ``pandas.DataFrame``."""
  import pandas as pd  # noqa: PLC0415

  return pd.DataFrame([simulate(records, cost, p, b, batching=batching,
                                include_prefill=include_prefill)
                       for p in policies for b in batch_sizes])


def compare_engine_loop(loop, cost: CostModel, *, new_tokens: int = 64):
  """Simulated vs measured ``benchmarks.engine_loop`` rows (synthetic acceptance 1.0).

  Each row (batch B, context C, L) becomes B requests of C prompt tokens and
  ``new_tokens`` outputs whose every step commits L + 1 tokens (acc_len = L + 1), run
  with ``fixed`` k = L (``ar`` for L = 0) at batch B. Returns ``loop``'s columns plus
  ``sim_step_ms``, ``sim_tau`` and ``step_ratio`` = measured / simulated step time.
  """
  from harness.traces import MethodTrace, TraceRecord  # noqa: PLC0415

  out = loop.copy()
  sim_ms, sim_tau = [], []
  free = _with_free_draft(cost, "synthetic")
  for row in loop.itertuples():
    acc = np.full(new_tokens, row.L + 1, np.int64)
    recs = [TraceRecord(f"r{i}", [0] * int(row.context), [0] * new_tokens,
                        {"synthetic": MethodTrace(acc, {})}) for i in range(int(row.batch))]
    policy = Policy(kind="fixed", methods=("synthetic",), k=max(int(row.L), 1))
    r = simulate(recs, free, policy, int(row.batch), include_prefill=False)
    sim_ms.append(r["mean_sd_step_ms"] if row.L else r["mean_ar_step_ms"])
    sim_tau.append(r["tau"] if row.L else 1.0)
  out["sim_step_ms"] = sim_ms
  out["sim_tau"] = sim_tau
  out["step_ratio"] = out.step_ms / out.sim_step_ms
  return out


def _with_free_draft(cost: CostModel, method: str) -> CostModel:
  return dataclasses.replace(cost, drafts={**cost.drafts, method: DraftCost()})


@dataclasses.dataclass(frozen=True, kw_only=True)
class BoundsConfig:
  """What ``run_bounds`` simulates (``experiments/simulate_bounds.py`` flags).

  Attributes:
    traces: JSONL trace files (``harness.traces`` or the seed's).
    cost_model: a ``specjax.cost_model`` preset name or a JSON file.
    methods: trace methods to simulate (empty: every method of the first file).
    fixed_k: draft lengths of the ``fixed`` policy.
    oracle: also simulate ``oracle`` per method; combine: the oracle combination of all
      ``methods`` (when there are at least two).
    batch_sizes, batching, include_prefill: as ``simulate``.
    switch_cost_ms: per-row method switch cost (overrides the cost model's when set).
    method_costs: (trace method, cost-model method) pairs: charge a trace method with
      another method's draft cost (e.g. ``draft_model`` with a preset's ``eagle``).
    num_requests: simulate the first n requests of each file (0 = all); seed semantics:
      draw n requests (0 = the seed's 300, or all when fewer).
    semantics: "specjax" (this module) or "seed" (``harness.seed_simulator``: the seed
      paper's simulator; ``copies`` batching and prefill only; docs/simulator.md lists
      the differences).
    match_probability: seed semantics, fixed-k n-gram: probability that a position with
      acc_len 1 still has an n-gram match; None takes the seed's value for the data set
      named in the file name (``combined_<data set>.jsonl``).
  """

  traces: tuple[str, ...]
  cost_model: str = "seed-llama8b-h100"
  methods: tuple[str, ...] = ()
  fixed_k: tuple[int, ...] = (1, 3, 5)
  oracle: bool = True
  combine: bool = True
  batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
  batching: str = "continuous"
  include_prefill: bool = True
  switch_cost_ms: float | None = None
  method_costs: tuple[tuple[str, str], ...] = ()
  num_requests: int = 0
  semantics: str = "specjax"
  match_probability: float | None = None

  def __post_init__(self):
    if not self.traces:
      raise ValueError("traces must name at least one JSONL file")
    if self.semantics not in SEMANTICS:
      raise ValueError(f"semantics={self.semantics!r} must be one of {SEMANTICS}")
    if self.semantics == "seed" and (self.batching != "copies" or not self.include_prefill):
      raise ValueError(f"semantics='seed' simulates the seed's batches (batching='copies', "
                       f"prefill included), got batching={self.batching!r}, "
                       f"include_prefill={self.include_prefill}")
    if self.match_probability is not None and (
        self.semantics != "seed" or not 0.0 <= self.match_probability <= 1.0):
      raise ValueError(f"match_probability={self.match_probability} is for semantics='seed' "
                       "only, in [0, 1]")
    if self.semantics == "seed" and (self.switch_cost_ms or self.method_costs):
      raise ValueError("semantics='seed' charges no switching cost and each method its own "
                       "draft cost: leave switch_cost_ms and method_costs unset")
    if any(k < 1 for k in self.fixed_k):
      raise ValueError(f"fixed_k={self.fixed_k} must all be >= 1")
    if self.num_requests < 0:
      raise ValueError(f"num_requests={self.num_requests} must be >= 0")


def run_bounds(cfg: BoundsConfig):
  """Speedup bounds for every trace file, policy and batch size (a DataFrame)."""
  import os  # noqa: PLC0415

  import pandas as pd  # noqa: PLC0415

  from harness.traces import read_jsonl  # noqa: PLC0415

  cost = load(cfg.cost_model)
  if cfg.switch_cost_ms is not None:
    cost = cost.with_switch(cfg.switch_cost_ms / 1e3)
  if cfg.method_costs:
    drafts = dict(cost.drafts)
    for trace_method, cost_method in cfg.method_costs:
      drafts[trace_method] = cost.draft(cost_method)
    cost = dataclasses.replace(cost, drafts=drafts)
  frames = []
  for path in cfg.traces:
    records = read_jsonl(path)
    if not records:
      raise ValueError(f"trace file {path!r} has no records")
    if cfg.num_requests and cfg.semantics == "specjax":
      records = records[: cfg.num_requests]
    methods = cfg.methods or tuple(records[0].methods)
    policies = [Policy(kind="fixed", methods=(m,), k=k) for m in methods for k in cfg.fixed_k]
    if cfg.oracle:
      policies += [Policy(kind="oracle", methods=(m,)) for m in methods]
    if cfg.combine and len(methods) > 1:
      policies.append(Policy(kind="combine", methods=tuple(methods)))
    if cfg.semantics == "seed":
      df = _seed_table(records, cost, policies, cfg, os.path.basename(path))
    else:
      df = speedup_table(records, cost, policies, cfg.batch_sizes, batching=cfg.batching,
                         include_prefill=cfg.include_prefill)
      df["semantics"] = "specjax"
    df.insert(0, "traces", os.path.basename(path))
    if "num_requests" not in df:  # seed rows carry the number they drew
      df["num_requests"] = len(records)
    df["switch_cost_ms"] = 1e3 * cost.switch_s
    frames.append(df)
  return pd.concat(frames, ignore_index=True)


def _seed_table(records, cost: CostModel, policies, cfg: BoundsConfig, file_name: str):
  """``harness.seed_simulator`` rows for every policy and batch size of one file."""
  import pandas as pd  # noqa: PLC0415

  from harness.seed_simulator import MATCH_PROBABILITY, simulate_seed  # noqa: PLC0415

  p = cfg.match_probability
  if p is None:
    stem = file_name.removesuffix(".jsonl").removeprefix("combined_")
    p = MATCH_PROBABILITY.get(stem)
  needs_p = any(q.kind == "fixed" and q.methods[0] == "ngram" for q in policies)
  if needs_p and p is None:
    raise ValueError(f"trace file {file_name!r} names no data set of the seed "
                     f"({sorted(MATCH_PROBABILITY)}): pass match_probability for its "
                     "fixed-k n-gram policies")
  num = cfg.num_requests or 300
  return pd.DataFrame([{**simulate_seed(records, cost, q, b, match_probability=p,
                                        num_requests=num), "match_probability": p}
                       for q in policies for b in cfg.batch_sizes])
