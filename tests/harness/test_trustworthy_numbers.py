"""Numbers a reader can trust: repeats sample anew, latencies leave compiles out,
the S_pred / measured decomposition is exact, spreads follow scipy, figures and the
report are written."""

import json
import math
import types

import numpy as np
import pandas as pd
import pytest
from scipy import stats
from test_evaluation import VOCAB, StubTokenizer

from harness import evaluation
from harness.evaluation import EvalConfig, run_evaluation
from harness.reconcile import speedups
from harness.stats import aggregate, format_mean_std, spread
from methods.registry import make_method
from models import testing
from models.config import ModelConfig
from specjax.config import EngineConfig, SamplingParams
from specjax.engine import Engine
from specjax.metrics import RunMetrics, StepRecord, compile_affected, latency_summary
from specjax.request import Request
from specjax.steps import split_model


@pytest.fixture
def tiny_target(monkeypatch):
  cfg = testing.tiny_config("llama", vocab_size=VOCAB)
  model = testing.random_model(cfg, seed=0)

  def load(name, dtype):
    return types.SimpleNamespace(name=name, config=model.cfg, model=model,
                                 tokenizer=StubTokenizer())

  monkeypatch.setattr(evaluation, "load_model", load)


def test_repeats_sample_anew_and_seed_reproduces(tiny_target, tmp_path):
  def run(out):
    cfg = EvalConfig(target="tiny-target", methods=("ngram",), dataset="gsm8k", num_prompts=3,
                     batch_sizes=(2,), max_new_tokens=8, temperature=0.8, repeats=2,
                     page_size=8, warmup=False, output_dir=str(out))
    df = run_evaluation(cfg, progress=False, verbose=False)
    recs = [json.loads(x) for x in (out / "outputs.jsonl").read_text().splitlines()]
    return df, {(r["method"], r["repeat"], r["request_id"]): r["output_token_ids"] for r in recs}

  df, first = run(tmp_path / "a")
  _, again = run(tmp_path / "b")
  assert first == again  # same seed: every repeat reproduces token for token
  for method in ("ar", "ngram"):
    rep0 = [v for (m, r, _), v in sorted(first.items()) if m == method and r == 0]
    rep1 = [v for (m, r, _), v in sorted(first.items()) if m == method and r == 1]
    assert rep0 != rep1, method  # other repeat, other sampling seed
  # results.json: one cell per (method, batch) with mean, std and a 95 % interval
  summary = json.loads((tmp_path / "a" / "results.json").read_text())
  cell = next(c for c in summary["cells"] if c["method"] == "ngram")
  assert cell["n_repeats"] == 2
  taus = df[df.method == "ngram"].tau.to_numpy()
  assert cell["tau_mean"] == pytest.approx(taus.mean())
  assert cell["tau_std"] == pytest.approx(taus.std(ddof=1))
  for name in ("speedup.png", "categories.png", "categories.csv"):
    assert (tmp_path / "a" / name).stat().st_size > 0, name


def _cfg() -> ModelConfig:
  # Its own shapes (D=24), so no other test has compiled its steps yet.
  return ModelConfig(family="llama", vocab_size=64, hidden_size=24, intermediate_size=48,
                     num_layers=1, num_heads=2, num_kv_heads=1, head_dim=12,
                     tie_word_embeddings=False, max_position_embeddings=128)


def test_compile_mid_run_flags_the_requests_alive_then():
  model = split_model(testing.random_model(_cfg(), seed=1))
  engine = Engine(model, make_method("ar", 0),
                  EngineConfig(max_num_seqs=2, max_model_len=64, page_size=8, num_pages=32,
                               min_prefill_bucket=8))
  sp = SamplingParams(max_tokens=3, ignore_eos=True)
  engine.generate([Request("warm", (1, 2, 3, 4), sp)])  # compiles the short shapes
  long_prompt = tuple(range(1, 41))  # new prefill and KV-page buckets: compiles mid-run
  requests = [Request("a", (5, 6, 7, 8), sp, 0.0), Request("b", (9, 10, 11, 12), sp, 0.5),
              Request("c", long_prompt, sp, 1.0), Request("d", (13, 14, 15, 16), sp, 1.0)]
  outs, met = engine.generate(requests)
  assert met.num_compiles > 0 and met.compile_windows
  affected = compile_affected(outs, met.compile_windows)
  assert affected.tolist() == [False, False, True, True]
  lat = latency_summary(outs, affected)
  assert lat["num_latency_excluded"] == 2
  longest_compile = max(e - s for s, e in met.compile_windows)
  # The reported latencies are those of a and b: none of them holds a compile.
  assert lat["latency_p99_s"] < longest_compile
  assert lat["ttft_p99_s"] == pytest.approx(np.percentile([o.ttft_s for o in outs[:2]], 99))
  assert max(o.latency_s for o in outs[2:]) >= longest_compile  # what would have leaked in


def _step(rows, emitted, step_s, pages=4, compiled=False):
  z = np.zeros(1, np.int32)
  return StepRecord(num_rows=rows, batch_bucket=rows, query_bucket=2, pages_bucket=pages,
                    num_draft_tokens=rows, num_accepted=emitted - rows, num_emitted=emitted,
                    accepted_per_position=z, drafted_per_position=z, draft_s=0.0,
                    verify_s=step_s, rejection_s=0.0, host_s=0.0, step_s=step_s,
                    compiled=compiled)


def test_speedup_decomposition_is_exact_and_explained():
  # AR: 20 tokens at 4 rows (10 ms) and a tail of 4 single-row steps (8 ms), prefill 50 ms.
  ar = RunMetrics(steps=[_step(4, 4, 0.010)] * 4 + [_step(1, 1, 0.008)] * 4, prefill_s=0.05)
  # SD: tau 2 per row-step, 12 ms steps, a longer single-row tail, one compiled step.
  sd = RunMetrics(steps=[_step(4, 8, 0.012)] * 2 + [_step(1, 2, 0.011)] * 6
                  + [_step(1, 1, 0.5, compiled=True)], prefill_s=0.05,
                  compile_windows=[(0.0, 0.5)])
  tau = sum(s.num_emitted for s in sd.steps) / sum(s.num_rows for s in sd.steps)
  r = speedups(sd, ar, tau)
  sd_s = 2 * 0.012 + 6 * 0.011
  sd_tps = 28 / sd_s
  ar_tps = 20 / (4 * 0.010 + 4 * 0.008)
  assert r["measured_speedup"] == pytest.approx(sd_tps / ar_tps)
  assert r["c"] == pytest.approx(sd_s / (2 * 0.010 + 6 * 0.008))
  assert r["S_pred"] == pytest.approx(tau / r["c"])
  # S_pred / measured = (tau / tau_steady) * mix, exactly
  assert r["S_pred"] / r["measured_speedup"] == pytest.approx(
      tau / r["tau_steady"] * r["mix_factor"])
  ar_tpt = (4 * 0.010 + 4 * 0.008 + 0.05) / 20
  sd_tpt = (sd_s * 29 / 28 + 0.05) / 29
  assert r["e2e_speedup"] == pytest.approx(ar_tpt / sd_tpt)
  assert abs(r["S_pred"] / r["measured_speedup"] - 1) > 0.03
  assert "compiled steps left out" in r["notes"] and "rows per step" in r["notes"]
  # Same (rows, context) mix per token on both sides: they agree and nothing is noted.
  same = RunMetrics(steps=[_step(4, 8, 0.012)] * 2 + [_step(1, 2, 0.011)] * 2)
  ar2 = RunMetrics(steps=[_step(4, 4, 0.010)] * 4 + [_step(1, 1, 0.008)] * 4)
  r2 = speedups(same, ar2, 2.0)
  assert r2["S_pred"] == pytest.approx(r2["measured_speedup"]) and r2["notes"] == ""


def test_spread_matches_scipy_and_formats():
  vals = [1.0, 1.2, 1.1, math.nan]
  mean, std, lo, hi = spread(vals)
  x = np.array(vals[:3])
  assert mean == pytest.approx(x.mean()) and std == pytest.approx(x.std(ddof=1))
  half = stats.t.ppf(0.975, 2) * x.std(ddof=1) / math.sqrt(3)
  assert (lo, hi) == pytest.approx((x.mean() - half, x.mean() + half))
  assert math.isnan(spread([2.0])[1])
  assert format_mean_std(1.23456, 0.01) == "1.235 ± 0.010"
  assert format_mean_std(1.0, math.nan) == "1.000"
  df = pd.DataFrame({"method": ["a", "a", "b"], "batch_size": [1, 1, 1], "tau": [1.0, 3.0, 2.0]})
  agg = aggregate(df, columns=("tau",))
  assert agg.tau_mean.tolist() == [2.0, 2.0] and agg.n_repeats.tolist() == [2, 1]


def test_binary_help_and_errors_are_short():
  import subprocess  # noqa: PLC0415
  import sys  # noqa: PLC0415

  def run(*args):
    return subprocess.run([sys.executable, "-m", "experiments.evaluate", *args],
                          capture_output=True, text=True, timeout=120)

  help_ = run("--help")
  assert help_.returncode == 0 and "--repeats" in help_.stdout
  bad = run("--num_prompts=abc")
  assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0, bad.stderr
  assert bad.stderr.startswith("error: flag --num_prompts=abc")
  bogus = run("--categories=bogus", "--output_dir=/tmp/specjax_cli_test")
  assert bogus.returncode == 2, bogus.stderr
  assert bogus.stderr.strip().splitlines()[-1].startswith("error: categories=['bogus']")
  assert "Traceback" not in bogus.stderr


def test_report_compares_runs(tmp_path):
  from harness.report import write_report  # noqa: PLC0415

  def run_dir(name, taus):
    d = tmp_path / name
    d.mkdir()
    rows = [{"method": m, "batch_size": 1, "repeat": i, "tau": t, "S_pred": t / 1.1,
             "measured_speedup": t / 1.12, "lossless": m != "ar" or None, "notes": ""}
            for m, ts in (("ar", [1.0] * len(taus)), ("ngram", taus)) for i, t in enumerate(ts)]
    pd.DataFrame(rows).to_csv(d / "results.csv", index=False)
    (d / "config.json").write_text(json.dumps({"target": "tiny", "repeats": len(taus)}))
    return str(d)

  a = run_dir("a", [1.50, 1.52, 1.51])
  b = run_dir("b", [1.80, 1.82, 1.79])
  c = run_dir("c", [1.49, 1.53, 1.52])
  md, htm = write_report([a, b, c], str(tmp_path / "out"))
  text = open(md).read()
  assert "Comparison: run B vs run A" in text and "Comparison: run C vs run A" in text
  tau_rows = [line for line in text.splitlines() if "| ngram | 1 | tau |" in line]
  assert len(tau_rows) == 2
  assert "| yes (p=" in tau_rows[0] and "| no (p=" in tau_rows[1]
  assert "1.510 ± 0.010" in text
  assert "<table" in open(htm).read()
  with pytest.raises(ValueError, match="has no results.csv"):
    write_report([str(tmp_path)], str(tmp_path / "out"))


def test_compiled_prefill_is_left_out_of_e2e():
  ar = RunMetrics(steps=[_step(1, 1, 0.010)] * 10, prefill_s=1.4, num_prefill_tokens=1000,
                  prefill_compiled_s=1.2, prefill_compiled_tokens=200)
  sd = RunMetrics(steps=[_step(1, 2, 0.015)] * 5, prefill_s=0.25, num_prefill_tokens=1000)
  assert ar.steady_prefill_s() == pytest.approx(0.25)
  r = speedups(sd, ar, 2.0)
  assert r["e2e_speedup"] == pytest.approx((0.1 + 0.25) / (0.075 + 0.25))
  assert "AR prefill calls of 200 tokens compiled" in r["notes"]
