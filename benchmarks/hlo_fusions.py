r"""What the most expensive device ops of a profile are: their HLO instructions and fused
computations, looked up in an XLA dump.

Run a profiled evaluation with the dump on, then point this at both, e.g.::

  XLA_FLAGS="--xla_dump_to=/tmp/dump --xla_dump_hlo_as_text" python -m experiments.evaluate \
    ... --device_profile --output_dir=/tmp/e
  python -m benchmarks.hlo_fusions --ops_csv=/tmp/e/ops_eagle3_b1.csv --dump_dir=/tmp/dump \
    --top=8 > fusions.txt

An op is found by its ``hlo_module`` / ``hlo_op`` columns when the trace gave them
(``harness.device_time.op_sources``), else by its kernel name (XLA names the kernel of
``gemm_fusion_dot.12`` ``gemm_fusion_dot_12``) in every optimized module of the dump; each match is printed.
"""

from __future__ import annotations

import glob
import os
import re

import pandas as pd
from absl import app, flags

from harness import cli

_OPS = flags.DEFINE_string("ops_csv", None, "An ops CSV of evaluate --device_profile "
                           "(columns op, ms_per_step, calls_per_step[, hlo_module, hlo_op]).")
_DUMP = flags.DEFINE_string("dump_dir", None, "The --xla_dump_to directory of that run.")
_TOP = flags.DEFINE_integer("top", 8, "How many of the most expensive ops to look up.", lower_bound=1)
_LINES = flags.DEFINE_integer("max_lines", 40, "Lines of each fused computation printed.",
                              lower_bound=1)

_MAX_MATCHES = 3  # modules printed per op


def _computations(text: str) -> dict[str, list[str]]:
  """``{computation name: its lines}`` of an HLO module's text."""
  out, name = {}, None
  for line in text.splitlines():
    m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) ", line)
    if m and line.rstrip().endswith("{"):
      name = m.group(1)
      out[name] = [line]
    elif name is not None:
      out[name].append(line)
      if line.startswith("}"):
        name = None
  return out


def describe(op: str, module: str, hlo_op: str, files: list[str], max_lines: int) -> list[str]:
  """Lines describing ``op``: for each optimized module of ``files`` (those named after
  ``module`` when given) holding its instruction, the instruction and the computation it
  calls, cut to ``max_lines`` (at most 3 modules)."""
  # XLA names the kernel of instruction "gemm_fusion_dot.82" "gemm_fusion_dot_82".
  # Inside a command buffer (CUDA graph) the trace names the buffer, not the fusion.
  if hlo_op.startswith("command_buffer"):
    hlo_op = ""
  names = {hlo_op} if hlo_op else {op, re.sub(r"_(\d+)$", r".\1", op)}
  found, matches = [], 0
  for path in files:
    if module and module not in os.path.basename(path):
      continue
    with open(path) as f:
      text = f.read()
    for name in names:
      m = re.search(rf"^\s*(?:ROOT )?%{re.escape(name)} = .*$", text, re.M)
      if not m:
        continue
      matches += 1
      if matches > _MAX_MATCHES:
        continue
      line = m.group(0).strip()
      found.append(f"  [{os.path.basename(path)}] {line[:600]}")
      called = re.search(r"calls=%([\w.\-]+)", line)
      if called:
        body = _computations(text).get(called.group(1), [])
        found += ["    " + b[:300] for b in body[:max_lines]]
        if len(body) > max_lines:
          found.append(f"    ... {len(body) - max_lines} more lines")
  if matches > _MAX_MATCHES:
    found.append(f"  ... found in {matches - _MAX_MATCHES} more modules")
  return found or ["  (not found in the dump)"]


def main(argv):
  del argv
  if not _OPS.value or not _DUMP.value:
    raise app.UsageError("--ops_csv and --dump_dir are required")
  files = sorted(glob.glob(os.path.join(_DUMP.value, "*after_optimizations.txt")))
  if not files:
    raise FileNotFoundError(f"no *after_optimizations.txt under --dump_dir={_DUMP.value!r}")
  ops = pd.read_csv(_OPS.value).fillna("")
  for _, row in ops.head(_TOP.value).iterrows():
    print(f"== {row['op']}: {row['ms_per_step']:.4f} ms/step, {row['calls_per_step']} calls/step")
    for line in describe(str(row["op"]), str(row.get("hlo_module", "")),
                         str(row.get("hlo_op", "")), files, _LINES.value):
      print(line)


if __name__ == "__main__":
  cli.run(main)
