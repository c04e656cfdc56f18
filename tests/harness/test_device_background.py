"""benchmarks/device_background.sh poll: at most 8 files a call (the device tool's limit),
CSVs first, and every file new or changed since it was sent comes with a later poll."""

import os
import pathlib
import shutil
import subprocess

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "device_background.sh"


def _poll(job: pathlib.Path, out: pathlib.Path) -> set[str]:
  shutil.rmtree(out, ignore_errors=True)
  out.mkdir()
  env = dict(os.environ, DEVICE_JOB=str(job), OUT=str(out))
  subprocess.run(["bash", str(SCRIPT), "poll", "1"], env=env, check=True,
                 capture_output=True, text=True)
  return {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()}


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_poll_sends_at_most_eight_files_csvs_first_and_the_rest_later(tmp_path):
  job, out = tmp_path / "job", tmp_path / "out"
  (job / "step").mkdir(parents=True)
  (job / "driver.log").write_text("x\n")
  (job / "DONE").write_text("")
  (job / "session.log").write_text("s\n")
  for i in range(7):
    (job / "step" / f"f{i}.log").write_text(f"{i}\n")
  (job / "step" / "results.csv").write_text("a\n")
  (job / "step b").mkdir()
  (job / "step b" / "it's a.log").write_text("spaces and a quote\n")
  (job / "step" / "model.bin").write_text("not sent\n")

  first = _poll(job, out)
  assert len(first) == 8
  assert {"step/results.csv", "session.log"} <= first
  second = _poll(job, out)
  assert first | second == {"driver.log", "session.log", "step/results.csv",
                            "step b/it's a.log", *(f"step/f{i}.log" for i in range(7))}
  assert not first & second
  assert _poll(job, out) == set()

  csv = job / "step" / "results.csv"
  csv.write_text("a\nb\n")
  os.utime(csv, (csv.stat().st_atime, csv.stat().st_mtime + 5))
  assert _poll(job, out) == {"step/results.csv"}
  assert (out / "step" / "results.csv").read_text() == "a\nb\n"
