"""Device busy time from a ``jax.profiler`` trace: the union of the intervals of every
event on a device (GPU/TPU) track, so a step's device time can be set against the
engine's wall time per step in the same run."""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re

__all__ = ["device_busy_seconds", "op_sources", "ops_table", "top_host_events", "top_ops"]


def _track_events(trace_dir: str, host: bool = False) -> list[dict]:
  """The complete ("X") events on the device (GPU/TPU) tracks of the newest trace (with
  ``host``: on every other track, the host threads)."""
  files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True))
  if not files:
    raise FileNotFoundError(f"no *.trace.json.gz under {trace_dir}")
  with gzip.open(files[-1]) as f:
    events = json.load(f)["traceEvents"]
  names = {e["pid"]: e.get("args", {}).get("name", "") for e in events
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  device = {pid for pid, n in names.items() if "/device:" in n and "CPU" not in n.upper()}
  if not device:
    raise ValueError(f"no device track in {files[-1]} (process names: {sorted(names.values())})")
  return [e for e in events if e.get("ph") == "X" and (e.get("pid") in device) != host]


def device_busy_seconds(trace_dir: str) -> float:
  """Seconds during which any device track of the newest trace under ``trace_dir`` ran
  an op (overlapping ops counted once).

  Raises:
    FileNotFoundError: no ``*.trace.json.gz`` under ``trace_dir``.
    ValueError: the trace has no device track (e.g. a CPU-only run).
  """
  spans = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in _track_events(trace_dir))
  busy, end = 0.0, float("-inf")
  for s, t in spans:
    if t <= end:
      continue
    busy += t - max(s, end)
    end = t
  return busy * 1e-6


def top_ops(trace_dir: str, reps: int, fold: bool = True) -> list[tuple[str, float, int]]:
  """``(op name, ms per step, calls per step)`` of the device tracks of the newest trace
  under ``trace_dir``, most time first, the totals divided by ``reps`` steps; with
  ``fold`` numbered suffixes (``fusion.12``) are folded into one name. Raises as
  ``device_busy_seconds``."""
  total, calls = collections.Counter(), collections.Counter()
  for e in _track_events(trace_dir):
    name = str(e.get("name", ""))
    if fold:
      name = re.sub(r"\.\d+$", "", name)
    total[name] += e.get("dur", 0)
    calls[name] += 1
  return [(n, us / reps / 1e3, calls[n] // reps) for n, us in total.most_common()]


def op_sources(trace_dir: str) -> dict[str, dict[str, str]]:
  """``{op name: {"hlo_module": ..., "hlo_op": ...}}`` for the device ops of the newest
  trace under ``trace_dir`` whose events carry those arguments (XLA GPU kernels do), so an
  op of ``top_ops`` can be found in an ``--xla_dump_to`` dump (``benchmarks.hlo_fusions``).
  Ops without them are left out. Raises as ``device_busy_seconds``."""
  out = {}
  for e in _track_events(trace_dir):
    name, args = str(e.get("name", "")), e.get("args", {})
    if name not in out and ("hlo_module" in args or "hlo_op" in args):
      out[name] = {k: str(args.get(k, "")) for k in ("hlo_module", "hlo_op")}
  return out


def ops_table(trace_dir: str, reps: int) -> list[dict]:
  """Every device op of the newest trace, unfolded, most time first: one dict per op with
  ``op``, ``ms_per_step``, ``calls_per_step`` (``top_ops(fold=False)``) and ``hlo_module``,
  ``hlo_op`` (``op_sources``; "" where the trace has none): the rows of the ops CSVs that
  ``experiments.evaluate --device_profile`` and ``benchmarks.engine_loop --top_ops`` write.
  Raises as ``device_busy_seconds``."""
  sources = op_sources(trace_dir)
  return [dict(op=op, ms_per_step=ms, calls_per_step=calls,
               hlo_module=sources.get(op, {}).get("hlo_module", ""),
               hlo_op=sources.get(op, {}).get("hlo_op", ""))
          for op, ms, calls in top_ops(trace_dir, reps, fold=False)]


def top_host_events(trace_dir: str, reps: int) -> list[tuple[str, float, int]]:
  """``(event name, ms per step, calls per step)`` of the host tracks (runtime TraceMe
  and CUDA API events: dispatch, command-buffer updates, launches, copies) of the newest
  trace under ``trace_dir``, most time first. Times are inclusive (a nested event is
  also inside its parent's), the totals divided by ``reps`` steps; numbered suffixes are
  folded. Raises as ``device_busy_seconds``."""
  total, calls = collections.Counter(), collections.Counter()
  for e in _track_events(trace_dir, host=True):
    name = re.sub(r"\.\d+$", "", str(e.get("name", "")))
    total[name] += e.get("dur", 0)
    calls[name] += 1
  return [(n, us / reps / 1e3, calls[n] // reps) for n, us in total.most_common()]
