"""The seed study measured on the engine: speedup over AR against batch size with the seed
paper's Llama-3.1-8B acceptance traces replayed (``EngineConfig.acceptance_replay``) on a
target of any shape ("Speculative Decoding: Performance or Illusion?", arXiv 2601.11580;
its traces and simulator rules: ``../shared/seed_traces/README.md``).

Per trace file and batch size B the same target runs these points (``study_points``),
each over the file's first ``num_requests(B)`` records whose prompt + output fits
``max_total_tokens`` (continuous batching, B slots, EOS ignored, lengths from the record):

  ``ar``                 plain decoding of the n-gram list's requests (the recorded output).
  ``eagle3_k{k}``        a random-weight EAGLE-3 head of the target's shape drafts k tokens
                         per step inside the fused step (its real cost); the EAGLE-3 trace
                         decides what is accepted.
  ``ngram_k{k}``         the zero-cost constant drafter (``harness.synthetic``) with the
                         n-gram trace: on random weights the device n-gram lookup finds
                         nothing to replay, so its cost is measured apart at the same
                         shapes (``ngram_lookup_k{k}`` at the largest k, its own tau
                         meaningless) and ``ngram_lookup_ms`` is reported beside.
  ``oracle_eagle3_w{W}`` every row drafts exactly its accepted run (zero-cost drafter, at
                         most W), verified in one fixed-width step of W drafts, as the fused
                         step verifies a padded batch; EAGLE-3 trace.
  ``combination_w{W}``   likewise with the per-position longer run of EAGLE-3 and n-gram
                         (the shorter list), the seed's oracle combination.
  ``verify_skip_k{k}``   ``methods.verify_skip`` over the zero-cost device drafter, in the
                         fused loop (k drafts, n-gram trace), its cost table this batch size's
                         measured AR and ``ngram_k`` steps (``verify_skip_method``): the
                         one to compare with the best ``ngram_k``.
  ``adaptive_k{k}``      ``methods.adaptive`` choosing per row between n-gram lookup over
                         the record's real tokens (``harness.synthetic.RecordedNGram``:
                         the real draft lengths, 0 where the real context has no match)
                         and the EAGLE-3 head (host-called), each row replaying the trace
                         of the member that drafted it (``EngineConfig.replay_sources``
                         2, the combined records' length): against the best fixed point
                         and the combination (``gap_closed`` in ``summary_table``).

Measured per point over the steady (non-compiling) engine steps whose batch was full
(every slot busy; B = 1: every step; with ``min_occupancy`` < 1, at least that share of
the slots: at batch 64 and up the fused points have few full steps, since a finished
row's slot is refilled a step or two later): ``tau`` = committed tokens per row-step,
``step_ms`` its mean step (on the host path ``draft_ms`` + ``verify_ms`` + ``host_ms``:
the host-called proposer, the device call with its read, and the rest (commit,
``observe``, batch building); a fused step has no ``draft_ms``, and its ``verify_ms``,
the call's dispatch-to-read time, overlaps the next call's host work),
``c`` = step_ms / the mean of the AR point's repeats (same file and batch size),
``speedup`` = tau / c (full-batch decode throughput over AR's); ``adaptive_choice`` the
adaptive point's share of drafting rows per member; ``verify_share`` = the mean of the
zero-cost drafter's repeats at the same k / this point's step (the time not spent
drafting). The baselines are means, not the repeat of the same index: the repeats of
AR run minutes before a point's, so pairing them by index only adds AR's run-to-run
spread to every point's (``rebase_on_mean_baselines``). Per batch size each engine
(``engine_groups``) is warmed up once by ``Engine.precompile`` (every shape of every
file's requests; a host-called proposer also by one untimed run of each workload), then
``repeats`` measured runs per point and file, each a row, each starting from a cleared
method cache (adaptive's estimates are learned afresh in every run: no file or repeat
inherits another's).

``simulate_points`` adds, per point, what the trace simulators print for it: specjax
semantics (``harness.simulator.simulate``, the same requests, continuous batching) and
the seed's (``harness.seed_simulator.simulate_seed``: B copies, 300 requests drawn) under
a given cost model.
"""

from __future__ import annotations

import dataclasses
import os
import time

import jax
import numpy as np
import pandas as pd

from harness.simulator import full_rows
from harness.traces import MethodTrace, replay_requests

__all__ = ["EAGLE", "NGRAM", "Point", "StudyConfig", "combined_records", "draft_cost_points",
           "engine_groups", "fit_cost_model", "fitting_records", "measure_study",
           "num_requests", "simulate_points", "study_points", "summary_table",
           "verify_skip_method"]

EAGLE, NGRAM = "eagle", "ngram"  # the seed files' trace names
COMBINED = "eagle+ngram"
ADAPTIVE = "ngram|eagle"  # the adaptive point's requests: one trace per member
# Drafters whose points have no verify_share: their verify length changes step to step
# (verify skipping's cap; adaptive's choice of member).
NO_VERIFY_SHARE = ("verify_skip", "adaptive")


@dataclasses.dataclass(frozen=True)
class Point:
  """One measured configuration: ``label``; ``drafter`` (a ``harness.engine_loop.DRAFTERS``
  name); ``trace`` (the replayed list: EAGLE, NGRAM or COMBINED; None for AR); ``length``
  (drafts per step, 0 = AR); ``policy`` the simulator's ``(kind, methods, k)``, None
  where the simulators have no counterpart (the lookup's cost, verify skipping)."""

  label: str
  drafter: str
  trace: str | None
  length: int
  policy: tuple | None


def study_points(fixed_k=(1, 3, 5), oracle_widths=(8,), verify_skip=True,
                 adaptive=True) -> list[Point]:
  """The points of one (file, batch size), AR first (module docstring)."""
  if any(k < 1 for k in (*fixed_k, *oracle_widths)):
    raise ValueError(f"fixed_k={fixed_k}, oracle_widths={oracle_widths}: each must be >= 1")
  pts = [Point("ar", "constant", None, 0, ("ar", (), 0))]
  for k in fixed_k:  # before the EAGLE-3 points: their verify_share divides by these
    pts.append(Point(f"ngram_k{k}", "constant", NGRAM, k, ("fixed", (NGRAM,), k)))
  for k in fixed_k:
    pts.append(Point(f"eagle3_k{k}", "eagle3", EAGLE, k, ("fixed", (EAGLE,), k)))
  k = max(fixed_k)
  pts.append(Point(f"ngram_lookup_k{k}", "ngram", NGRAM, k, None))
  if verify_skip:
    pts.append(Point(f"verify_skip_k{k}", "verify_skip", NGRAM, k, None))
  if adaptive:
    pts.append(Point(f"adaptive_k{k}", "adaptive", ADAPTIVE, k, None))
  for w in oracle_widths:
    pts.append(Point(f"oracle_eagle3_w{w}", "constant", EAGLE, w, ("oracle", (EAGLE,), w)))
  for w in oracle_widths:
    pts.append(Point(f"combination_w{w}", "constant", COMBINED, w,
                     ("combine", (EAGLE, NGRAM), w)))
  return pts


def num_requests(batch: int, available: int, per_slot: int = 2, minimum: int = 4) -> int:
  """Requests a batch size runs: ``per_slot`` per slot, at least ``minimum``, at most
  ``available``."""
  return max(1, min(available, max(minimum, per_slot * batch)))


def fitting_records(records, max_total_tokens: int):
  """The records with output whose prompt + longest list fits ``max_total_tokens``."""
  out = []
  for r in records:
    n = max([len(r.generated_token_ids)] + [len(t.acc_len) for t in r.methods.values()])
    if n and len(r.prompt_token_ids) + n <= max_total_tokens:
      out.append(r)
  return out


def combined_records(records):
  """Each record with one more trace, COMBINED: per output position the larger
  ``acc_len`` of EAGLE and NGRAM over the shorter list (the seed's oracle combination)."""
  out = []
  for r in records:
    e, n = r.methods[EAGLE].acc_len, r.methods[NGRAM].acc_len
    m = min(len(e), len(n))
    both = MethodTrace(acc_len=np.maximum(e[:m], n[:m]))
    out.append(dataclasses.replace(r, methods={**r.methods, COMBINED: both}))
  return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class StudyConfig:
  """``measure_study``'s inputs: trace ``files``, ``batch_sizes``, the ``points``, the
  requests per slot and the most prompt + output tokens of a request, measured
  ``repeats``, the target ``split`` (``specjax.steps.split_model``) and its ``cfg``,
  ``attention_implementation``, ``drafter_options`` (e.g. the EAGLE-3 head's),
  where to append rows as they come (``csv_path``, or None) and ``min_occupancy``: the
  measured steps are those with at least ``ceil(min_occupancy * B)`` rows (1.0: full
  batches only; every decode step is padded to B, so its cost is a full batch's).
  """

  files: tuple
  batch_sizes: tuple
  points: tuple
  requests_per_slot: int = 2
  min_requests: int = 4
  max_total_tokens: int = 2048
  repeats: int = 1
  attention_implementation: object = "reference"
  drafter_options: dict = dataclasses.field(default_factory=dict)
  csv_path: str | None = None
  min_occupancy: float = 1.0

  def __post_init__(self):
    if not 0 < self.min_occupancy <= 1:
      raise ValueError(f"min_occupancy={self.min_occupancy} must be in (0, 1]")


def engine_groups(points) -> list[list[Point]]:
  """``points`` grouped by the engine they run on (drafter, draft length), in order: the
  points of a group differ only in the replayed trace, so one engine (one warm-up)
  measures them all."""
  groups: dict[tuple, list[Point]] = {}
  for p in points:
    groups.setdefault((p.drafter, p.length), []).append(p)
  return list(groups.values())


def check_point_order(points) -> None:
  """Raises ValueError (before anything is measured) if a ``verify_skip_k{k}`` point's
  cost table cannot be built: it needs the AR point and the ``ngram_k{k}`` point measured
  before it in the same run (``engine_groups`` order; ``verify_skip_method``)."""
  seen = set()
  for group in engine_groups(points):
    head = group[0]
    if head.drafter == "verify_skip":
      missing = [x for x in ("ar", f"ngram_k{head.length}") if x not in seen]
      if missing:
        raise ValueError(f"point {head.label} needs {missing} before it in the same run "
                         f"(points in order: {[p.label for p in points]})")
    seen.update(p.label for p in group)


def _mean_of(times: dict, *key) -> float:
  """Mean of ``times`` over the repeats of ``key`` (its keys are ``(*key, repeat)``);
  NaN if none was measured yet."""
  hits = [v for k, v in times.items() if k[:-1] == key and np.isfinite(v)]
  return float(np.mean(hits)) if hits else float("nan")


def rebase_on_mean_baselines(frame: pd.DataFrame) -> pd.DataFrame:
  """``frame`` (``measure_study`` rows, any run) with ``c`` = step_ms / the mean AR
  step_ms of its (data, batch) (NaN repeats left out), ``speedup`` = tau / c and
  ``verify_share`` = 1 for the zero-cost rows (``drafter == "constant"``, L > 0), else
  for a row with L > 0 of a drafter with a fixed verify length (not in
  ``NO_VERIFY_SHARE``) the mean zero-cost step_ms of its (data, batch, L) / step_ms,
  also where the zero-cost point ran after it: rows written before the baselines were
  means (paired with the AR repeat of the same index) get today's definition. A (data,
  batch) without AR rows keeps its c and speedup, a row without a zero-cost point at its
  L its verify_share."""
  out = frame.copy()
  ar = out[out.point == "ar"].groupby(["data", "batch"]).step_ms.mean()
  base = np.asarray([ar.get((d, b), np.nan) for d, b in zip(out.data, out.batch)])
  has = np.isfinite(base)
  if has.any():
    out.loc[has, "c"] = out.step_ms[has] / base[has]
    out.loc[has, "speedup"] = out.tau[has] / out.c[has]
  if "verify_share" in out and "drafter" in out:
    zero_rows = ((out.drafter == "constant") & (out.L > 0)).to_numpy()
    zero = out[zero_rows].groupby(["data", "batch", "L"]).step_ms.mean()
    z = np.asarray([zero.get((d, b, n), np.nan)
                    for d, b, n in zip(out.data, out.batch, out.L)])
    fix = ((out.L > 0) & ~out.drafter.isin(NO_VERIFY_SHARE)).to_numpy() & np.isfinite(z)
    out.loc[fix, "verify_share"] = z[fix] / out.step_ms[fix]
    out.loc[zero_rows, "verify_share"] = 1.0
  return out


def measure_study(cfg: StudyConfig, split, model_cfg, *, target: str, dtype: str,
                  read_records, log=print) -> pd.DataFrame:
  """Measures every (batch size, point, file, repeat); one row each (module docstring).
  ``read_records(path)`` reads a trace file (``harness.traces.read_jsonl``).

  Per batch size, one engine per ``engine_groups`` group, warmed up once with
  ``Engine.precompile`` over all files' requests and, for a method with host-called
  jitted functions (``runs_on == "device"``: adaptive), one untimed run of each of its
  workloads (its time is each row's ``warmup_s``),
  then every file's runs of its points: the engines share the KV length and prefill
  budget, so the prefill programs are compiled once per batch size."""
  from harness.engine_loop import drafter_method  # noqa: PLC0415
  from specjax.config import EngineConfig  # noqa: PLC0415
  from specjax.engine import Engine  # noqa: PLC0415

  check_point_order(cfg.points)
  files = {}
  for path in cfg.files:
    data = os.path.basename(path).removeprefix("combined_").removesuffix(".jsonl")
    files[data] = combined_records(fitting_records(read_records(path), cfg.max_total_tokens))
  widest = max(p.length for p in cfg.points)
  rows = []
  for batch in cfg.batch_sizes:
    requests = {}  # (data, trace) -> requests
    for data, records in files.items():
      n = num_requests(batch, len(records), cfg.requests_per_slot, cfg.min_requests)
      for m in (EAGLE, NGRAM, COMBINED):
        requests[data, m] = replay_requests(records, m, vocab_size=model_cfg.vocab_size,
                                            num_requests=n)
      requests[data, ADAPTIVE] = adaptive_requests(records, data, requests[data, COMBINED])
    ar_ms, zero_ms = {}, {}
    for group in engine_groups(cfg.points):
      head = group[0]
      runs = []  # (point, data, requests)
      for p in group:
        for data in files:
          reqs = requests[data, p.trace or NGRAM]
          if not p.length:
            reqs = [dataclasses.replace(r, replay_acc_len=None) for r in reqs]
          runs.append((p, data, reqs))
      ecfg = EngineConfig(
          max_num_seqs=batch, max_model_len=cfg.max_total_tokens + widest + 16,
          attention_implementation=cfg.attention_implementation,
          max_num_batched_tokens=max(512, min(8192, 256 * batch)),
          decode_batch_sizes=(batch,),  # only full-batch steps are measured
          acceptance_replay=bool(head.length),
          replay_sources=2 if head.drafter == "adaptive" else 1)
      if head.drafter == "verify_skip":
        method = verify_skip_method(head.length, batch, ar_ms, zero_ms)
      elif head.drafter == "adaptive":
        method = adaptive_method(head.length, model_cfg, cfg.drafter_options, files)
      else:
        options = cfg.drafter_options if head.drafter == "eagle3" else None
        method = drafter_method(head.drafter, head.length, model_cfg, options)
      engine = Engine(split, method, ecfg)
      t0 = time.perf_counter()
      every = [r for _, _, reqs in runs for r in reqs]  # ids repeat across files, points
      engine.precompile([dataclasses.replace(r, request_id=str(i)) for i, r in enumerate(every)])
      if engine.caps.runs_on == "device":
        # A host-called proposer's shapes follow its drafts, which precompile cannot
        # enumerate: only the runs themselves compile them, so each distinct workload
        # runs once, untimed, before its measured repeats.
        for reqs in {id(reqs): reqs for _, _, reqs in runs}.values():
          engine.runtime.method_cache.clear()  # as each measured run starts
          engine.generate(reqs)
      warm_s = time.perf_counter() - t0
      for p, data, reqs in runs:
        for rep in range(cfg.repeats):
          # Every run starts from the same method state: adaptive's estimates (or any
          # cross-request cache) learned on the warm-up, another file or an earlier
          # repeat must not carry over.
          engine.runtime.method_cache.clear()
          t0 = time.perf_counter()
          _, met = engine.generate(reqs)
          wall = time.perf_counter() - t0
          full = [s for s in met.steady_steps()
                  if s.num_rows >= full_rows(cfg.min_occupancy, batch)]
          step_ms = 1e3 * float(np.mean([s.step_s for s in full])) if full else float("nan")
          parts = {f"{part}_ms": 1e3 * float(np.mean([getattr(s, f"{part}_s") for s in full]))
                   if full else float("nan") for part in ("draft", "verify", "host")}
          tau = (sum(s.num_emitted for s in full) / sum(s.num_rows for s in full)
                 if full else float("nan"))
          if p.length == 0:
            ar_ms[data, rep] = step_ms
          if p.drafter == "constant" and p.length:
            zero_ms[data, p.length, rep] = step_ms
          c = step_ms / _mean_of(ar_ms, data)
          row = dict(
              data=data, target=target, dtype=dtype, batch=batch, point=p.label,
              drafter=p.drafter, trace=p.trace or "", L=p.length, repeat=rep,
              num_requests=len(reqs),
              mean_prompt=float(np.mean([len(r.prompt_token_ids) for r in reqs])),
              mean_output=float(np.mean([r.sampling.max_tokens for r in reqs])),
              full_steps=len(full), min_occupancy=cfg.min_occupancy, steps=len(met.steps),
              tau=tau, step_ms=step_ms,
              **parts, c=c, speedup=tau / c,
              verify_share=_mean_of(zero_ms, data, p.length) / step_ms
              if p.length and p.drafter not in NO_VERIFY_SHARE else float("nan"),
              adaptive_choice=_choice(method, engine) if p.drafter == "adaptive" else "",
              mean_verify_width=float(np.mean([s.query_bucket - 1 for s in full]))
              if full else float("nan"),
              wall_s=wall, warmup_s=warm_s, prefill_s=met.prefill_s,
              num_compiles=met.num_compiles, device=jax.devices()[0].device_kind,
              backend=jax.default_backend(),
              attention_implementation=str(cfg.attention_implementation),
              runs_on=method.capabilities().runs_on, jax_version=jax.__version__)
          rows.append(row)
          log(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                       for k, v in row.items() if k in (
                           "data", "batch", "point", "repeat", "full_steps", "tau",
                           "step_ms", "c", "speedup", "num_compiles", "warmup_s")))
          if cfg.csv_path:  # as it goes (a cut job keeps its rows), rebased at the end
            pd.DataFrame(rows).to_csv(cfg.csv_path, index=False)
      del engine
  # The AR rows' own c (and points measured before their zero-cost point) against the
  # baselines' final means, not the running ones.
  frame = rebase_on_mean_baselines(pd.DataFrame(rows))
  if cfg.csv_path:
    frame.to_csv(cfg.csv_path, index=False)
  return frame


def adaptive_requests(records, data: str, combined):
  """The adaptive point's requests: ``combined`` (the COMBINED trace's requests: the
  shorter list's length) with ids ``"<data>/<id>"`` (unique over files), the n-gram
  trace as source 0 (``replay_acc_len``) and the EAGLE-3 trace as source 1, both cut to
  that length (``methods.adaptive``: a row replays its drafting member's trace)."""
  by_id = {r.request_id: r for r in records}
  out = []
  for req in combined:
    r, m = by_id[req.request_id], req.sampling.max_tokens
    out.append(dataclasses.replace(
        req, request_id=f"{data}/{req.request_id}",
        replay_acc_len=tuple(int(a) for a in r.methods[NGRAM].acc_len[:m]),
        replay_sources=(tuple(int(a) for a in r.methods[EAGLE].acc_len[:m]),)))
  return out


def adaptive_method(k: int, model_cfg, drafter_options, files: dict):
  """``methods.adaptive.Adaptive`` over (``RecordedNGram`` on every file's records,
  keyed as ``adaptive_requests`` names them; a random EAGLE-3 head with
  ``drafter_options``), both drafting k: members in ``Draft.replay_source`` order."""
  from harness.engine_loop import drafter_method  # noqa: PLC0415
  from harness.synthetic import RecordedNGram  # noqa: PLC0415
  from methods.adaptive import Adaptive  # noqa: PLC0415

  contexts = {f"{data}/{r.request_id}": np.asarray([*r.prompt_token_ids,
                                                     *r.generated_token_ids], np.int64)
              for data, records in files.items() for r in records}
  return Adaptive(k=k, drafters=(RecordedNGram(k=k, contexts=contexts),
                                 drafter_method("eagle3", k, model_cfg, drafter_options)))


def _choice(method, engine) -> str:
  """``"member:share,..."``: each member's share of the latest run's drafting rows."""
  stats = method.stats(engine.runtime)
  total = sum(stats.chosen.values()) or 1
  return ",".join(f"{name}:{n / total:.3f}" for name, n in stats.chosen.items())


def verify_skip_method(k: int, batch: int, ar_ms: dict, zero_ms: dict):
  """``methods.verify_skip.VerifySkip`` over the zero-cost device drafter (k drafts; the
  fused, asynchronous path: ``Capabilities.plans_verify``),
  with this batch size's measured ``T(B, L)`` as its cost (``TableVerifyCost``): the AR
  step and the zero-cost drafter's steps at each fixed k <= ``k`` (ms, keyed
  ``(data, rep)`` and ``(data, L, rep)``; the mean over files and repeats).

  Raises:
    ValueError: the AR point or the zero-cost point at ``k`` was not measured first.
  """
  from harness.synthetic import ConstantDrafter  # noqa: PLC0415
  from methods.verify_skip import VerifySkip  # noqa: PLC0415
  from specjax.cost_model import TableVerifyCost  # noqa: PLC0415

  lengths = sorted({n for _, n, _ in zero_ms if n <= k})
  if not ar_ms or k not in lengths:
    raise ValueError(f"verify_skip_k{k} needs the ar and ngram_k{k} points measured before "
                     f"it at batch {batch}; have L={lengths}")
  seconds = [float(np.nanmean(list(ar_ms.values())))] + [
      float(np.nanmean([v for (_, n, _), v in zero_ms.items() if n == m])) for m in lengths]
  table = TableVerifyCost(batches=(batch,), lengths=(0, *lengths),
                          seconds=(tuple(v / 1e3 for v in seconds),))
  return VerifySkip(k=k, drafter=ConstantDrafter(k=k, device=True), cost_model=table)


def simulate_points(measured: pd.DataFrame, files, cost, *, points, max_total_tokens: int,
                    requests_per_slot: int, min_requests: int, read_records,
                    seed_cost=None, min_occupancy: float | None = None) -> pd.DataFrame:
  """``measured`` (``measure_study``'s rows) with the simulators' numbers beside each
  (file, batch, point): ``sim_specjax_tau`` / ``sim_specjax_speedup`` (the same requests,
  continuous batching, ``cost``; end to end, the tail's partial batches and the prefills
  included), ``sim_specjax_full_tau`` / ``sim_specjax_full_speedup`` (the same run over
  its full-batch decode steps only (``min_occupancy``: as ``StudyConfig``'s; None: each
  batch size's as its measured rows record it, 1.0 where they have no such column), as the
  measured columns are; both charge a point that drafts with the zero-cost constant
  drafter no draft cost; an oracle or combination point's verify is that of its chosen
  run, the bound), ``sim_specjax_fixed_width_full_speedup`` (oracle and combination
  points: the same with every step charged W drafts a row, as the engine verifies them),
  ``sim_seed_speedup`` (the seed's semantics under ``cost``) and, with ``seed_cost``,
  ``sim_seed_h100_speedup`` (the seed's semantics under the seed's own cost model: what the
  seed's simulator prints). The ``ngram_lookup`` points get none (their tau is not the
  trace's).

  Raises:
    ValueError: with ``min_occupancy`` None, one batch size's rows record two values.
  """
  from harness.seed_simulator import MATCH_PROBABILITY, simulate_seed  # noqa: PLC0415
  from harness.simulator import Policy, simulate  # noqa: PLC0415
  from specjax.cost_model import DraftCost  # noqa: PLC0415

  by_point = {p.label: p for p in points}
  # The engine's prefill is KV-only: output position 0 is a decode step's.
  engine_cost = dataclasses.replace(cost, prefill_emits_token=False)
  out = []
  for path in files:
    data = os.path.basename(path).removeprefix("combined_").removesuffix(".jsonl")
    raw = read_records(path)
    records = fitting_records(raw, max_total_tokens)
    sub = measured[measured.data == data]
    for batch in sorted(sub.batch.unique()):
      n = num_requests(int(batch), len(records), requests_per_slot, min_requests)
      occupancy = min_occupancy
      if occupancy is None:
        recorded = set(sub[sub.batch == batch].get("min_occupancy", pd.Series(dtype=float))
                       .dropna())
        if len(recorded) > 1:
          raise ValueError(f"{data} batch {batch}: rows record min_occupancy "
                           f"{sorted(recorded)}; one value per batch size is simulated")
        occupancy = float(recorded.pop()) if recorded else 1.0
      for label in sub[sub.batch == batch].point.unique():
        p = by_point.get(label)
        row = dict(data=data, batch=int(batch), point=label)
        if p is not None and p.policy is not None and p.length:
          kind, methods, k = p.policy
          pol = Policy(kind=kind, methods=methods, k=k)
          # A point drafting with the zero-cost constant drafter is simulated drafting free.
          point_cost = engine_cost if p.drafter != "constant" else dataclasses.replace(
              engine_cost, drafts={**engine_cost.drafts, **{m: DraftCost() for m in methods}})
          sim = simulate(records[:n], point_cost, pol, int(batch), batching="continuous",
                         min_occupancy=occupancy)
          row.update(sim_specjax_tau=sim["tau"], sim_specjax_speedup=sim["speedup"],
                     sim_specjax_full_tau=sim["full_tau"],
                     sim_specjax_full_speedup=sim["full_speedup"])
          if kind in ("oracle", "combine"):  # what the engine runs: k drafts every step
            wide = simulate(records[:n], point_cost, dataclasses.replace(pol, fixed_width=True),
                            int(batch), batching="continuous", min_occupancy=occupancy)
            row.update(sim_specjax_fixed_width_full_speedup=wide["full_speedup"])
          mp = MATCH_PROBABILITY.get(data) if kind == "fixed" and NGRAM in methods else None
          for name, model in (("sim_seed", cost), ("sim_seed_h100", seed_cost)):
            if model is None:
              continue
            seed_pol = pol if kind != "combine" else Policy(kind=kind, methods=(NGRAM, EAGLE),
                                                              k=k)
            res = simulate_seed(raw, model, seed_pol, int(batch), match_probability=mp)
            row[f"{name}_speedup"] = res["speedup"]
        out.append(row)
  sims = pd.DataFrame(out)
  return measured.merge(sims, on=["data", "batch", "point"], how="left")


def predict_points(files, batch_sizes, cost, *, points, **kwargs) -> pd.DataFrame:
  """``simulate_points``' columns for every replayed point of ``points`` at every batch
  size and file, nothing measured (one row per (data, batch, point)): the prediction a
  device run is then compared with. ``kwargs``: ``simulate_points``' other arguments."""
  data = [os.path.basename(f).removeprefix("combined_").removesuffix(".jsonl") for f in files]
  keys = pd.DataFrame([dict(data=d, batch=int(b), point=p.label) for d in data
                       for b in batch_sizes for p in points
                       if p.policy is not None and p.length],
                      columns=["data", "batch", "point"])
  return simulate_points(keys, files, cost, points=points, **kwargs)


def _gap_closed(table: pd.DataFrame, row) -> float:
  """``summary_table``'s ``gap_closed`` of one row (NaN but for adaptive points)."""
  if not row.point.startswith("adaptive_k"):
    return float("nan")
  same = table[(table.data == row.data) & (table.batch == row.batch)]
  fixed = same[same.point.str.match(r"(ngram|eagle3)_k\d+$")].speedup
  bound = same[same.point.str.startswith("combination_w")].sort_values("L").speedup
  if fixed.empty or bound.empty or bound.iloc[-1] <= fixed.max():
    return float("nan")
  return float((row.speedup - fixed.max()) / (bound.iloc[-1] - fixed.max()))


def draft_cost_points(measured: pd.DataFrame) -> pd.DataFrame:
  """The EAGLE-3 head's draft time per step, from ``measure_study`` rows, as
  ``harness.cost_fit.fit``'s evaluation rows (columns method = ``EAGLE``, batch_size, k,
  draft_ms, model, draft, device): each ``eagle3_k{k}`` row's step minus the zero-cost
  drafter's mean at the same file, batch size and k (``step_ms * (1 - verify_share)``
  after ``rebase_on_mean_baselines``, so rows of several runs combine; its fused step has
  no ``draft_ms`` of its own). Rows without a ``verify_share`` are skipped."""
  measured = rebase_on_mean_baselines(measured)
  rows = measured[measured.point.str.fullmatch(r"eagle3_k\d+")
                  & np.isfinite(measured.verify_share.astype(float))]
  return pd.DataFrame({
      "method": EAGLE, "batch_size": rows.batch.astype(int), "k": rows.L.astype(int),
      "draft_ms": rows.step_ms * (1.0 - rows.verify_share),
      "model": rows.target, "draft": "eagle3 head (random weights, fused)",
      "device": rows.device})


def fit_cost_model(engine_loop_frames, measured: pd.DataFrame, *, new_tokens: int,
                   name: str, switch_s: float = 0.0, query_model: str = "knee"):
  """``harness.cost_fit.fit`` of the engine-loop rows (target and host overhead) with the
  EAGLE-3 draft cost of ``draft_cost_points(measured)`` and a zero n-gram draft cost (the
  study's ``ngram_k`` points draft with the zero-cost constant drafter): the cost model
  the specjax-semantics simulator needs for the study's points on the card they ran on.
  ``query_model`` is ``harness.cost_fit.fit``'s.

  Raises:
    ValueError: ``measured`` has no EAGLE-3 point with a ``verify_share``, or as
      ``harness.cost_fit.fit``.
  """
  from harness import cost_fit  # noqa: PLC0415
  from specjax.cost_model import DraftCost  # noqa: PLC0415

  points = draft_cost_points(measured)
  if points.empty:
    raise ValueError("measured has no eagle3_k point with a verify_share (run the study "
                     "with its ngram_k points at the same k)")
  model = cost_fit.fit(engine_loop_frames, [points], new_tokens=new_tokens, name=name,
                       switch_s=switch_s, query_model=query_model)
  meta = dict(model.meta, draft_sources=dict(model.meta["draft_sources"], **{
      NGRAM: "zero: the seed study's ngram_k points draft with the constant drafter"}))
  return dataclasses.replace(model, drafts={**model.drafts, NGRAM: DraftCost()}, meta=meta)


# The seed paper's own figure: the uncapped oracle combination, InstructCoder, batch 1.
SEED_PAPER = {("instructcoder", 1, "combination"): 4.9}


def summary_table(both: pd.DataFrame) -> pd.DataFrame:
  """One row per (data, batch, point), c, speedup and verify_share against the mean
  baselines (``rebase_on_mean_baselines``): mean and std over repeats of tau, step_ms, c,
  speedup, verify_share and (where measured) draft_ms, verify_ms and host_ms, the
  simulators' columns, ``ngram_lookup_ms`` (the device n-gram lookup's step minus the
  zero-cost drafter's at the same k, beside the ``ngram_k`` rows), ``seed_paper_speedup``
  where the paper gives the point (its combination is uncapped; ours verifies at most W
  drafts) and, beside the adaptive rows, ``gap_closed`` = (adaptive - best fixed) /
  (combination - best fixed) in speedup (best fixed: the best ``ngram_k`` / ``eagle3_k``
  point; combination: the widest ``combination_w`` point; 1 = the oracle bound, < 0 =
  below the best fixed)."""
  both = rebase_on_mean_baselines(both)
  keys = ["data", "batch", "point"]
  stats = ["tau", "step_ms", "c", "speedup", "verify_share"] + [
      c for c in ("draft_ms", "verify_ms", "host_ms") if c in both]  # older runs: none
  g = both.groupby(keys, sort=False)
  out = g[stats].mean()
  std = g[stats].std(ddof=1)
  for col in stats:
    out[f"{col}_std"] = std[col]
  out["repeats"] = g.size()
  sims = [c for c in both if c.startswith("sim_")]
  extra = [c for c in ("adaptive_choice",) if c in both]
  out = out.join(g[sims + ["num_requests", "full_steps", "L"] + extra].first()).reset_index()
  lookup = []
  for _, r in out.iterrows():
    ms = float("nan")
    if r.point.startswith("ngram_k"):
      hit = out[(out.data == r.data) & (out.batch == r.batch)
                & (out.point == f"ngram_lookup_k{int(r.L)}")]
      if len(hit):
        ms = float(hit.step_ms.iloc[0] - r.step_ms)
    lookup.append(ms)
  out["ngram_lookup_ms"] = lookup
  out["gap_closed"] = [_gap_closed(out, r) for _, r in out.iterrows()]
  out["seed_paper_speedup"] = [
      SEED_PAPER.get((r.data, int(r.batch), r.point.partition("_w")[0]), float("nan"))
      for _, r in out.iterrows()]
  return out

