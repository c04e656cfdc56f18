"""``run_evaluation``'s phases alone, without models: the requests and the result rows."""

import dataclasses
import math

import numpy as np
import pytest

from harness import evaluation
from harness.build import build_method
from harness.divergence import Divergence
from harness.evaluation import EvalConfig
from harness.workloads import load_prompts, poisson_arrivals
from specjax.metrics import RunMetrics, StepRecord
from specjax.request import RequestOutput


class _CharTokenizer:
  """One token per character (ids 1..255), no chat template, one EOS id."""

  eos_token_ids = (0,)

  def encode(self, text, add_special_tokens=True):
    return [1 + ord(c) % 255 for c in text]


def test_requests_phase_builds_online_requests_that_fit_the_context():
  cfg = EvalConfig(dataset="gsm8k", num_prompts=5, max_new_tokens=7, page_size=16,
                   request_rate=2.0, seed=3)
  prompts = load_prompts("gsm8k", 5, None, 3)
  w = evaluation._build_requests(cfg, prompts, _CharTokenizer(), vocab_size=256,
                                 context=4096)
  assert [r.request_id for r in w.requests] == [p.id for p in prompts]
  assert [len(r.prompt_token_ids) for r in w.requests] == [len(p.text) for p in prompts]
  np.testing.assert_allclose([r.arrival_time for r in w.requests], poisson_arrivals(5, 2.0, 3))
  assert all(r.sampling.max_tokens == 7 and not r.sampling.ignore_eos for r in w.requests)
  longest = max(len(p.text) for p in prompts)
  assert w.max_model_len == math.ceil((longest + 7) / 16) * 16 and w.max_model_len % 16 == 0
  assert w.new_tokens == 7 and w.ignore_eos is False
  with pytest.raises(ValueError, match="more than the target's context"):
    evaluation._build_requests(cfg, prompts, _CharTokenizer(), vocab_size=256,
                               context=longest + 6)


def test_requests_phase_draws_random_prompts_without_a_tokenizer():
  cfg = EvalConfig(target="random:tiny", dataset="random", input_len=9, num_prompts=3,
                   max_new_tokens=4, page_size=8, batch_sizes=(1, 2))
  w = evaluation._build_requests(cfg, None, None, vocab_size=50, context=64)
  assert [len(r.prompt_token_ids) for r in w.requests] == [9, 9, 9]
  assert all(0 <= t < 50 for r in w.requests for t in r.prompt_token_ids)
  assert all(r.arrival_time == 0.0 and r.sampling.ignore_eos for r in w.requests)
  assert w.ignore_eos is True and w.max_model_len == 16
  # Without precompile, the warm-up subset: one request per prefill bucket (one here),
  # then the next ones up to the largest batch (2), each capped at warmup_tokens.
  warm = evaluation._warmup_requests(
      dataclasses.replace(cfg, warmup_tokens=2, precompile=False), w)
  assert [r.request_id for r in warm] == ["random/0", "random/1"]
  assert all(r.sampling.max_tokens == 2 for r in warm)


def test_precompiled_warm_up_runs_a_batch_of_the_shortest_prompts():
  cfg = EvalConfig(target="random:tiny", dataset="random", input_len=9, num_prompts=3,
                   max_new_tokens=4, page_size=8, batch_sizes=(1, 2), warmup_tokens=2)
  w = evaluation._build_requests(cfg, None, None, vocab_size=50, context=64)
  lengths = [30, 5, 12, 5]
  w = dataclasses.replace(w, requests=[
      dataclasses.replace(r, request_id=f"r{i}", prompt_token_ids=tuple(range(n)))
      for i, (r, n) in enumerate(zip(w.requests * 2, lengths))])
  warm = evaluation._warmup_requests(cfg, w)
  assert [r.request_id for r in warm] == ["r1", "r3"]  # the two 5-token prompts
  assert all(r.sampling.max_tokens == 2 for r in warm)
  many = evaluation._warmup_requests(dataclasses.replace(cfg, batch_sizes=(3,)), w)
  assert [r.request_id for r in many] == ["r1", "r2", "r3"]


def _step(rows, emitted, k):
  drafted = np.full(k, rows, np.int32)
  return StepRecord(num_rows=rows, batch_bucket=rows, query_bucket=k + 1, pages_bucket=1,
                    num_draft_tokens=rows * k, num_accepted=emitted - rows,
                    num_emitted=emitted, accepted_per_position=drafted * 0,
                    drafted_per_position=drafted, draft_s=0.0, verify_s=0.01,
                    rejection_s=0.0, host_s=0.0, step_s=0.01, compiled=False)


def _out(rid, tokens):
  return RequestOutput(request_id=rid, prompt_token_ids=[5, 6], output_token_ids=tokens,
                       text=None, finish_reason="length", ttft_s=0.01, tpot_s=0.01,
                       latency_s=0.05, queue_s=0.0, num_steps=len(tokens),
                       num_draft_tokens=0, num_accepted_tokens=0, num_preemptions=0)


def test_rows_phase_from_recorded_pass_results(monkeypatch):
  cfg = EvalConfig(methods=("ar", "ngram"), num_speculative_tokens=2)
  methods = {n: build_method(n, 2, {}) for n in cfg.methods}
  prompts = load_prompts("mt_bench", 2, None, 0)
  # AR: 8 tokens in 8 row-steps; ngram: the same 8 tokens of request 0, request 1 parts
  # from AR at output position 2, 8 tokens in 4 row-steps (tau 2).
  ar = ([_out(prompts[0].id, [1, 2, 3, 4]), _out(prompts[1].id, [7, 8, 9, 10])],
        RunMetrics(steps=[_step(2, 2, 2)] * 4, wall_s=1.0))
  sd = ([_out(prompts[0].id, [1, 2, 3, 4]), _out(prompts[1].id, [7, 8, 0, 0])],
        RunMetrics(steps=[_step(2, 4, 2)] * 2, wall_s=1.0))
  seen = []

  def fake_divergence(model, prompt, reference, other):
    seen.append(model)
    pos = evaluation.first_divergence(reference, other)
    return None if pos is None else Divergence(position=pos, reference_token=reference[pos],
                                               other_token=other[pos], top1_token=9,
                                               top2_token=0, margin=0.25)

  monkeypatch.setattr(evaluation, "divergence", fake_divergence)
  rows, records = evaluation._pass_rows(
      cfg, methods, {"ar": ar, "ngram": sd}, prompts, {"model": "m"}, batch=2, rep=1,
      needs_draft=(), kv_bytes={"ar": 10, "ngram": 12}, check_lossless=True,
      target_split="target")
  assert [r["method"] for r in rows] == ["ar", "ngram"]
  assert all(r["model"] == "m" and r["batch_size"] == 2 and r["repeat"] == 1
             and r["draft"] is None for r in rows)
  assert [r["kv_bytes_per_token"] for r in rows] == [10, 12]
  assert [r["tau"] for r in rows] == [1.0, 2.0]
  assert rows[0]["lossless"] is None and rows[0]["num_mismatched"] is None
  assert rows[1]["lossless"] is False and rows[1]["num_mismatched"] == 1
  assert rows[1]["max_divergence_margin"] == 0.25
  assert rows[1]["first_divergence"] == f'{{"{prompts[1].id}": 2}}'
  assert seen == ["target"] * 2  # SD outputs only, against AR's
  assert len(records) == 4
  by = {(r["method"], r["request_id"]): r for r in records}
  assert by["ngram", prompts[1].id]["first_divergence"] == 2
  assert by["ngram", prompts[0].id]["first_divergence"] is None
  assert by["ar", prompts[1].id]["category"] == prompts[1].category
  # Sampling (or replayed acceptance): no comparison, no margins computed.
  rows, _ = evaluation._pass_rows(
      cfg, methods, {"ar": ar, "ngram": sd}, prompts, {}, batch=2, rep=0, needs_draft=(),
      kv_bytes={"ar": 10, "ngram": 12}, check_lossless=False, target_split=None)
  assert rows[1]["lossless"] is None and len(seen) == 2
