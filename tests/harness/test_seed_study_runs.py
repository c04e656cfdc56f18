"""Seed-study runs are independent (``harness.seed_study.measure_study``): adaptive's
estimates are learned afresh in every run, so a file's adaptive row does not depend on
the file measured before it, and repeats replay the same choices."""

import os

import numpy as np
import pytest

from harness import seed_study
from harness.traces import MethodTrace, TraceRecord, read_jsonl, write_jsonl
from models.testing import random_model, tiny_config
from specjax.steps import split_model


def _records(num: int, ngram_good: bool, seed: int):
  """n-gram accepts all its drafts and EAGLE-3 none (``ngram_good``), or the reverse."""
  rng = np.random.default_rng(seed)
  out = []
  for i in range(num):
    n = int(rng.integers(12, 20))
    prompt = [int(t) for t in rng.integers(0, 3, 12)]  # few ids: the n-gram lookup matches
    gen = [int(t) for t in rng.integers(0, 3, n)]
    good, bad = np.full(n, 4), np.ones(n, int)
    out.append(TraceRecord(f"r{i}", prompt, gen, {
        "eagle": MethodTrace(bad if ngram_good else good),
        "ngram": MethodTrace(good if ngram_good else bad)}))
  return out


@pytest.fixture(scope="module")
def target():
  return split_model(random_model(tiny_config("llama"), seed=1))


def _adaptive_rows(tmp_path, target, names, repeats=1):
  paths = [os.path.join(tmp_path, f"combined_{n}.jsonl") for n in names]
  points = tuple(p for p in seed_study.study_points((3,), (4,)) if p.label == "adaptive_k3")
  cfg = seed_study.StudyConfig(files=tuple(paths), batch_sizes=(1,), points=points,
                               min_requests=3, max_total_tokens=64, repeats=repeats,
                               csv_path=os.path.join(tmp_path, "_".join(names) + ".csv"))
  measured = seed_study.measure_study(cfg, target, target.config, target="tiny",
                                      dtype="float32", read_records=read_jsonl, log=lambda _: 0)
  return measured[measured.point == "adaptive_k3"]


@pytest.mark.slow  # 34 s on 2 CPU cores, mostly compiles
def test_a_file_does_not_inherit_the_estimates_of_the_file_before(tmp_path, target):
  # "good": every n-gram draft is accepted, no EAGLE-3 draft; "bad": the reverse.
  # Measured after "good", "bad" must choose as it does alone.
  write_jsonl(os.path.join(tmp_path, "combined_good.jsonl"), _records(3, True, seed=0))
  write_jsonl(os.path.join(tmp_path, "combined_bad.jsonl"), _records(3, False, seed=1))
  # (A run's tau counts only its steady steps: the first run of a shape on the CPU may
  # compile, so taus are compared between runs after the first.)
  after = _adaptive_rows(tmp_path, target, ["good", "bad"], repeats=2)
  alone = _adaptive_rows(tmp_path, target, ["bad"], repeats=2)
  bad = after[after.data == "bad"]
  assert bad.adaptive_choice.nunique() == 1  # repeats choose alike
  assert bad.adaptive_choice.iloc[0] == alone.adaptive_choice.iloc[0]
  assert bad.tau.iloc[-1] == alone.tau.iloc[-1]
  good = after[after.data == "good"].adaptive_choice.iloc[0]
  assert good != bad.adaptive_choice.iloc[0]  # the two files do choose differently


def test_host_called_proposers_compile_nothing_in_the_measured_runs(tmp_path, target):
  # Each file's warm-up run starts from a cleared method cache, as its measured runs do:
  # warmed up on the estimates the file before left, adaptive would choose (and compile)
  # other shapes than its measured run meets.
  from tests.harness.test_seed_study import _records as mixed_records  # noqa: PLC0415
  paths = []
  for j, name in enumerate(("instructcoder", "gsm8k")):
    paths.append(os.path.join(tmp_path, f"combined_{name}.jsonl"))
    write_jsonl(paths[-1], mixed_records(6, seed=3 + j))
  points = tuple(p for p in seed_study.study_points((3,), (4,)) if p.label == "adaptive_k3")
  cfg = seed_study.StudyConfig(files=tuple(paths), batch_sizes=(4,), points=points,
                               min_requests=3, max_total_tokens=64, repeats=1,
                               min_occupancy=0.5)
  measured = seed_study.measure_study(cfg, target, target.config, target="tiny",
                                      dtype="float32", read_records=read_jsonl, log=lambda _: 0)
  assert len(measured) == 2 and (measured.num_compiles == 0).all(), measured.num_compiles
