"""G1: greedy speculative decoding emits exactly the greedy autoregressive tokens.

Every method (ar, ngram, draft_model, a scripted drafter, verify_skip) runs batches of 1 to 8
requests (and a queue longer than ``max_num_seqs``) with mixed prompt lengths and
``max_tokens``, so rows join and finish at different steps; the outputs must equal the
uncached greedy reference token for token. A small page pool with long requests forces
preemption by recompute, which must not change outputs either. After every run the
engine itself asserts that all KV pages went back to the allocator.
"""

import numpy as np
import pytest
from e2e_lib import ENGINE_CONFIG, K, check_counters, make_requests, scripted_drafter

from methods.registry import make_method

WORKLOADS = {
    "batch1": dict(seed=1, n=1),
    "batch3": dict(seed=2, n=3),
    "batch8": dict(seed=3, n=8),
    "queue12": dict(seed=4, n=12),  # more requests than max_num_seqs: admitted as seats free up
}
# Long requests: 8 of them need up to 32 pages, the pool has 16.
PREEMPT_WORKLOAD = dict(seed=5, n=8, prompt_len=(6, 20), max_tokens=(8, 26))

# verify_skip: over the device n-gram, in the fused loop (``methods.verify_skip``).
METHODS = ["ar", "ngram", "draft_model", "scripted_right", "scripted_2", "verify_skip"]


def _method(name, requests, reference):
  if name.startswith("scripted"):
    num_right = None if name == "scripted_right" else int(name.split("_")[1])
    return scripted_drafter(requests, reference, num_right)
  return make_method(name, K)


def _requests(spec):
  spec = dict(spec)
  return make_requests(spec.pop("seed"), spec.pop("n"), **spec)


def test_reference_is_not_degenerate(reference):
  """The tiny target must produce varied text, or the equivalence tests prove little."""
  outs = reference(_requests(WORKLOADS["batch8"]))
  tokens = [t for o in outs for t in o]
  assert len(set(tokens)) >= 10
  changes = sum(a != b for o in outs for a, b in zip(o, o[1:]))
  assert changes >= len(tokens) // 3


@pytest.mark.parametrize("workload", list(WORKLOADS))
@pytest.mark.parametrize("method", METHODS)
def test_greedy_sd_equals_ar(make_engine, reference, method, workload):
  requests = _requests(WORKLOADS[workload])
  engine = make_engine(_method(method, requests, reference))
  outputs, metrics = engine.generate(requests)
  expected = reference(requests)
  assert [o.output_token_ids for o in outputs] == expected
  for o, r, e in zip(outputs, requests, expected):
    assert o.request_id == r.request_id
    assert o.finish_reason == "length"
    assert len(e) == min(r.sampling.max_tokens, ENGINE_CONFIG.max_model_len - len(r.prompt_token_ids))
  assert metrics.num_preemptions == 0
  check_counters(metrics, outputs, engine.k)
  if method in ("draft_model", "scripted_right") and workload != "batch1":
    assert sum(s.num_accepted for s in metrics.steps) > 0


@pytest.mark.parametrize("method", METHODS)
def test_preemption_keeps_outputs(make_engine, reference, method):
  requests = _requests(PREEMPT_WORKLOAD)
  engine = make_engine(_method(method, requests, reference))
  outputs, metrics = engine.generate(requests)
  assert metrics.num_preemptions > 0
  assert sum(o.num_preemptions for o in outputs) == metrics.num_preemptions
  assert [o.output_token_ids for o in outputs] == reference(requests)
  check_counters(metrics, outputs, engine.k)


def test_engine_reuse_after_preemption(make_engine, reference):
  """A preempting run leaves stale KV behind; the next run on the same engine is exact."""
  engine = make_engine("draft_model")
  long_requests = _requests(PREEMPT_WORKLOAD)
  short_requests = _requests(WORKLOADS["batch8"])
  for requests in (long_requests, short_requests, long_requests):
    outputs, _ = engine.generate(requests)
    assert [o.output_token_ids for o in outputs] == reference(requests)


def test_acceptance_is_partial(make_engine):
  """The draft model agrees with the target only partly (both branches are exercised)."""
  requests = _requests(WORKLOADS["batch8"])
  _, metrics = make_engine("draft_model").generate(requests)
  accepted = sum(s.num_accepted for s in metrics.steps)
  drafted = sum(s.num_draft_tokens for s in metrics.steps)
  assert 0.15 < accepted / drafted < 0.9
  per_pos = np.sum([s.accepted_per_position for s in metrics.steps], axis=0)
  assert per_pos[0] > per_pos[-1] and per_pos[1] > 0
