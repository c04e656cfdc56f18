"""Counters in the hot path, rates in reports.

Per step: draft tokens proposed, accepted (the leading accepted run), emitted tokens,
accepted per draft position, phase wall times measured around ``block_until_ready``.
Derived (``summarize``): acceptance rate, tau = emitted / SD steps (bonus included, as
vLLM's mean acceptance length), per-position acceptance rate, c = SD step time / matched
AR step time, S_pred = tau / c, tokens/s, TTFT/TPOT/latency percentiles.
"""

from __future__ import annotations

import dataclasses
import threading

import jax.monitoring
import numpy as np

__all__ = ["CompileMonitor", "StepRecord", "RunMetrics", "summarize", "matched_c"]

_COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)


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
  prefill_s: float = 0.0
  prefill_calls: list[int] = dataclasses.field(default_factory=list)  # tokens per prefill call
  num_prefill_tokens: int = 0
  compile_s: float = 0.0
  num_compiles: int = 0
  wall_s: float = 0.0  # whole run, compile time included
  num_preemptions: int = 0
  kv_bytes_per_token: int = 0

  def steady_steps(self) -> list[StepRecord]:
    return [s for s in self.steps if not s.compiled]


def _step_signature(s: StepRecord) -> tuple[int, int]:
  return (s.num_rows, s.pages_bucket)


def matched_c(sd: RunMetrics, ar: RunMetrics) -> tuple[float, float]:
  """c = SD step time / matched AR step time, and the share of SD steps matched.

  An AR step matches an SD step when it had the same number of rows and the same
  KV-page bucket (same batch, same context bucket) in the AR run of the same requests.
  SD steps without a match fall back to AR steps with the same number of rows; the
  share matched exactly is returned so reports can show it.
  """
  ar_by_sig: dict[tuple[int, int], list[float]] = {}
  ar_by_rows: dict[int, list[float]] = {}
  for s in ar.steady_steps():
    ar_by_sig.setdefault(_step_signature(s), []).append(s.step_s)
    ar_by_rows.setdefault(s.num_rows, []).append(s.step_s)
  sd_total = ar_total = 0.0
  matched = considered = 0
  for s in sd.steady_steps():
    ref = ar_by_sig.get(_step_signature(s))
    if ref is not None:
      matched += 1
    else:
      ref = ar_by_rows.get(s.num_rows)
    if ref is None:
      continue
    considered += 1
    sd_total += s.step_s
    ar_total += float(np.mean(ref))
  if considered == 0 or ar_total == 0:
    return float("nan"), 0.0
  return sd_total / ar_total, matched / max(considered, 1)


def _pct(values, q):
  return float(np.percentile(values, q)) if len(values) else float("nan")


def summarize(metrics: RunMetrics, outputs: list, k: int) -> dict:
  """Derived rates of one run (no AR reference needed)."""
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
  res = {
      "num_requests": len(outputs),
      "num_steps": n_steps,
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
      "ttft_p50_s": _pct([o.ttft_s for o in outputs], 50),
      "ttft_p95_s": _pct([o.ttft_s for o in outputs], 95),
      "tpot_p50_s": _pct([o.tpot_s for o in outputs], 50),
      "tpot_p95_s": _pct([o.tpot_s for o in outputs], 95),
      "latency_p50_s": _pct([o.latency_s for o in outputs], 50),
      "latency_p95_s": _pct([o.latency_s for o in outputs], 95),
      "queue_p50_s": _pct([o.queue_s for o in outputs], 50),
      "queue_p95_s": _pct([o.queue_s for o in outputs], 95),
  }
  if k:
    acc = np.sum([s.accepted_per_position for s in steps], axis=0) if steps else np.zeros(k)
    drafted = np.sum([s.drafted_per_position for s in steps], axis=0) if steps else np.zeros(k)
    for j in range(k):
      res[f"accept_rate_pos{j + 1}"] = float(acc[j] / drafted[j]) if drafted[j] else float("nan")
  return res
