"""The seed study on the engine (``harness.seed_study``, ``experiments.seed_study``).

* At batch 1 every point's measured tau equals the specjax-semantics simulator's on the
  same requests (fixed k with the EAGLE-3 head and the zero-cost drafter, the oracle at a
  verify width, the combination), and the report's columns are filled.
* The combination trace is the per-position maximum over the shorter list; records too
  long for the KV budget are left out; bad points are one-line errors.
"""

from __future__ import annotations

import os

import numpy as np
import pandas as pd
import pytest

from harness import seed_study
from harness.traces import MethodTrace, TraceRecord, read_jsonl, write_jsonl
from models.testing import random_model, tiny_config
from specjax.steps import split_model


def _records(num: int, seed: int = 0):
  rng = np.random.default_rng(seed)
  out = []
  for i in range(num):
    n = int(rng.integers(3, 20))
    e = rng.integers(1, 6, n + int(rng.integers(-2, 3)))  # EAGLE-3's own length
    g = rng.integers(1, 9, n)
    prompt = [int(t) for t in rng.integers(0, 50, int(rng.integers(2, 10)))]
    out.append(TraceRecord(f"r{i}", prompt, [0] * n,
                           {"eagle": MethodTrace(e), "ngram": MethodTrace(g)}))
  return out


def test_combined_and_fitting_records():
  recs = _records(6)
  both = seed_study.combined_records(recs)
  for r in both:
    e, g = r.methods["eagle"].acc_len, r.methods["ngram"].acc_len
    m = min(len(e), len(g))
    np.testing.assert_array_equal(r.methods["eagle+ngram"].acc_len,
                                  np.maximum(e[:m], g[:m]))
  longest = [len(r.prompt_token_ids) + max(len(r.generated_token_ids),
                                           *(len(t.acc_len) for t in r.methods.values()))
             for r in recs]
  cut = sorted(longest)[3]
  kept = seed_study.fitting_records(recs, cut)
  assert [r.request_id for r in kept] == [r.request_id for r, n in zip(recs, longest)
                                           if n <= cut]
  assert seed_study.num_requests(64, 300) == 128
  assert seed_study.num_requests(1, 300) == 4
  assert seed_study.num_requests(128, 100) == 100


def test_bad_points_are_errors():
  with pytest.raises(ValueError, match="fixed_k"):
    seed_study.study_points((0, 3), (8,))
  with pytest.raises(ValueError, match="needs the ar and ngram_k5 points measured before"):
    seed_study.verify_skip_method(5, 4, {("d", 0): 5.0}, {("d", 3, 0): 6.0})


def test_measured_tau_equals_the_simulator_at_batch_one(tmp_path):
  path = os.path.join(tmp_path, "combined_instructcoder.jsonl")
  write_jsonl(path, _records(5, seed=3))
  target = split_model(random_model(tiny_config("llama"), seed=1))
  points = tuple(p for p in seed_study.study_points((1, 3), (4,))
                 if p.label in ("ar", "eagle3_k3", "ngram_k1", "ngram_k3", "ngram_lookup_k3",
                                "verify_skip_k3", "oracle_eagle3_w4", "combination_w4"))
  cfg = seed_study.StudyConfig(files=(path,), batch_sizes=(1,), points=points,
                               min_requests=3, max_total_tokens=64,
                               csv_path=os.path.join(tmp_path, "m.csv"))
  measured = seed_study.measure_study(cfg, target, target.config, target="tiny",
                                      dtype="float32", read_records=read_jsonl, log=lambda _: 0)
  assert len(measured) == len(points)
  assert len(pd.read_csv(cfg.csv_path)) == len(points)  # appended as points finish
  assert (measured.num_requests == 3).all()
  from specjax.cost_model import preset

  cost = preset("seed-llama8b-h100")
  both = seed_study.simulate_points(measured, [path], cost, points=points,
                                    max_total_tokens=64, requests_per_slot=2, min_requests=3,
                                    read_records=read_jsonl, seed_cost=cost)
  replayed = both[~both.point.isin(["ar", "ngram_lookup_k3", "verify_skip_k3"])]
  assert len(replayed) == 5
  np.testing.assert_allclose(replayed.tau, replayed.sim_specjax_tau, rtol=0, atol=1e-12)
  assert replayed.sim_seed_speedup.notna().all()
  ar = both[both.point == "ar"].iloc[0]
  assert ar.tau == 1.0 and ar.c == 1.0
  zero = both[both.point == "ngram_k3"].iloc[0]
  assert zero.verify_share == 1.0
  # verify skipping truncates the n-gram drafts: never more committed than k = 3 commits
  skip = both[both.point == "verify_skip_k3"].iloc[0]
  assert 1.0 <= skip.tau <= zero.tau and 0 < skip.mean_verify_width <= 3
  assert np.isnan(skip.verify_share) and np.isnan(skip.sim_specjax_tau)
  np.testing.assert_allclose(both.speedup, both.tau / both.c)
  table = seed_study.summary_table(both)
  assert table.loc[table.point == "ngram_k3", "ngram_lookup_ms"].notna().all()
  assert table.loc[table.point == "combination_w4", "seed_paper_speedup"].item() == 4.9
