"""Predicted vs measured speedup of one SD run against the AR run of the same requests.

``S_pred = tau / c`` predicts the *decode-phase* speedup: tau is per row-step and c
compares each steady SD step with the AR steps of the same (rows, KV-page bucket). The
measured counterparts (``speedups``):

- ``measured_speedup``: decode-phase speedup, prefill excluded = SD decode tokens/s
  over AR decode tokens/s, each = tokens emitted by steady (non-compiling) steps / their
  summed step time.
- ``e2e_speedup``: prefill included: per-token time (steady decode time scaled to all
  emitted tokens, plus prefill time without compiling calls,
  ``RunMetrics.steady_prefill_s``) of AR over SD.

Exact decomposition (every steady SD step considered in c)::

  S_pred / measured_speedup = (tau / tau_steady) * (ar_row_step_matched / ar_row_step)

where ``tau_steady`` is tau over the steady steps only, ``ar_row_step_matched`` the
mean AR time per row-step at the SD steps' (rows, context) mix (c's denominator over
the SD row-steps) and ``ar_row_step`` the AR run's own time per emitted token. The first
factor moves when compiled steps (left out of the timings) had unusual tau; the second
when the SD run's batch occupancy or context mix differs from AR's (tails of a batch,
online arrivals) or SD steps had no exact AR match. ``notes`` names each factor off by
more than ``TOLERANCE``.
"""

from __future__ import annotations

import math

from specjax.metrics import RunMetrics, match_steps

__all__ = ["TOLERANCE", "speedups"]

# Relative gap between S_pred and measured_speedup above which a row explains itself.
TOLERANCE = 0.03


def _steady(m: RunMetrics) -> tuple[float, int, int]:
  steady = m.steady_steps()
  return (sum(s.step_s for s in steady), sum(s.num_emitted for s in steady),
          sum(s.num_rows for s in steady))


def _ratio(num: float, den: float) -> float:
  return num / den if den > 0 and not math.isnan(den) else float("nan")


def speedups(sd: RunMetrics, ar: RunMetrics, tau: float, latency_excluded: int = 0) -> dict:
  """Measured speedups of ``sd`` over ``ar`` and why they differ from ``S_pred``.

  Args:
    sd, ar: the SD and AR runs of the same requests.
    tau: the SD run's tau (all steps).
    latency_excluded: requests of the SD run left out of the latency statistics.

  Returns:
    ``c``, ``share_matched``, ``S_pred``, ``measured_speedup`` (decode phase),
    ``e2e_speedup`` (prefill included), ``tau_steady``, ``mix_factor``,
    ``prefill_share`` (prefill time / (prefill + decode) of the SD run) and ``notes``
    (a "; "-joined string, empty when nothing needs explaining).
  """
  m = match_steps(sd, ar)
  c = _ratio(m.sd_s, m.ar_s)
  share = m.matched / m.considered if m.considered else 0.0
  s_pred = _ratio(tau, c)
  sd_s, sd_emit, sd_rows = _steady(sd)
  ar_s, ar_emit, _ = _steady(ar)
  measured = _ratio(_ratio(sd_emit, sd_s), _ratio(ar_emit, ar_s))
  sd_all = sum(s.num_emitted for s in sd.steps)
  ar_all = sum(s.num_emitted for s in ar.steps)
  sd_decode = _ratio(sd_s * sd_all, sd_emit)  # steady time scaled to every emitted token
  ar_decode = _ratio(ar_s * ar_all, ar_emit)
  ar_prefill, sd_prefill = ar.steady_prefill_s(), sd.steady_prefill_s()
  e2e = _ratio(_ratio(ar_decode + ar_prefill, ar_all), _ratio(sd_decode + sd_prefill, sd_all))
  tau_steady = _ratio(sd_emit, sd_rows)
  mix = _ratio(_ratio(m.ar_s, m.sd_row_steps), _ratio(ar_s, ar_emit))
  prefill_share = _ratio(sd_prefill, sd_prefill + sd_decode)
  notes = []
  gap = _ratio(s_pred, measured) - 1
  if not math.isnan(gap) and abs(gap) > TOLERANCE:
    notes.append(f"S_pred {s_pred:.3f} vs measured {measured:.3f} ({gap:+.1%})")
    tau_factor = _ratio(tau, tau_steady)
    if abs(tau_factor - 1) > TOLERANCE / 3:
      notes.append(f"tau over steady steps {tau_steady:.3f} vs {tau:.3f} over all "
                   f"({len(sd.steps) - len(sd.steady_steps())} compiled steps left out)")
    if abs(mix - 1) > TOLERANCE / 3:
      ar_rows = _ratio(sum(s.num_rows for s in ar.steady_steps()), len(ar.steady_steps()))
      sd_mean_rows = _ratio(sd_rows, len(sd.steady_steps()))
      notes.append(f"AR time per row-step at the SD steps' (rows, context) mix is {mix:.3f}x "
                   f"AR's own (rows per step: SD {sd_mean_rows:.2f}, AR {ar_rows:.2f})")
    if share < 1:
      notes.append(f"{1 - share:.0%} of SD steps had no AR step of the same KV-page bucket")
    if m.considered < len(sd.steady_steps()):
      notes.append(f"{len(sd.steady_steps()) - m.considered} SD steps had no AR step with "
                   "as many rows (left out of c)")
  if sd.num_preemptions or ar.num_preemptions:
    notes.append(f"preemptions: SD {sd.num_preemptions}, AR {ar.num_preemptions}")
  for side, run in ((("SD", sd), ("AR", ar)) if sd is not ar else (("this run's", sd),)):
    if run.prefill_compiled_tokens:
      left = ("every prefill call compiled: e2e includes compile time"
              if run.prefill_compiled_tokens >= run.num_prefill_tokens
              else "left out of e2e, the rest scaled to all prefill tokens")
      notes.append(f"{side} prefill calls of {run.prefill_compiled_tokens} tokens compiled "
                   f"({run.prefill_compiled_s:.2f} s; {left})")
  if latency_excluded:
    notes.append(f"{latency_excluded} requests alive during a compile left out of latencies")
  return {
      "c": c, "share_matched": share, "S_pred": s_pred, "measured_speedup": measured,
      "e2e_speedup": e2e, "tau_steady": tau_steady, "mix_factor": mix,
      "prefill_share": prefill_share, "notes": "; ".join(notes),
  }
