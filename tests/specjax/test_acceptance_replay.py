"""Replayed acceptance (``EngineConfig.acceptance_replay``, ``Request.replay_acc_len``).

* On the same traces and batch size the engine's tau equals the trace simulator's
  (``harness.simulator``, fixed k, no prefill token) exactly, for a fused and a host
  drafter, at batch 1 and 3.
* Replaying the trace recorded from a real greedy n-gram run on the CPU
  (``harness.traces.build_traces``) reproduces that run's commits step by step.
* Bad requests and configs are one-line errors.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from harness.simulator import Policy, simulate
from harness.synthetic import ConstantDrafter
from harness.traces import MethodTrace, TraceRecord, build_traces, parse_replay, replay_requests
from methods.registry import make_method
from models.testing import random_model, tiny_config
from specjax.config import EngineConfig
from specjax.cost_model import preset
from specjax.engine import Engine
from specjax.request import Request, SamplingParams
from specjax.steps import split_model

K = 3
ENGINE = EngineConfig(max_num_seqs=3, max_model_len=96, page_size=8, acceptance_replay=True)


@pytest.fixture(scope="module")
def target():
  return split_model(random_model(tiny_config("llama"), seed=5))


def _records(num: int, seed: int):
  rng = np.random.default_rng(seed)
  out = []
  for i in range(num):
    n = int(rng.integers(1, 30))
    acc = rng.integers(1, 7, n)
    prompt = [int(t) for t in rng.integers(0, 50, int(rng.integers(1, 12)))]
    out.append(TraceRecord(f"r{i}", prompt, [0] * n, {"ngram": MethodTrace(acc)}))
  return out


def _cost():
  # The engine's prefill is KV-only: output position 0 is a decode step's.
  return dataclasses.replace(preset("seed-llama8b-h100"), prefill_emits_token=False)


@pytest.mark.parametrize("device", [True, False])
@pytest.mark.parametrize("batch", [1, 3])
def test_replayed_tau_equals_the_simulator(target, device, batch):
  records = _records(7, seed=batch)
  vocab = target.config.vocab_size
  requests = replay_requests(records, None, vocab_size=vocab)
  engine = Engine(target, ConstantDrafter(k=K, device=device), ENGINE.replace(max_num_seqs=batch))
  outputs, metrics = engine.generate(requests)
  assert [len(o.output_token_ids) for o in outputs] == [len(r.methods["ngram"].acc_len)
                                                        for r in records]
  steps = metrics.steps
  tau = sum(s.num_emitted for s in steps) / sum(s.num_rows for s in steps)
  sim = simulate(records, _cost(), Policy(kind="fixed", methods=("ngram",), k=K), batch, include_prefill=False)
  assert tau == pytest.approx(sim["tau"], abs=1e-12)
  # Per request: the steps a k-draft policy takes over its trace.
  for r, o in zip(records, outputs):
    acc, i, want = r.methods["ngram"].acc_len, 0, 0
    while i < len(acc):
      i += min(int(acc[i]), K + 1, len(acc) - i)
      want += 1
    assert o.num_steps == want


def test_replaying_a_real_run_reproduces_its_commits(target):
  rng = np.random.default_rng(11)
  base = [int(t) for t in rng.integers(0, 40, 6)]
  prompts = [tuple(base * 3), tuple(base * 2 + [7, 8])]  # repeats: n-gram matches
  sp = SamplingParams(max_tokens=24, ignore_eos=True)
  requests = [Request(f"q{i}", p, sp) for i, p in enumerate(prompts)]
  real_cfg = EngineConfig(max_num_seqs=1, max_model_len=96, page_size=8)
  method = make_method("ngram", K)
  real_out, real = Engine(target, method, real_cfg).generate(requests)
  assert sum(s.num_accepted for s in real.steps) > 0  # the trace is not trivial
  records = build_traces(target, None, requests, {"ngram": make_method("ngram", K)}, real_cfg,
                         k_max=K)
  replayed_out, replayed = Engine(target, ConstantDrafter(k=K),
                                  real_cfg.replace(acceptance_replay=True)).generate(
      replay_requests(records, "ngram", vocab_size=target.config.vocab_size))
  assert [s.num_emitted for s in replayed.steps] == [s.num_emitted for s in real.steps]
  assert ([len(o.output_token_ids) for o in replayed_out]
          == [len(o.output_token_ids) for o in real_out])


def test_bad_replay_inputs_are_one_line_errors(target):
  engine = Engine(target, ConstantDrafter(k=K), ENGINE)
  sp = SamplingParams(max_tokens=5, ignore_eos=True)
  with pytest.raises(ValueError, match="replay_acc_len must hold >= 5 entries"):
    engine.generate([Request("a", (1, 2), sp, replay_acc_len=(1, 2, 3))])
  with pytest.raises(ValueError, match="replay_acc_len must hold"):
    engine.generate([Request("a", (1, 2), sp, replay_acc_len=(1, 0, 1, 1, 1))])
  with pytest.raises(ValueError, match="replay_acc_len must hold"):
    engine.generate([Request("a", (1, 2), sp)])
  plain = Engine(target, ConstantDrafter(k=K), ENGINE.replace(acceptance_replay=False))
  with pytest.raises(ValueError, match="does not replay acceptance"):
    plain.generate([Request("a", (1, 2), sp, replay_acc_len=(2,) * 5)])
  with pytest.raises(ValueError, match="exclude each other"):
    EngineConfig(acceptance_replay=True, synthetic_acceptance=(1.0,))
  assert parse_replay("replay:a/b.jsonl:eagle") == ("a/b.jsonl", "eagle")
  assert parse_replay("replay:a.jsonl") == ("a.jsonl", None)
  with pytest.raises(ValueError, match="replay:FILE"):
    parse_replay("replay:")
  two = TraceRecord("x", [1], [0], {"a": MethodTrace(np.ones(1, np.int64)),
                                    "b": MethodTrace(np.ones(1, np.int64))})
  with pytest.raises(ValueError, match="name one"):
    replay_requests([two], None, vocab_size=10)
  with pytest.raises(ValueError, match="no trace for method 'c'"):
    replay_requests([two], "c", vocab_size=10)


@pytest.mark.slow
def test_engine_loop_replays_a_trace_file(tmp_path):
  from harness.engine_loop import run_engine_loop  # noqa: PLC0415
  from harness.traces import write_jsonl  # noqa: PLC0415

  records = _records(5, seed=9)
  path = str(tmp_path / "trace.jsonl")
  write_jsonl(path, records)
  df = run_engine_loop(target="tiny", dtype="float32", batch_sizes=[2], contexts=[999],
                       lengths=[0, K], new_tokens=999, attention_implementation="reference",
                       profile=False, acceptance=f"replay:{path}", log=lambda *_: None)
  sim = simulate(records, _cost(), Policy(kind="fixed", methods=("ngram",), k=K), 2,
                 include_prefill=False)
  sd = df[df.L == K].iloc[0]
  assert sd.tau == pytest.approx(sim["tau"], abs=1e-12)
  assert sd.acceptance == "replay:trace.jsonl" and sd.num_requests == 5
  assert df[df.L == 0].iloc[0].tau == 1.0


@pytest.mark.slow
def test_evaluate_replays_a_trace_file(tmp_path):
  """``EvalConfig.acceptance="replay:..."``: a random-weight target, a fused random
  EAGLE-3 head drafting k every step; tau equals the simulator's, lossless is left empty."""
  from harness.evaluation import EvalConfig, run_evaluation  # noqa: PLC0415
  from harness.traces import write_jsonl  # noqa: PLC0415
  from models.heads import default_eagle3_layers  # noqa: PLC0415

  records = _records(4, seed=4)
  path = str(tmp_path / "trace.jsonl")
  write_jsonl(path, records)
  layers = default_eagle3_layers(tiny_config("llama").num_layers)
  cfg = EvalConfig(target="random:tiny", methods=("ar", "eagle3"),
                   method_options={"eagle3": {"feature_layers": layers}},
                   acceptance=f"replay:{path}:ngram", num_prompts=4, batch_sizes=(2,),
                   num_speculative_tokens=K, repeats=1, precompile=False, plots=False,
                   compilation_cache=False, matmul_precision=None)
  df = run_evaluation(cfg, progress=False, verbose=False)
  sd = df[df.method == "eagle3"].iloc[0]
  sim = simulate(records, _cost(), Policy(kind="fixed", methods=("ngram",), k=K), 2,
                 include_prefill=False)
  assert sd.tau == pytest.approx(sim["tau"], abs=1e-12)
  assert sd.acceptance == f"replay:{path}:ngram" and sd.lossless is None
  assert df[df.method == "ar"].iloc[0].tau == 1.0
  with pytest.raises(ValueError, match="replay:FILE"):
    EvalConfig(acceptance="replay")
