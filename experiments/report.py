"""Writes one Markdown + HTML report over evaluation run directories.

  python -m experiments.report results/RUN_A [results/RUN_B ...] [--output_dir=DIR]

Flags -> ``harness.report.write_report``. With two or more runs the report compares
each with the first (difference, and whether it exceeds the repeats' spread).
"""

from __future__ import annotations

from absl import app, flags

from harness import cli
from harness.report import write_report

_OUT = flags.DEFINE_string(
    "output_dir", None, "Where report.md and report.html go (default: the first run's directory).")


def main(argv):
  run_dirs = argv[1:]
  if not run_dirs:
    raise app.UsageError("name at least one run directory (an evaluate --output_dir)")
  md, htm = write_report(run_dirs, _OUT.value or run_dirs[0])
  print(f"wrote {md} and {htm}")


if __name__ == "__main__":
  cli.run(main)
