"""verify_skip (``methods.verify_skip``): the stale cap by hand, greedy == AR under cheap
and expensive verify widths, expensive width verifies shorter drafts, acceptance 1 with
cheap width keeps k, and the sampled output follows the target distribution while
drafts are truncated.
"""

import numpy as np
import pytest
from e2e_lib import (
    DIST_PROMPT,
    K,
    TableDrafter,
    assert_target_law,
    check_counters,
    full_logits,
    law_requests,
    make_requests,
    scripted_drafter,
)

from methods.registry import make_method
from methods.verify_skip import VerifySkip, VerifySkipState, choose_cap, length_buckets
from specjax.cost_model import LinearVerifyCost, TableVerifyCost, preset


def cheap(batch, length):  # width nearly free
  return 1.0 + 1e-6 * batch * length


def expensive(batch, length):  # each verified token costs a whole step
  return 1.0 + 1.0 * batch * length


def _run(engine, requests):
  """``(outputs, metrics, method state)`` of one run."""
  states = []
  real = VerifySkip.init_state

  def init_state(self, runtime):
    states.append(real(self, runtime))
    return states[-1]

  VerifySkip.init_state = init_state
  try:
    outputs, metrics = engine.generate(requests)
  finally:
    VerifySkip.init_state = real
  return outputs, metrics, states[-1]


def test_stale_cap_by_hand():
  assert length_buckets(4) == [1, 2, 4] and length_buckets(6) == [1, 2, 4, 6]
  cap, theta, lam = choose_cap(np.array([0.9, 0.45]), np.array([2]), lambda b, n: 1.0 + n,
                               [1, 2])
  assert (cap, theta, lam) == (1, pytest.approx(0.95), pytest.approx(0.95))
  # Width cheap: the longest cap wins; E(2) = 2 * (1 + 0.9 + 0.45) over 2 rows.
  cap, theta, lam = choose_cap(np.array([0.9, 0.45]), np.array([2, 2]), cheap, [1, 2])
  assert cap == 2 and theta == pytest.approx(4.7 / cheap(2, 2)) and lam < 1e-5
  table = TableVerifyCost(batches=(1, 64), lengths=(1, 4), seconds=((1.0, 2.0), (3.0, 10.0)))
  assert table(1, 1) == 1.0 and table(32, 2) == pytest.approx(2.0 + 8.0 * 31 / 63)
  assert table(128, 4) == 10.0
  with pytest.raises(ValueError, match="length=8"):
    table(1, 8)
  assert LinearVerifyCost(fixed_s=1, per_row_s=0.5, per_token_s=0.25)(2, 3) == 1 + 1 + 2
  # min_tokens=0 adds cap 0; here verifying costs more than it brings, so 0 wins with an
  # infinite threshold (was a ZeroDivisionError): T(1, L) = 1 + 5 (L + 1), so
  # E(0) / T = 1 / 6 beats E(1) / T = 1.8 / 11 and E(2) / T = 2.44 / 16.
  cap, theta, lam = choose_cap(np.array([0.8, 0.64]), np.array([2]),
                               LinearVerifyCost(fixed_s=1.0, per_row_s=0.0, per_token_s=5.0),
                               [0, 1, 2])
  assert (cap, theta, lam) == (0, pytest.approx(1 / 6), float("inf"))


def test_bad_options_are_refused():
  with pytest.raises(ValueError, match="prior_mean"):
    VerifySkip(prior_mean=1.0)
  with pytest.raises(ValueError, match="confidence_bins"):
    VerifySkip(confidence_bins=(0.8, 0.5))
  with pytest.raises(ValueError, match="drafter="):
    VerifySkip(drafter="ar")
  with pytest.raises(ValueError, match="cost_model"):
    VerifySkip(cost_model=3)
  with pytest.raises(ValueError, match="must be a preset"):
    VerifySkip(cost_model="no-such-model")
  with pytest.raises(ValueError, match=r"lengths=\(1, 2\) must reach k=4"):
    make_method("verify_skip", 4, cost_model=TableVerifyCost(batches=(1,), lengths=(1, 2),
                                                             seconds=((1.0, 2.0),)))
  with pytest.raises(ValueError, match=r"must all be finite and > 0"):
    TableVerifyCost(batches=(1,), lengths=(1,), seconds=((float("nan"),),))
  with pytest.raises(ValueError, match=r"^batches=\(0,\) must be integers >= 1"):
    TableVerifyCost(batches=(0,), lengths=(1,), seconds=((1.0,),))
  with pytest.raises(ValueError, match=r"^lengths=\(1, 4.5\) must be integers >= 0"):
    TableVerifyCost(batches=(1,), lengths=(1, 4.5), seconds=((1.0, 2.0),))
  # Lists and numpy arrays are stored as tuples: the method stays hashable (static jit).
  listed = TableVerifyCost(batches=[1], lengths=np.array([1, 2]), seconds=np.ones((1, 2)))
  assert listed.lengths == (1, 2) and hash(make_method("verify_skip", 2, cost_model=listed))
  # A callable's times are checked when the rule prices a cap (was a ZeroDivisionError
  # at 0, and a negative or NaN time was taken).
  for bad in (0.0, -1.0, float("nan"), None, np.array([1.0, 2.0])):
    vs = make_method("verify_skip", 2, cost_model=lambda b, n, bad=bad: bad)
    state = VerifySkipState(None, np.zeros(2), np.zeros(2), np.zeros((2, 4)),
                            np.zeros((2, 4)), {}, {})
    with pytest.raises(ValueError, match=r"gave T\(1, 1\)=.* must be finite and > 0"):
      vs._stale_stage(state, np.array([2]))
  # A preset (specjax.cost_model) by name: its T(B, L) is the model's verify_time.
  seed = make_method("verify_skip", 4, cost_model="seed-llama8b-h100")
  assert seed.cost_model is preset("seed-llama8b-h100")
  assert seed.describe()["cost_model"] == "seed-llama8b-h100"
  assert seed.cost_model(2, 1) == pytest.approx(5.88590713e-3 + 4 * 2.10103129e-5 + 1.20683946e-3)
  assert make_method("verify_skip", 3, drafter="draft_model").describe()["drafter"] == \
      "draft_model"


@pytest.mark.parametrize("cost", [pytest.param(cheap, marks=pytest.mark.slow), expensive],
                         ids=["cheap", "expensive"])  # cheap: slow (+compiles of L = 2, 4)
def test_greedy_equals_ar(make_engine, reference, cost):
  requests = make_requests(4, 12)
  method = VerifySkip(k=K, drafter=scripted_drafter(requests, reference, 2), cost_model=cost)
  outputs, metrics, state = _run(make_engine(method), requests)
  assert [o.output_token_ids for o in outputs] == reference(requests)
  check_counters(metrics, outputs, K)
  c = state.counters
  assert c["verified"] == sum(s.num_draft_tokens for s in metrics.steps) <= c["drafted"]
  if cost is expensive:  # the cap and the marginal price keep one draft per row
    assert set(c["caps"]) == {1} and max(s.query_bucket for s in metrics.steps) == 2
    assert c["verified"] < c["drafted"]
  else:
    assert max(c["caps"]) == K


def test_full_acceptance_and_cheap_width_keep_k(make_engine, reference):
  requests = make_requests(3, 8)
  method = VerifySkip(k=K, drafter=scripted_drafter(requests, reference), cost_model=cheap)
  outputs, metrics, state = _run(make_engine(method), requests)
  assert [o.output_token_ids for o in outputs] == reference(requests)
  c = state.counters
  # Every draft verified whole; the cap is k unless every row's budget is smaller
  # (equal expected tokens: the shorter cap wins the tie).
  assert c["verified"] == c["drafted"] and max(c["caps"]) == K
  assert max(s.query_bucket for s in metrics.steps) == K + 1
  assert np.all(state.accept == state.reach) and state.reach[0] > 0  # learned: always right


def test_expensive_width_verifies_shorter(make_engine, reference):
  """Same always-right drafter: when width is expensive the rule verifies 1 draft."""
  requests = make_requests(3, 8)
  method = VerifySkip(k=K, drafter=scripted_drafter(requests, reference),
                      cost_model=expensive)
  outputs, metrics, state = _run(make_engine(method), requests)
  assert [o.output_token_ids for o in outputs] == reference(requests)
  c = state.counters
  assert c["verified"] < c["drafted"] and set(c["caps"]) == {1}
  assert max(s.query_bucket for s in metrics.steps) == 2


NUM_SAMPLES = 512


def middling(batch, length):
  """Verify width priced so that the stale cap is 1 at 8 rows and 2 at fewer."""
  return 1.0 + (0.02 if batch < 8 else 0.6) * batch * length


@pytest.mark.slow  # 40 s alone on the 2-core CPU (CI budget)
def test_three_token_distribution_with_truncation(make_engine, target):
  g1 = int(np.argmax(full_logits(target, [list(DIST_PROMPT)])[0]))
  g2 = int(np.argmax(full_logits(target, [[*DIST_PROMPT, g1]])[0]))
  drafter = TableDrafter(table=((DIST_PROMPT, (g1, g2)),))  # deterministic: q one-hot
  method = VerifySkip(k=K, drafter=drafter, cost_model=middling)
  outputs, metrics, state = _run(make_engine(method), law_requests(NUM_SAMPLES, 3))
  check_counters(metrics, outputs, K)
  c = state.counters
  assert 0 < c["verified"] < c["drafted"] and 1 in c["caps"]  # truncation was active
  accepted = sum(s.num_accepted for s in metrics.steps)
  assert 0 < accepted < c["verified"]
  assert_target_law(target, outputs, 3)
