"""Counters in the hot path, rates in reports.

Per step: draft tokens proposed, accepted (the leading accepted run), emitted tokens,
accepted per draft position, phase wall times measured around ``block_until_ready``.
Derived (``summarize``): acceptance rate, tau = emitted / SD steps (bonus included, as
vLLM's mean acceptance length), per-position acceptance rate, c = SD step time / matched
AR step time, S_pred = tau / c, tokens/s, TTFT/TPOT/latency percentiles over the
requests no compile touched (``latency_summary``), SLO attainment and goodput.
"""

from __future__ import annotations

import dataclasses
import threading

import jax.monitoring
import numpy as np

__all__ = [
    "LATENCY_PERCENTILES",
    "CompileMonitor",
    "RunMetrics",
    "StepRecord",
    "MatchedSteps",
    "compile_affected",
    "latency_summary",
    "match_steps",
    "matched_c",
    "summarize",
]

# Percentiles reported for every latency (TTFT, TPOT, end-to-end, queueing).
LATENCY_PERCENTILES = (50, 90, 95, 99)

_COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)
# A jitted call whose C++ fast path misses goes through jit's trace cache, and JAX records
# a jaxpr_trace_duration event also when that cache hits (measured 0.0000 s, JAX 0.10.2
# CPU: the first call of a shape that ``Engine.precompile`` compiled ahead of time in a
# thread): such events are no compile work and must not flag a step as compiled. A real
# trace or lowering of anything the engine calls takes longer than this.
_MIN_EVENT_S = 1e-3


class CompileMonitor:
  """Process-wide compile counter fed by ``jax.monitoring`` duration events.

  ``count`` counts backend compiles (distinct executables built); ``seconds`` adds
  tracing, lowering and backend compile time. Read it before/after a step.
  """

  _lock = threading.Lock()
  _installed = False
  count = 0
  seconds = 0.0

  @classmethod
  def install(cls) -> type[CompileMonitor]:
    with cls._lock:
      if not cls._installed:
        jax.monitoring.register_event_duration_secs_listener(cls._on_event)
        cls._installed = True
    return cls

  @classmethod
  def _on_event(cls, event: str, duration: float, **_):
    if event in _COMPILE_EVENTS:
      if event != _COMPILE_EVENTS[2] and duration < _MIN_EVENT_S:
        return
      cls.seconds += duration
      if event == _COMPILE_EVENTS[2]:
        cls.count += 1

  @classmethod
  def snapshot(cls) -> tuple[int, float]:
    return cls.count, cls.seconds


@dataclasses.dataclass
class StepRecord:
  """One decode/verify step. Times in seconds."""

  num_rows: int
  batch_bucket: int
  query_bucket: int  # T = L + 1
  pages_bucket: int
  num_draft_tokens: int  # trees: nodes
  num_accepted: int
  num_emitted: int
  accepted_per_position: np.ndarray  # i32[k]: rows whose draft j (tree: depth j+1) was accepted
  drafted_per_position: np.ndarray  # i32[k]: rows with a draft at position j (tree: depth j+1)
  draft_s: float
  verify_s: float
  rejection_s: float
  host_s: float
  step_s: float
  compiled: bool  # a compile happened inside this step: excluded from steady timings


@dataclasses.dataclass
class RunMetrics:
  """All raw counters of one engine run."""

  steps: list[StepRecord] = dataclasses.field(default_factory=list)
  prefill_s: float = 0.0  # every prefill call, compiling ones included
  prefill_compiled_s: float = 0.0  # of which calls that compiled
  prefill_compiled_tokens: int = 0
  prefill_calls: list[int] = dataclasses.field(default_factory=list)  # tokens per prefill call
  num_prefill_tokens: int = 0
  compile_s: float = 0.0
  num_compiles: int = 0
  wall_s: float = 0.0  # whole run, compile time included
  num_preemptions: int = 0
  kv_bytes_per_token: int = 0
  # (start, end) seconds after the run started of every step or prefill call that
  # compiled: requests alive during one have compile time in their latencies.
  compile_windows: list[tuple[float, float]] = dataclasses.field(default_factory=list)

  def steady_steps(self) -> list[StepRecord]:
    return [s for s in self.steps if not s.compiled]

  def steady_prefill_s(self) -> float:
    """Prefill time without compiles: the non-compiling calls' time scaled to every
    prefill token (``prefill_s`` when every call compiled). E.g. 1.4 s over 1000 tokens
    of which one compiling call of 200 tokens took 1.2 s -> 0.2 * 1000 / 800 = 0.25 s."""
    steady_tokens = self.num_prefill_tokens - self.prefill_compiled_tokens
    if self.prefill_compiled_tokens == 0 or steady_tokens <= 0:
      return self.prefill_s
    return (self.prefill_s - self.prefill_compiled_s) * self.num_prefill_tokens / steady_tokens


def _step_signature(s: StepRecord) -> tuple[int, int]:
  return (s.num_rows, s.pages_bucket)


@dataclasses.dataclass(frozen=True)
class MatchedSteps:
  """SD steady steps against the AR run's step times (``match_steps``). Seconds.

  Attributes:
    sd_s: summed time of the SD steps considered.
    ar_s: summed mean AR step time of their matches.
    sd_row_steps: rows summed over the SD steps considered.
    considered: SD steps with an AR step of the same row count.
    matched: of those, SD steps with an exact (rows, KV-page bucket) match.
  """

  sd_s: float
  ar_s: float
  sd_row_steps: int
  considered: int
  matched: int


def match_steps(sd: RunMetrics, ar: RunMetrics) -> MatchedSteps:
  """Matches each steady SD step to the mean AR step time of the same signature.

  An AR step matches an SD step when it had the same number of rows and the same
  KV-page bucket (same batch, same context bucket) in the AR run of the same requests.
  SD steps without a match fall back to AR steps with the same number of rows; SD
  steps with neither are left out (``considered`` counts the rest).
  """
  ar_by_sig: dict[tuple[int, int], list[float]] = {}
  ar_by_rows: dict[int, list[float]] = {}
  for s in ar.steady_steps():
    ar_by_sig.setdefault(_step_signature(s), []).append(s.step_s)
    ar_by_rows.setdefault(s.num_rows, []).append(s.step_s)
  sd_total = ar_total = 0.0
  matched = considered = rows = 0
  for s in sd.steady_steps():
    ref = ar_by_sig.get(_step_signature(s))
    if ref is not None:
      matched += 1
    else:
      ref = ar_by_rows.get(s.num_rows)
    if ref is None:
      continue
    considered += 1
    rows += s.num_rows
    sd_total += s.step_s
    ar_total += float(np.mean(ref))
  return MatchedSteps(sd_total, ar_total, rows, considered, matched)


def matched_c(sd: RunMetrics, ar: RunMetrics) -> tuple[float, float]:
  """c = SD step time / matched AR step time (``match_steps``), and the share of the
  considered SD steps matched exactly (rows and KV-page bucket)."""
  m = match_steps(sd, ar)
  if m.considered == 0 or m.ar_s == 0:
    return float("nan"), 0.0
  return m.sd_s / m.ar_s, m.matched / m.considered


def _pct(values, q):
  return float(np.percentile(values, q)) if len(values) else float("nan")


def compile_affected(outputs: list, windows: list[tuple[float, float]]) -> np.ndarray:
  """``bool[R]``: request r was alive (arrival to finish) while some step compiled.

  ``outputs`` are ``RequestOutput`` (``arrival_s``, ``latency_s`` in seconds after the
  run started); ``windows`` are ``RunMetrics.compile_windows``. E.g. a request alive
  over [0.5, 2.0] s and a compile window (1.9, 3.0) -> True; (2.1, 3.0) -> False.
  """
  out = np.zeros(len(outputs), bool)
  for i, o in enumerate(outputs):
    start, end = o.arrival_s, o.arrival_s + o.latency_s
    out[i] = any(ws < end and we > start for ws, we in windows)
  return out


def latency_summary(outputs: list, affected: np.ndarray, *, slo_ttft_s: float | None = None,
                    slo_tpot_s: float | None = None, duration_s: float = float("nan")) -> dict:
  """Latency statistics over the requests no compile touched.

  Args:
    outputs: ``RequestOutput`` list.
    affected: ``compile_affected(outputs, ...)``; those requests are left out of every
      latency statistic and counted in ``num_latency_excluded``.
    slo_ttft_s, slo_tpot_s: service-level objectives (seconds); a request meets the SLO
      when its TTFT and TPOT are within those given (DistServe's goodput).
    duration_s: the run's compile-free wall time, for ``requests_per_s`` and goodput.

  Returns:
    ``{ttft,tpot,latency,queue}_{mean,p50,p90,p95,p99}_s``, ``num_latency_excluded``,
    ``requests_per_s``, ``slo_attainment`` (share of measured requests meeting the SLO;
    NaN without one) and ``goodput_rps`` (= ``slo_attainment * requests_per_s``).
  """
  kept = [o for o, a in zip(outputs, affected) if not a]
  res: dict = {"num_latency_excluded": int(np.sum(affected))}
  for name in ("ttft", "tpot", "latency", "queue"):
    values = [getattr(o, f"{name}_s") for o in kept]
    res[f"{name}_mean_s"] = float(np.mean(values)) if values else float("nan")
    for q in LATENCY_PERCENTILES:
      res[f"{name}_p{q}_s"] = _pct(values, q)
  res["requests_per_s"] = len(outputs) / duration_s if duration_s > 0 else float("nan")
  if (slo_ttft_s is None and slo_tpot_s is None) or not kept:
    res["slo_attainment"] = float("nan")
  else:
    good = [(slo_ttft_s is None or o.ttft_s <= slo_ttft_s)
            and (slo_tpot_s is None or o.tpot_s <= slo_tpot_s) for o in kept]
    res["slo_attainment"] = float(np.mean(good))
  res["goodput_rps"] = res["slo_attainment"] * res["requests_per_s"]
  return res


def summarize(metrics: RunMetrics, outputs: list, k: int, *, slo_ttft_s: float | None = None,
              slo_tpot_s: float | None = None) -> dict:
  """Derived rates of one run (no AR reference needed); latencies per ``latency_summary``."""
  steps = metrics.steps
  steady = metrics.steady_steps()
  n_steps = len(steps)
  proposed = sum(s.num_draft_tokens for s in steps)
  accepted = sum(s.num_accepted for s in steps)
  emitted = sum(s.num_emitted for s in steps)
  row_steps = sum(s.num_rows for s in steps)
  row_steps_with_draft = sum(int(s.drafted_per_position[0]) if k else 0 for s in steps)
  out_tokens = sum(len(o.output_token_ids) for o in outputs)
  decode_s = sum(s.step_s for s in steady)
  decode_tokens = sum(s.num_emitted for s in steady)
  affected = compile_affected(outputs, metrics.compile_windows)
  res = {
      "num_requests": len(outputs),
      "num_steps": n_steps,
      "num_compiled_steps": n_steps - len(steady),
      "mean_rows_per_step": row_steps / n_steps if n_steps else float("nan"),
      "num_output_tokens": out_tokens,
      "num_draft_tokens": proposed,
      "num_accepted_tokens": accepted,
      "num_emitted_tokens": emitted,
      "acceptance_rate": accepted / proposed if proposed else float("nan"),
      # tau: committed tokens per sequence per SD step (accepted + recovered/bonus).
      "tau": emitted / row_steps if row_steps else float("nan"),
      "draft_coverage": row_steps_with_draft / row_steps if row_steps else float("nan"),
      "mean_step_ms": 1e3 * decode_s / len(steady) if steady else float("nan"),
      "draft_ms": 1e3 * np.mean([s.draft_s for s in steady]) if steady else float("nan"),
      "verify_ms": 1e3 * np.mean([s.verify_s for s in steady]) if steady else float("nan"),
      "rejection_ms": 1e3 * np.mean([s.rejection_s for s in steady]) if steady else float("nan"),
      "host_ms": 1e3 * np.mean([s.host_s for s in steady]) if steady else float("nan"),
      "decode_tokens_per_s": decode_tokens / decode_s if decode_s else float("nan"),
      "wall_s": metrics.wall_s,
      "compile_s": metrics.compile_s,
      "num_compiles": metrics.num_compiles,
      "prefill_s": metrics.prefill_s,
      "num_preemptions": metrics.num_preemptions,
      "kv_bytes_per_token": metrics.kv_bytes_per_token,
      **latency_summary(outputs, affected, slo_ttft_s=slo_ttft_s, slo_tpot_s=slo_tpot_s,
                        duration_s=metrics.wall_s - metrics.compile_s),
  }
  if k:
    acc = np.sum([s.accepted_per_position for s in steps], axis=0) if steps else np.zeros(k)
    drafted = np.sum([s.drafted_per_position for s in steps], axis=0) if steps else np.zeros(k)
    for j in range(k):
      res[f"accept_rate_pos{j + 1}"] = float(acc[j] / drafted[j]) if drafted[j] else float("nan")
  return res
