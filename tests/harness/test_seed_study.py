"""The seed study on the engine (``harness.seed_study``, ``experiments.seed_study``).

* At batch 1 every point's measured tau equals the specjax-semantics simulator's on the
  same requests (fixed k with the EAGLE-3 head and the zero-cost drafter, the oracle at a
  verify width, the combination), and the report's columns are filled.
* The combination trace is the per-position maximum over the shorter list; records too
  long for the KV budget are left out; bad points are one-line errors.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pandas as pd
import pytest

from harness import seed_study
from harness.traces import MethodTrace, TraceRecord, read_jsonl, replay_requests, write_jsonl
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
  points = {p.label: p for p in seed_study.study_points()}
  seed_study.check_point_order(list(points.values()))  # the full list is in order
  seed_study.check_point_order([points[x] for x in ("ar", "ngram_k5", "verify_skip_k5")])
  # The batch-64 run of 2026-12-07 measured five points for 15 min, then stopped here:
  with pytest.raises(ValueError, match=r"verify_skip_k5 needs \['ngram_k5'\] before it"):
    seed_study.check_point_order([points[x] for x in ("ar", "eagle3_k5", "verify_skip_k5")])
  with pytest.raises(ValueError, match=r"needs \['ar', 'ngram_k3'\]"):
    seed_study.check_point_order(
        [seed_study.Point("verify_skip_k3", "verify_skip", seed_study.NGRAM, 3, None)])


def test_measured_tau_equals_the_simulator_at_batch_one(tmp_path):
  path = os.path.join(tmp_path, "combined_instructcoder.jsonl")
  write_jsonl(path, _records(5, seed=3))
  target = split_model(random_model(tiny_config("llama"), seed=1))
  points = tuple(p for p in seed_study.study_points((1, 3), (4,))
                 if p.label in ("ar", "eagle3_k3", "ngram_k1", "ngram_k3", "ngram_lookup_k3",
                                "verify_skip_k3", "oracle_eagle3_w4", "combination_w4",
                                "adaptive_k3"))
  cfg = seed_study.StudyConfig(files=(path,), batch_sizes=(1,), points=points,
                               min_requests=3, max_total_tokens=64,
                               csv_path=os.path.join(tmp_path, "m.csv"))
  measured = seed_study.measure_study(cfg, target, target.config, target="tiny",
                                      dtype="float32", read_records=read_jsonl, log=lambda _: 0)
  assert len(measured) == len(points)
  assert len(pd.read_csv(cfg.csv_path)) == len(points)  # appended as points finish
  assert (measured.num_requests == 3).all()
  # every engine is warmed up before its measured runs, host-called proposers included
  assert (measured.num_compiles == 0).all(), measured[["point", "num_compiles"]]
  from specjax.cost_model import preset

  cost = preset("seed-llama8b-h100")
  both = seed_study.simulate_points(measured, [path], cost, points=points,
                                    max_total_tokens=64, requests_per_slot=2, min_requests=3,
                                    read_records=read_jsonl, seed_cost=cost)
  replayed = both[~both.point.isin(["ar", "ngram_lookup_k3", "verify_skip_k3",
                                     "adaptive_k3"])]
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
  # on the host path (adaptive; verify skipping runs fused since it plans its verify caps)
  # the step's parts add up to it; only host-called proposers draft
  assert (both.loc[both.point == "verify_skip_k3", "runs_on"] == "fused").all()
  host = both[both.point == "adaptive_k3"]
  np.testing.assert_allclose(host.draft_ms + host.verify_ms + host.host_ms, host.step_ms,
                             rtol=1e-9)
  assert (both.loc[both.point == "adaptive_k3", "draft_ms"] > 0).all()
  assert (both.loc[both.point == "eagle3_k3", "draft_ms"] == 0).all()
  # adaptive: every row committed at most the per-position better member's run (k = 3)
  # and at least the bonus token; the choice is reported; gap_closed is filled
  adaptive = both[both.point == "adaptive_k3"].iloc[0]
  from harness.simulator import Policy, simulate

  records = seed_study.fitting_records(read_jsonl(path), 64)[:3]
  best = simulate(records, dataclasses.replace(cost, prefill_emits_token=False),
                  Policy(kind="combine", methods=("eagle", "ngram"), k=3), 1,
                  batching="continuous")["tau"]
  assert 1.0 <= adaptive.tau <= best + 1e-12 and np.isnan(adaptive.verify_share)
  shares = dict(kv.split(":") for kv in adaptive.adaptive_choice.split(","))
  assert set(shares) == {"recorded_ngram", "eagle3", "none"}
  np.testing.assert_allclose(sum(map(float, shares.values())), 1.0, atol=2e-3)
  table = seed_study.summary_table(both)
  assert table.loc[table.point == "adaptive_k3", "gap_closed"].notna().all()
  assert table.loc[table.point == "ngram_k3", "ngram_lookup_ms"].notna().all()
  assert table.loc[table.point == "combination_w4", "seed_paper_speedup"].item() == 4.9


def test_adaptive_requests_carry_one_trace_per_member():
  recs = seed_study.combined_records(_records(4, seed=5))
  combined = replay_requests(recs, "eagle+ngram", vocab_size=64)
  reqs = seed_study.adaptive_requests(recs, "gsm8k", combined)
  for req, r in zip(reqs, recs):
    m = min(len(r.methods["eagle"].acc_len), len(r.methods["ngram"].acc_len))
    assert req.request_id == f"gsm8k/{r.request_id}" and req.sampling.max_tokens == m
    assert req.replay_acc_len == tuple(r.methods["ngram"].acc_len[:m])
    assert req.replay_sources == (tuple(r.methods["eagle"].acc_len[:m]),)


def test_recorded_ngram_drafts_what_the_real_context_proposes():
  """The draft length at output position p is the n-gram lookup's over the record's
  first P + p tokens, whatever the engine's own tokens (the drafts are the pending
  token); unknown ids and rows longer than their record are errors."""
  from harness.synthetic import RecordedNGram
  from methods.ngram import ngram_lookup
  from specjax.method import ProposeContext

  real = np.asarray([5, 6, 7, 9, 5, 6, 7, 1, 2, 3], np.int64)
  method = RecordedNGram(k=3, contexts={"a": real, "b": real[:4]})
  def ctx(ids, lengths, budgets):
    return ProposeContext(request_ids=ids, token_ids=[np.full(n, 11, np.int32) for n in lengths],
                          budgets=np.asarray(budgets, np.int32), page_indices=None,
                          temperature=None, top_k=None, top_p=None, keys=None)
  _, d = method.propose(None, ctx(["a", "b", "a"], [6, 4, 10], [3, 3, 2]))
  assert d.num_tokens.tolist() == [3, 0, len(ngram_lookup(real, 2, 4, 2))]
  # [5, 6, 7, 9, 5, 6]: [5, 6] matched at 0, 3 tokens follow (ngram_lookup's example)
  assert d.tokens[0].tolist() == [11] * 3 and d.tokens[1].tolist() == [-1] * 3
  assert method == RecordedNGram(k=3) and hash(method) == hash(RecordedNGram(k=3))
  with pytest.raises(KeyError, match="'c' has no recorded context"):
    method.propose(None, ctx(["c"], [3], [3]))
  with pytest.raises(ValueError, match="holds 5 tokens, its recorded context only 4"):
    method.propose(None, ctx(["b"], [5], [3]))


def test_predicted_points_cover_every_replayed_point_and_batch(tmp_path):
  from specjax import cost_model  # noqa: PLC0415
  path = str(tmp_path / "combined_gsm8k.jsonl")  # the seed rules need a known data set
  write_jsonl(path, _records(12))
  points = seed_study.study_points((1, 3), (8,))
  pred = seed_study.predict_points(
      [path], [2, 4], cost_model.load("seed-llama8b-h100"), points=points,
      max_total_tokens=64, requests_per_slot=2, min_requests=4, read_records=read_jsonl)
  replayed = [p for p in points if p.policy is not None and p.length]
  assert len(pred) == 2 * len(replayed)
  assert set(pred.point) == {p.label for p in replayed} and set(pred.batch) == {2, 4}
  for p in replayed:
    tau = pred[pred.point == p.label].sim_specjax_full_tau
    assert ((tau >= 1) & (tau <= p.length + 1)).all(), (p.label, tau.tolist())
  assert pred.sim_specjax_full_speedup.notna().all() and pred.sim_seed_speedup.notna().all()
  # the engine's oracle points verify W drafts every step: never faster than the bound
  wide = pred[pred.point.str.match(r"(oracle_eagle3|combination)_w")]
  assert len(wide) == 4 and wide.sim_specjax_fixed_width_full_speedup.notna().all()
  assert (wide.sim_specjax_fixed_width_full_speedup <= wide.sim_specjax_full_speedup).all()
  assert (wide.sim_specjax_fixed_width_full_speedup < wide.sim_specjax_full_speedup).any()
  assert pred[~pred.index.isin(wide.index)].sim_specjax_fixed_width_full_speedup.isna().all()


def test_min_occupancy_outside_its_range_is_an_error():
  with pytest.raises(ValueError, match=r"min_occupancy=1.5 must be in \(0, 1\]"):
    seed_study.StudyConfig(files=(), batch_sizes=(), points=(), min_occupancy=1.5)


def test_a_report_simulates_each_batch_size_with_its_recorded_occupancy(tmp_path):
  from specjax import cost_model  # noqa: PLC0415
  path = str(tmp_path / "combined_gsm8k.jsonl")
  write_jsonl(path, _records(12))
  points = [p for p in seed_study.study_points((3,), (8,)) if p.label == "eagle3_k3"]
  opts = dict(points=points, max_total_tokens=64,
              requests_per_slot=2, min_requests=4, read_records=read_jsonl)
  measured = pd.DataFrame([dict(data="gsm8k", batch=4, point="eagle3_k3", min_occupancy=0.5)])
  cost = cost_model.load("seed-llama8b-h100")
  recorded = seed_study.simulate_points(measured, [path], cost, **opts)
  assert recorded.sim_specjax_full_tau.item() == seed_study.simulate_points(
      measured, [path], cost, min_occupancy=0.5, **opts).sim_specjax_full_tau.item()
  # The full-batch rule matters here (a batch of 4 over 8 short requests), so a report
  # that simulated 1.0 instead would differ.
  assert recorded.sim_specjax_full_tau.item() != seed_study.simulate_points(
      measured, [path], cost, min_occupancy=1.0, **opts).sim_specjax_full_tau.item()
  both = pd.concat([measured, measured.assign(point="ar", min_occupancy=1.0)])
  with pytest.raises(ValueError, match=r"gsm8k batch 4: rows record min_occupancy \[0.5, 1.0\]"):
    seed_study.simulate_points(both, [path], cost, **opts)


def test_baselines_are_the_mean_of_their_repeats():
  """c and verify_share divide by the mean AR / zero-cost step of the same file and
  batch, not the repeat of the same index (AR's repeats run minutes before a point's):
  rows written with paired baselines are rebased, and one slow AR repeat no longer
  spreads every point."""
  rows = [dict(data="d", batch=4, point="ar", drafter="constant", L=0, repeat=r, tau=1.0,
               step_ms=s, c=1.0, speedup=1.0, verify_share=np.nan)
          for r, s in enumerate((10.0, 10.0, 13.0))]
  rows += [dict(data="d", batch=4, point="ngram_k3", drafter="constant", L=3, repeat=r,
                tau=2.0, step_ms=12.0, c=12.0 / a, speedup=2.0 * a / 12.0, verify_share=1.0)
           for r, a in enumerate((10.0, 10.0, 13.0))]
  rows += [dict(data="d", batch=4, point="eagle3_k3", drafter="eagle3", L=3, repeat=r,
                tau=3.0, step_ms=16.0, c=16.0 / a, speedup=3.0 * a / 16.0, verify_share=0.75)
           for r, a in enumerate((10.0, 10.0, 13.0))]
  rows.append(dict(data="e", batch=4, point="ngram_k3", drafter="constant", L=3, repeat=0,
                   tau=2.0, step_ms=9.0, c=0.9, speedup=2.2, verify_share=1.0))  # no AR
  out = seed_study.rebase_on_mean_baselines(pd.DataFrame(rows))
  ng = out[(out.point == "ngram_k3") & (out.data == "d")]
  np.testing.assert_allclose(ng.c, 12.0 / 11.0)
  np.testing.assert_allclose(ng.speedup, 2.0 * 11.0 / 12.0)
  np.testing.assert_allclose(out[out.point == "ar"].c, [10 / 11, 10 / 11, 13 / 11])
  np.testing.assert_allclose(out[out.point == "eagle3_k3"].verify_share, 0.75)
  # A verify share the run could not fill (its zero-cost point ran later) is filled; the
  # zero-cost rows' own is 1; a NaN AR repeat (no full-batch step) is left out.
  late = pd.DataFrame(rows).assign(verify_share=lambda f: f.verify_share.where(
      f.point != "eagle3_k3"))
  np.testing.assert_allclose(
      seed_study.rebase_on_mean_baselines(late).query("point == 'eagle3_k3'").verify_share, 0.75)
  assert (out[out.point == "ngram_k3"].verify_share == 1.0).all()
  nan_ar = pd.DataFrame(rows)
  nan_ar.loc[2, "step_ms"] = np.nan
  np.testing.assert_allclose(seed_study.rebase_on_mean_baselines(nan_ar).query(
      "point == 'ngram_k3' and data == 'd'").c, 12.0 / 10.0)
  assert seed_study._mean_of({("d", 0): 10.0, ("d", 1): np.nan, ("d", 2): 12.0}, "d") == 11.0
  assert out[out.data == "e"].c.item() == 0.9  # kept: nothing to rebase on
  table = seed_study.summary_table(pd.DataFrame(rows).assign(num_requests=8, full_steps=5))
  row = table[(table.point == "eagle3_k3") & (table.data == "d")].iloc[0]
  assert row.speedup == pytest.approx(3.0 * 11.0 / 16.0) and row.speedup_std == 0.0


def test_verify_skip_cost_table_leaves_out_runs_without_full_steps():
  """A repeat with no full-batch step (NaN step_ms) is left out of verify skipping's
  measured cost table (it stopped the study at the verify_skip point)."""
  method = seed_study.verify_skip_method(
      3, 4, {("d", 0): float("nan"), ("d", 1): 10.0},
      {("d", 1, 0): 11.0, ("d", 3, 0): float("nan"), ("d", 3, 1): 13.0})
  assert method.cost_model.seconds == ((0.010, 0.011, 0.013),)
