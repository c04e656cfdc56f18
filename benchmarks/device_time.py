"""Device busy time from a ``jax.profiler`` trace: the union of the intervals of every
event on a device (GPU/TPU) track, so a step's device time can be set against the
engine's wall time per step in the same run."""

from __future__ import annotations

import glob
import gzip
import json
import os

__all__ = ["device_busy_seconds"]


def device_busy_seconds(trace_dir: str) -> float:
  """Seconds during which any device track of the newest trace under ``trace_dir`` ran
  an op (overlapping ops counted once).

  Raises:
    FileNotFoundError: no ``*.trace.json.gz`` under ``trace_dir``.
    ValueError: the trace has no device track (e.g. a CPU-only run).
  """
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
  spans = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in events
                 if e.get("ph") == "X" and e.get("pid") in device)
  busy, end = 0.0, float("-inf")
  for s, t in spans:
    if t <= end:
      continue
    busy += t - max(s, end)
    end = t
  return busy * 1e-6
