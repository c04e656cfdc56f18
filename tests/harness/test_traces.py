"""Acceptance traces against real engine runs on a tiny model, and the trace format.

The engine runs use the e2e tests' tiny target (V=48, 2 layers) and its perturbed draft
(same graph), so compiled steps are shared between the two models.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from harness import simulator, traces
from harness.synthetic import ConstantDrafter
from methods.draft_model import DraftModel
from methods.ngram import NGram
from specjax.config import EngineConfig, SamplingParams
from specjax.cost_model import preset
from specjax.engine import Engine
from specjax.request import Request
from specjax.sampling import request_key
from tests.e2e.e2e_lib import VOCAB, build_model, model_config

K = 4
K_MAX = 16
# One row per step (batch bucket 1): few step shapes to compile on a 2-core CPU.
CONFIG = EngineConfig(max_num_seqs=1, max_model_len=64, page_size=8, min_prefill_bucket=16)


@pytest.fixture(scope="module")
def models():
  return build_model(model_config(), seed=0), build_model(model_config(), seed=0, perturb=0.15)


def _requests(seed, n, **sampling):
  rng = np.random.default_rng(seed)
  out = []
  for i in range(n):
    # Short repeated motifs, so prompt lookup finds matches.
    motif = rng.integers(0, VOCAB, size=3)
    prompt = tuple(int(t) for t in np.concatenate([motif, rng.integers(0, VOCAB, 2), motif]))
    out.append(Request(f"q{i}", prompt, SamplingParams(max_tokens=int(rng.integers(14, 22)),
                                                       **sampling)))
  return out


def _recording(cls):
  @dataclasses.dataclass(frozen=True, kw_only=True)
  class Recording(cls):
    """Logs (request, start position, tokens committed) of every engine step."""

    log: list = dataclasses.field(default_factory=list, hash=False, compare=False)
    pending: dict = dataclasses.field(default_factory=dict, hash=False, compare=False)

    def propose(self, state, context):
      for rid, t in zip(context.request_ids, context.token_ids):
        self.pending[rid] = len(t)
      return super().propose(state, context)

    def observe(self, state, result):
      for rid, emitted in zip(result.request_ids, result.emitted):
        self.log.append((rid, self.pending.pop(rid), len(emitted)))
      return super().observe(state, result)

  return Recording


# The draft-model case compiles ~10 draft shapes (52 s on a 2-core CPU): kept out of CI.
@pytest.mark.parametrize("cls", [pytest.param(NGram, id="ngram"),
                                 pytest.param(DraftModel, id="draft_model",
                                              marks=pytest.mark.slow)])
def test_trace_matches_engine_commits(models, cls, tmp_path):
  target, draft = models
  requests = _requests(1, 3)
  recs = traces.build_traces(target, draft, requests, {cls.name: cls(k=K_MAX)}, CONFIG,
                             k_max=K_MAX)
  # The recording hooks the host-called propose / observe (not the fused device path).
  method = _recording(cls)(k=K, **({"device": False} if cls is NGram else {"fused": False}))
  outs, met = Engine(target, method, CONFIG, draft=draft).generate(requests)
  by_id = {r.request_id: r for r in recs}
  # The traced greedy output is the SD engine's output (greedy SD is lossless).
  for o in outs:
    assert by_id[o.request_id].generated_token_ids == o.output_token_ids
  assert len(method.log) == sum(s.num_rows for s in met.steps)
  long_commits = 0
  for rid, length, committed in method.log:
    rec = by_id[rid]
    i = length - len(rec.prompt_token_ids)  # output tokens committed before the step
    assert committed == min(int(rec.methods[cls.name].acc_len[i]), K + 1), (rid, i)
    long_commits += committed > 1
  assert long_commits >= 3  # the drafts are right often enough to test something
  # The simulator's fixed-k walk over the trace gives the engine's tau exactly.
  emitted = sum(s.num_emitted for s in met.steps)
  rows = sum(s.num_rows for s in met.steps)
  cost = dataclasses.replace(preset("seed-llama8b-h100"), prefill_emits_token=False,
                             drafts={cls.name: preset("seed-llama8b-h100").draft("ngram")})
  for batch in (1, 4):
    r = simulator.simulate(recs, cost, simulator.Policy(kind="fixed", methods=(cls.name,), k=K),
                           batch)
    assert r["tau"] == emitted / rows
  # Signals and the JSONL round trip.
  extras = recs[0].methods[cls.name].extras
  assert set(extras) == ({"draft_len", "margin", "entropy"} if cls is DraftModel
                         else {"draft_len"})
  if cls is DraftModel:
    assert np.all(extras["entropy"] >= 0) and np.all(extras["margin"] >= 0)
    assert np.all(extras["draft_len"] == K_MAX)
  path = tmp_path / "t.jsonl"
  traces.write_jsonl(str(path), recs)
  back = traces.read_jsonl(str(path))
  for a, b in zip(recs, back):
    assert a.generated_token_ids == b.generated_token_ids
    assert a.prompt_token_ids == b.prompt_token_ids
    np.testing.assert_array_equal(a.methods[cls.name].acc_len, b.methods[cls.name].acc_len)
    for key, value in a.methods[cls.name].extras.items():
      np.testing.assert_allclose(value, b.methods[cls.name].extras[key])
    np.testing.assert_array_equal(a.signals["match_len"], b.signals["match_len"])
  line = json.loads(path.read_text().splitlines()[0])
  assert set(line[f"acc_{cls.name}"]) >= {"acc_len", "draft_len"}


def _synthetic_run_lengths(seed, start, rate, k_max):
  """Leading run of ``uniform(fold_in(fold_in(key, start + j), 3)) < rate``, j < k_max: the
  engine's synthetic acceptance draw (``specjax.steps._synthetic_accepted``)."""
  key = request_key(seed)
  u = jnp.stack([jax.random.uniform(jax.random.fold_in(jax.random.fold_in(key, start + j), 3),
                                    (), jnp.float32) for j in range(k_max)])
  ok = np.asarray(u < jnp.float32(rate))
  return int(np.cumprod(ok).sum())


def test_fixed_k_tau_equals_engine_with_synthetic_acceptance(models):
  """CPU engine with synthetic acceptance 0.6 per draft vs the simulator's fixed k."""
  target, _ = models
  rate = 0.6
  requests = [dataclasses.replace(r, sampling=dataclasses.replace(r.sampling, seed=100 + i))
              for i, r in enumerate(_requests(2, 3))]
  cfg = dataclasses.replace(CONFIG, synthetic_acceptance=(rate,))
  outs, met = Engine(target, ConstantDrafter(k=K), cfg).generate(requests)
  recs = []
  for r, o in zip(requests, outs):
    p, n = len(r.prompt_token_ids), len(o.output_token_ids)
    # Step at output position i: drafts sit at positions p + i + j.
    acc = [min(1 + _synthetic_run_lengths(r.sampling.seed, p + i, rate, K_MAX), n - i)
           for i in range(n)]
    recs.append(traces.TraceRecord(r.request_id, list(r.prompt_token_ids),
                                   list(o.output_token_ids),
                                   {"synthetic": traces.MethodTrace(np.asarray(acc), {})}))
  emitted = sum(s.num_emitted for s in met.steps)
  rows = sum(s.num_rows for s in met.steps)
  assert 1.3 < emitted / rows < K + 1  # some but not all drafts accepted
  cost = dataclasses.replace(preset("seed-llama8b-h100"), prefill_emits_token=False,
                             drafts={"synthetic": preset("seed-llama8b-h100").draft("ngram")})
  for batch in (1, 2, 4):
    r = simulator.simulate(recs, cost, simulator.Policy(kind="fixed", methods=("synthetic",),
                                                        k=K), batch)
    assert r["tau"] == emitted / rows
  r = simulator.simulate(recs, cost, simulator.Policy(kind="fixed", methods=("synthetic",), k=K),
                         CONFIG.max_num_seqs)
  assert r["sd_steps"] == len(met.steps)  # the engine's steps, one request at a time


def test_seed_format_and_errors(tmp_path):
  line = {"id": "134", "prompt_token_ids": [1, 2], "generated_token_ids": [5, 6, 7],
          "acc_eagle": {"acc_len": [1, 3, 1]}, "acc_ngram": {"acc_len": [2, 1, 1]}}
  path = tmp_path / "seed.jsonl"
  path.write_text(json.dumps(line) + "\n")
  (rec,) = traces.read_jsonl(str(path))
  assert sorted(rec.methods) == ["eagle", "ngram"]
  assert rec.methods["eagle"].acc_len.tolist() == [1, 3, 1]
  # A method's acc_len length is its output length (the seed's EAGLE-3 runs differ).
  short = traces.TraceRecord.from_json({**line, "acc_eagle": {"acc_len": [1, 1]}})
  assert short.methods["eagle"].acc_len.tolist() == [1, 1]
  with pytest.raises(ValueError, match="acc_len is empty but the request has 3 generated"):
    traces.TraceRecord.from_json({**line, "acc_eagle": {"acc_len": []}})
  with pytest.raises(ValueError, match="must be a list of ints"):
    traces.TraceRecord.from_json({**line, "acc_eagle": {"acc_len": [[1], [1]]}})
  with pytest.raises(ValueError, match="has value 0 at position 1"):
    traces.TraceRecord.from_json({**line, "acc_eagle": {"acc_len": [1, 0, 1]}})
  with pytest.raises(ValueError, match="no acc_<method> entry"):
    traces.TraceRecord.from_json({k: v for k, v in line.items() if not k.startswith("acc")})
  # match_len: [5, 6, 7] + [5, 6] -> contexts [5,6,7] (0), [5,6,7,5] (1), [5,6,7,5,6] (2).
  assert traces.match_lengths([5, 6, 7], [5, 6, 9]).tolist() == [0, 1, 2]
