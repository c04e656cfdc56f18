"""A learned head called from the host (``methods.learned``'s host path, its feature
windows in a device slot pool) through the engine: greedy output equals greedy AR,
also when rows are preempted and recomputed (a restart resets the request's window) and
when the head is a member of ``methods.adaptive`` (its windows follow every row, whoever
drafted it).
"""

from e2e_lib import ENGINE_CONFIG, K, check_counters, make_requests

from methods.adaptive import Adaptive
from methods.registry import make_method

# A 6-page pool: the long requests preempt each other (as test_coupled_sampling's).
TIGHT = ENGINE_CONFIG.replace(num_pages=6)


def _requests():
  long = make_requests(8, 3, prompt_len=(6, 10), max_tokens=(14, 18), prefix="l")
  short = make_requests(9, 3, prompt_len=(1, 4), prefix="s")  # one-token prompts included
  return [*long, *short]


def _eagle3(**options):
  # A random EAGLE-3 head over the 2-layer target's low/mid/high states.
  return make_method("eagle3", K, feature_layers=(1, 2, 2), **options)


def test_greedy_host_eagle3_through_preemption_equals_ar(make_engine, reference):
  requests = _requests()
  engine = make_engine(_eagle3(fused=False), config=TIGHT)
  assert not engine.fused
  outputs, metrics = engine.generate(requests)
  assert metrics.num_preemptions > 0
  assert [o.output_token_ids for o in outputs] == reference(requests)
  check_counters(metrics, outputs, K)
  assert sum(s.num_draft_tokens for s in metrics.steps) > 0


def test_greedy_adaptive_eagle3_member_through_preemption_equals_ar(make_engine, reference):
  method = Adaptive(k=K, drafters=(make_method("ngram", K), _eagle3()))
  requests = _requests()
  engine = make_engine(method, config=TIGHT)
  for _ in range(2):  # the second call starts from fresh windows (a new init_state)
    outputs, metrics = engine.generate(requests)
    assert metrics.num_preemptions > 0
    assert [o.output_token_ids for o in outputs] == reference(requests)
    check_counters(metrics, outputs, K)
    assert Adaptive.stats(engine.runtime).chosen["eagle3"] > 0
