"""Suffix decoding through the engine (G1, G2, G4, G5) and its global cache.

Every workload runs twice on one engine: the second pass finds the first pass's
responses in the global tree, so it drafts (and accepts) far more, which exercises long
accepted runs; both passes must equal the uncached greedy reference. With
``max_spec_offset`` large enough every matched step drafts k tokens of a cached
response, so stops, EOS and length limits land inside accepted runs.
"""

import numpy as np
import pytest
from e2e_lib import (
    DIST_TEMPERATURE,
    DIST_TOP_K,
    ENGINE_CONFIG,
    MAX_MODEL_LEN,
    K,
    assert_target_law,
    check_counters,
    decode,
    full_logits,
    law_requests,
    make_requests,
    top_k_joint,
)

from methods.registry import make_method
from methods.suffix import SuffixDecoding
from specjax.config import SamplingParams
from specjax.request import Request

WORKLOADS = {"batch1": (1, 1), "batch3": (2, 3), "batch8": (3, 8), "queue12": (4, 12)}
# Modes: path drafts on the device (fused) and on the host, tree drafts (host).
_MODES = {"device": (False, True), "path": (False, False), "tree": (True, False)}
# Others slow (compiles dominate); the device path's CI cases are the fused-vs-host
# comparison (batch3) and the stops below.
_CI = {("path", "queue12"), ("tree", "batch1")}
_CASES = [pytest.param(*_MODES[mode], w, id=f"{mode}-{w}",
                       marks=() if (mode, w) in _CI else pytest.mark.slow)
          for mode in _MODES for w in WORKLOADS]


def _totals(metrics):
  return (sum(s.num_draft_tokens for s in metrics.steps),
          sum(s.num_accepted for s in metrics.steps))


@pytest.mark.parametrize("tree, device, workload", _CASES)
def test_greedy_suffix_equals_ar_twice(make_engine, reference, tree, device, workload):
  requests = make_requests(*WORKLOADS[workload])
  engine = make_engine(SuffixDecoding(k=K, tree=tree, device=device))
  assert engine.fused == device
  expected = reference(requests)
  totals = []
  for _ in range(2):
    outputs, metrics = engine.generate(requests)
    assert [o.output_token_ids for o in outputs] == expected
    assert all(o.finish_reason == "length" for o in outputs)
    check_counters(metrics, outputs, K, tree=tree)
    totals.append(_totals(metrics))
  # The second pass drafts from the first pass's responses (global tree).
  (d1, a1), (d2, a2) = totals
  assert d2 > d1 and a2 > a1 > -1
  if len(requests) > 1:
    assert a2 >= sum(len(e) for e in expected) // 4


def test_global_cache_options(make_engine, reference):
  """max_cached_requests=0: the second pass drafts exactly what the first did (local
  trees only). max_cached_requests=1: only the newest response stays cached (FIFO)."""
  requests = make_requests(3, 8)
  expected = reference(requests)
  off = SuffixDecoding(k=K, max_cached_requests=0, device=False)
  engine = make_engine(off)
  passes = [engine.generate(requests) for _ in range(2)]
  for outputs, _ in passes:
    assert [o.output_token_ids for o in outputs] == expected
  assert _totals(passes[0][1]) == _totals(passes[1][1])
  assert engine.runtime.method_cache[off].tree.count([]) == 0

  one = SuffixDecoding(k=K, max_cached_requests=1, device=False)
  engine = make_engine(one)
  outputs, _ = engine.generate(requests)
  assert [o.output_token_ids for o in outputs] == expected
  cache = engine.runtime.method_cache[one]
  assert len(cache.order) == 1 and cache.tree.num_sequences == 1
  # All 8 rows start in the first step, in request order: the last one is kept.
  assert cache.tree.count([]) == len(outputs[-1].output_token_ids)
  unlimited = make_engine(SuffixDecoding(k=K, device=False))
  unlimited.generate(requests)
  assert unlimited.runtime.method_cache[unlimited.method].tree.num_sequences == len(requests)


def _request_counters(outputs):
  return [(o.num_steps, o.num_draft_tokens, o.num_accepted_tokens) for o in outputs]


# Not queue12 with one cached response: the host evicts at each new request's first
# sight, row by row inside a step, the device once per step (a documented difference
# that only a FIFO smaller than the running requests can show).
_FUSED_CASES = [pytest.param(w, c, id=f"{w}-{c}", marks=() if (w, c) == ("batch3", 0)
                             else pytest.mark.slow)
                for w in ("batch1", "batch3", "queue12") for c in (0, 1, 2)
                if (w, c) != ("queue12", 1)]


@pytest.mark.parametrize("workload, cached", _FUSED_CASES)
def test_fused_suffix_equals_host_suffix(make_engine, reference, workload, cached):
  """The device drafter (the default) against the host trees: the same outputs and
  per-request counters over two passes on one engine (the second drafts from the
  first's responses, in the device archive), for an unlimited, a one-response
  (``max_cached_requests=1``) and no global cache. Synchronous, one iteration per call,
  so requests join at the same steps (async scheduling lets a queued request join a step
  later, and the global cache then holds other tokens when it drafts)."""
  requests = make_requests(*WORKLOADS[workload])
  expected = reference(requests)
  limit = (-1, 1, 0)[cached]
  sync = ENGINE_CONFIG.replace(steps_per_dispatch=1, async_scheduling=False)
  host = make_engine(SuffixDecoding(k=K, max_cached_requests=limit, device=False), sync)
  # An archive that holds both passes' responses (the default, 8 x max_model_len = 256
  # tokens here, would wrap in the second pass of queue12 and then draft otherwise).
  fused = make_engine(SuffixDecoding(k=K, max_cached_requests=limit, device=True,
                                     device_cache_tokens=4096), sync)
  assert fused.fused and not host.fused
  drafted = 0
  for _ in range(2):
    h_out, _ = host.generate(requests)
    f_out, f_met = fused.generate(requests)
    assert [o.output_token_ids for o in f_out] == expected
    assert [o.output_token_ids for o in h_out] == expected
    assert _request_counters(f_out) == _request_counters(h_out)
    check_counters(f_met, f_out, K)
    drafted += sum(o.num_accepted_tokens for o in f_out)
  if limit == -1:  # the second pass finds the first's responses
    assert drafted > 0
  if workload == "batch3":  # the default (async, several iterations per call) too
    out, met = make_engine(SuffixDecoding(k=K, max_cached_requests=limit, device=True)
                           ).generate(requests)
    assert [o.output_token_ids for o in out] == expected
    check_counters(met, out, K)


# ---------------------------------------------------------------- stops (G4)
PROMPT = (5, 17, 33, 2, 40, 9)


def _firsts(cont, upto=12):
  return [s for s in range(1, upto) if cont[s] not in cont[:s]]


# The device drafter's stops are slow (its own compiles, ~50 s on a 2-core CPU); its CI
# cases are the fused-vs-host comparison above, and the device commit's stop rules run in
# CI in test_device_loop (stops inside accepted fused n-gram runs).
@pytest.mark.parametrize("device", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["host", "device"])
def test_stops_inside_accepted_runs(make_engine, reference, device):
  warm = Request("warm", PROMPT, SamplingParams(max_tokens=26, ignore_eos=True))
  cont = reference([warm])[0]
  firsts = _firsts(cont)
  assert len(firsts) >= 3, f"test model gives no usable stop positions in {cont}"
  eos_at = firsts[-1]
  text = decode(cont)
  stops = [Request(f"stop_id@{s}", PROMPT, SamplingParams(max_tokens=26,
                                                          stop_token_ids=(cont[s],)))
           for s in firsts[:2]]
  for s in range(2, 10):
    stop = decode(cont[s - 1: s + 1])
    if text.find(stop) == s - 1:
      stops.append(Request(f"stop_str@{s}", PROMPT, SamplingParams(max_tokens=26, stop=(stop,))))
      break
  batches = [
      stops + [Request(f"max_tokens={m}", PROMPT, SamplingParams(max_tokens=m)) for m in (3, 7)],
      [Request("eos", PROMPT, SamplingParams(max_tokens=26)),
       Request("ignore_eos", PROMPT, SamplingParams(max_tokens=26, ignore_eos=True)),
       Request("max_model_len", tuple(range(3, 23)), SamplingParams(max_tokens=40))],
  ]
  method = SuffixDecoding(k=K, max_spec_offset=float(K), device=device)
  sd = make_engine(method, eos_token_ids=(cont[eos_at],))
  ar = make_engine(make_method("ar"), eos_token_ids=(cont[eos_at],))
  sd.generate([warm])  # caches the continuation (ignore_eos) in the global tree
  for batch in batches:
    sd_out, metrics = sd.generate(batch)
    ar_out, _ = ar.generate(batch)
    for r, s, a in zip(batch, sd_out, ar_out):
      assert s.output_token_ids == a.output_token_ids, r.request_id
      assert s.finish_reason == a.finish_reason, r.request_id
      assert s.text == a.text, r.request_id
    check_counters(metrics, sd_out, K)
    by_id = {o.request_id: o for o in sd_out}
    for rid, o in by_id.items():
      kind, _, arg = rid.partition("@")
      if kind == "stop_id":
        assert o.output_token_ids == cont[: int(arg) + 1] and o.finish_reason == "stop"
      if rid != "max_model_len" and len(o.output_token_ids) > 3:
        # Most tokens came from accepted drafts: the stop ended an accepted run. (Not for
        # 3 tokens: after one output token the cached continuation's first token
        # repeats, a count tie that the latest occurrence breaks the other way.)
        assert o.num_accepted_tokens >= len(o.output_token_ids) // 2, rid
    if "eos" in by_id:
      assert by_id["eos"].output_token_ids == cont[: eos_at + 1]
      assert by_id["eos"].finish_reason == "stop"
      assert len(by_id["max_model_len"].output_token_ids) == MAX_MODEL_LEN - 20


# ---------------------------------------------------------------- G2
NUM_SAMPLES = 768


def _repeat_prompt(target):
  """``(7, 21, t, 7, 21)``: its local tree drafts t after "7 21"; t is the token the
  target finds most likely there, so the draft is sometimes accepted."""
  prompts = [(7, 21, t, 7, 21) for t in range(len(full_logits(target, [[7]])[0]))]
  p = [top_k_joint(target, q, DIST_TEMPERATURE, DIST_TOP_K, 1).get((t,), 0.0)
       for t, q in enumerate(prompts)]
  return prompts[int(np.argmax(p))]


@pytest.mark.slow  # ~30 s on a 2-core CPU
@pytest.mark.parametrize("device", [False, True], ids=["host", "device"])
def test_two_token_distribution_matches_target(make_engine, target, device):
  """Sampled suffix SD (one-hot q) keeps the target's joint law of the first two tokens
  (temperature + top-k), computed exactly from the uncached forward."""
  prompt = _repeat_prompt(target)
  outputs, metrics = make_engine(SuffixDecoding(k=K, max_cached_requests=0, device=device)
                                 ).generate(law_requests(NUM_SAMPLES, 2, prompt))
  check_counters(metrics, outputs, K)
  drafted, accepted = _totals(metrics)
  assert 0 < accepted < drafted  # both acceptance and rejection ran
  assert_target_law(target, outputs, 2, prompt)


@pytest.mark.slow  # sampler compiles at several batch buckets
@pytest.mark.parametrize("device", [False, True], ids=["host", "device"])
def test_seeded_request_ignores_partners_without_global_cache(make_engine, device):
  """G3 with local trees only: a row's drafts depend on its own tokens alone. (With the
  global tree a partner's response can change a seeded row's draft and hence its exact
  sample, as in vLLM/Arctic; the law stays the target's.)"""
  seeded = Request("seeded", (7, 21, 3, 7, 21, 3, 7, 21),
                   SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12))
  engine = make_engine(SuffixDecoding(k=K, max_cached_requests=0, device=device))
  alone = engine.generate([seeded])[0][0].output_token_ids
  partners = make_requests(9, 5, prefix="p", temperature=0.8, seed=3)
  for batch in ([*partners[:2], seeded], [seeded, *partners]):
    outputs, metrics = engine.generate(batch)
    assert {o.request_id: o for o in outputs}["seeded"].output_token_ids == alone
    check_counters(metrics, outputs, K)
