"""verify_skip in the fused, asynchronous loop (``methods.verify_skip``, fused path):

- over a fused drafter without draft probabilities it runs fused (and says so), over
  one with probabilities, a host drafter or with ``host_path`` on the host path;
- greedy output == greedy AR at batch 1 and in a mixed batch, with step n+1 dispatched
  before step n is read (the engine's dispatch / read order);
- the caps follow the learned estimates: a drafter right at every position keeps k,
  one wrong after its first draft shrinks it, from the third dispatch on (the first two
  precede any read), down to 1;
- EOS / stop ids / stop strings / max_tokens / max_model_len inside an accepted run end
  the request as AR does;
- precompile covers every verify length the caps can pick (the run compiles nothing);
- a seeded sampled request gives plain decoding's tokens alone and with partners
  (n-gram drafts have no q: the coupled rule);
- bad caps from a method and ``plans_verify`` outside the fused loop are refused;
- (slow) a fused drafter that reads target hidden states (EAGLE-3, coupled) runs fused.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
from e2e_lib import (
  ENGINE_CONFIG,
  MAX_MODEL_LEN,
  VOCAB,
  K,
  check_counters,
  make_requests,
  scripted_device_drafter,
)
from test_device_loop import SEEDED, STOP_EOS, STOP_REQUESTS, spy_order

from harness.synthetic import ConstantDrafter
from methods.draft_model import DraftModel
from methods.ngram import NGram
from methods.registry import make_method
from methods.verify_skip import VerifySkip
from specjax.config import SamplingParams
from specjax.method import Capabilities, Method
from specjax.request import Request


def cheap(batch, length):  # width nearly free: the cap stays k
  return 1.0 + 1e-6 * batch * length


def middling(batch, length):
  """Per-row cost 1 + 0.1 L: with the prior (0.8 per position) L* = k; once position 2
  is learned to fail, L* = 1 (E(1) / T = 2 / 1.1 beats E(2) / T ~ 2 / 1.2)."""
  return batch * (1.0 + 0.1 * length)


def _spy_plans(monkeypatch):
  """Records ``(host budgets, caps, L*)`` of every ``plan_verify``."""
  plans = []
  real = VerifySkip.plan_verify

  def plan(self, state, request_ids, budgets):
    state, vplan = real(self, state, request_ids, budgets)
    plans.append((np.asarray(budgets).copy(), vplan.caps.copy(), vplan.info))
    return state, vplan

  monkeypatch.setattr(VerifySkip, "plan_verify", plan)
  return plans


def test_path_follows_the_drafter():
  fused = make_method("verify_skip", K)  # the device n-gram
  caps = fused.capabilities()
  assert caps.runs_on == "fused" and caps.plans_verify and fused.describe()["runs_on"] == "fused"
  for method in (make_method("verify_skip", K, host_path=True),
                 VerifySkip(k=K, drafter=NGram(k=K, device=False)),
                 VerifySkip(k=K, drafter=DraftModel(k=K))):  # has q: per-row confidences
    caps = method.capabilities()
    assert caps.runs_on != "fused" and not caps.plans_verify, method
    assert method.describe()["runs_on"] == caps.runs_on
  assert VerifySkip(k=K, drafter=ConstantDrafter(k=K)).capabilities().runs_on == "fused"
  with pytest.raises(ValueError, match="host_path"):
    VerifySkip(k=K, drafter=NGram(k=K), host_path=1)


WORKLOADS = {"batch1": dict(seed=1, n=1), "mixed": dict(seed=2, n=5)}


@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_greedy_equals_ar_asynchronously(make_engine, reference, monkeypatch, workload):
  spec = WORKLOADS[workload]
  requests = make_requests(spec["seed"], spec["n"])
  order = spy_order(monkeypatch)
  # Right for 2 drafts: some drafts accepted, some rejected, caps of 2 and 4.
  for drafter, cost in ((NGram(k=K), cheap),
                        (scripted_device_drafter(requests, reference, 2), middling)):
    order.clear()
    engine = make_engine(VerifySkip(k=K, drafter=drafter, cost_model=cost))
    assert engine.fused and engine.runs_ahead
    outputs, metrics = engine.generate(requests)
    assert [o.output_token_ids for o in outputs] == reference(requests)
    check_counters(metrics, outputs, K)
    # D1 D2 R1 D3 R2 .. Dn R(n-1) R(n): never the host path's D R D R.
    seq = "".join(o[0] for o in order)
    assert re.fullmatch(r"D(DR)+R", seq), seq
    c = engine._method_state.counters
    assert c["verified"] == sum(s.num_draft_tokens for s in metrics.steps)
    if drafter.name == "scripted_device":
      assert sum(o.num_accepted_tokens for o in outputs) > 0
      assert sum(o.num_accepted_tokens for o in outputs) < c["verified"]


@pytest.mark.parametrize("num_right", [None, 1], ids=["always_right", "right_once"])
def test_caps_follow_the_estimates(make_engine, reference, monkeypatch, num_right):
  requests = make_requests(3, 3, prompt_len=(2, 5), max_tokens=(16, 20))
  plans = _spy_plans(monkeypatch)
  method = VerifySkip(k=K, drafter=scripted_device_drafter(requests, reference, num_right),
                      cost_model=middling)
  engine = make_engine(method, ENGINE_CONFIG.replace(steps_per_dispatch=1))  # more dispatches
  outputs, metrics = engine.generate(requests)
  assert [o.output_token_ids for o in outputs] == reference(requests)
  check_counters(metrics, outputs, K)
  full = [(caps, cap) for budgets, caps, cap in plans if budgets.max() == K]
  assert len(full) >= 3
  state = engine._method_state
  if num_right is None:  # learned: always right; every dispatch verifies k
    assert all(cap == K and caps.max() == K for caps, cap in full), plans
    assert np.all(state.accept == state.reach) and state.reach[K - 1] > 0
    assert max(s.query_bucket for s in metrics.steps) == K + 1
  else:
    # The first two dispatches precede any read (prior: k); as position 2 keeps failing
    # the stale cap and the admitted length fall to one draft (the prior fades).
    stale = [cap for _, cap in full]
    admitted = [int(caps.max()) for caps, _ in full]
    assert stale[:2] == [K, K] and admitted[:2] == [K, K], plans
    assert stale == sorted(stale, reverse=True) and admitted == sorted(admitted, reverse=True)
    assert all(a <= c for a, c in zip(admitted, stale))
    assert stale[-3:] == admitted[-3:] == [1, 1, 1], plans
    assert state.reach[1] > 0 and state.accept[1] == 0
    assert metrics.steps[-1].query_bucket == 2
    assert sum(s.drafted_per_position[1] for s in metrics.steps[-2:]) == 0


def test_stops_inside_accepted_run_as_ar(make_engine):
  requests = STOP_REQUESTS + make_requests(11, 3, prefix="p", ignore_eos=True)
  want, _ = make_engine("ar", eos_token_ids=(STOP_EOS,)).generate(requests)
  engine = make_engine(VerifySkip(k=K, drafter=NGram(k=K), cost_model=cheap),
                       eos_token_ids=(STOP_EOS,))
  assert engine.fused
  out, metrics = engine.generate(requests)
  for o, w in zip(out, want):
    assert (o.request_id, o.output_token_ids, o.finish_reason, o.text) == (
        w.request_id, w.output_token_ids, w.finish_reason, w.text)
  check_counters(metrics, out, K)
  for o in out[:3]:  # the last step ended on an accepted draft: later ones and bonus cut
    assert len(o.output_token_ids) == o.num_accepted_tokens + o.num_steps - 1, o
    assert o.num_accepted_tokens >= 1, o


def test_max_tokens_and_max_model_len_as_ar(make_engine, reference):
  rng = np.random.default_rng(40)
  requests = [Request(f"m{i}", tuple(int(t) for t in rng.integers(0, VOCAB, p)),
                      SamplingParams(max_tokens=m, ignore_eos=True))
              for i, (p, m) in enumerate([(3, 12), (2, 9), (5, 10), (21, 20)])]
  engine = make_engine(VerifySkip(k=K, drafter=scripted_device_drafter(requests, reference),
                                  cost_model=cheap))
  out, metrics = engine.generate(requests)
  assert [o.output_token_ids for o in out] == reference(requests)
  assert [o.finish_reason for o in out] == ["length"] * 4
  assert len(requests[3].prompt_token_ids) + len(out[3].output_token_ids) == MAX_MODEL_LEN
  check_counters(metrics, out, K)
  assert sum(o.num_accepted_tokens for o in out) == sum(o.num_draft_tokens for o in out) > 0


def test_no_compiles_after_precompile(make_engine, reference):
  requests = make_requests(31, 6)
  method = VerifySkip(k=K, drafter=scripted_device_drafter(requests, reference, 1),
                      cost_model=middling)
  engine = make_engine(method, ENGINE_CONFIG.replace(max_num_seqs=4))
  assert engine.precompile(requests, num_threads=1) > 0
  outputs, metrics = engine.generate(requests)
  assert [o.output_token_ids for o in outputs] == reference(requests)
  compiled = [(s.num_rows, s.pages_bucket, s.query_bucket) for s in metrics.steps if s.compiled]
  assert not compiled, compiled
  assert metrics.num_compiles == 0 and metrics.prefill_compiled_s == 0
  assert len({s.query_bucket for s in metrics.steps}) > 1  # several verify lengths ran


def _seeded(make_engine, method, requests):
  out, metrics = make_engine(method).generate(requests)
  check_counters(metrics, out, make_engine(method).k)
  return {o.request_id: o for o in out}["seeded"]


def test_seeded_request_ignores_partners(make_engine):
  want = _seeded(make_engine, "ar", [SEEDED]).output_token_ids
  method = VerifySkip(k=K, drafter=NGram(k=K), cost_model=middling)
  alone = _seeded(make_engine, method, [SEEDED])
  assert alone.output_token_ids == want
  assert alone.num_draft_tokens > 0  # drafts were verified (else the check is vacuous)
  partners = make_requests(21, 3, prefix="a", temperature=1.0, top_k=5, seed=3,
                           max_tokens=(10, 12))
  assert _seeded(make_engine, method, [*partners, SEEDED]).output_token_ids == want


@dataclasses.dataclass(frozen=True, kw_only=True)
class _TooLong(VerifySkip):
  def plan_verify(self, state, request_ids, budgets):
    state, vplan = super().plan_verify(state, request_ids, budgets)
    return state, dataclasses.replace(vplan, caps=np.full_like(vplan.caps, K + 1))


@dataclasses.dataclass(frozen=True, kw_only=True)
class _HostPlanner(Method):
  name = "host_planner"

  @property
  def num_speculative_tokens(self):
    return 1

  def capabilities(self):
    return Capabilities(runs_on="host", plans_verify=True)

  def propose(self, state, context):
    raise AssertionError("never called")


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Fractional(VerifySkip):
  def plan_verify(self, state, request_ids, budgets):
    state, vplan = super().plan_verify(state, request_ids, budgets)
    return state, dataclasses.replace(vplan, caps=np.full(len(vplan.caps), 2.7))


def test_bad_plans_are_refused(make_engine):
  bad = r"must hold one integer cap in \[0, 4\]"
  with pytest.raises(ValueError, match=r"VerifyPlan.caps=\[5\] " + bad):
    make_engine(_TooLong(k=K, drafter=NGram(k=K))).generate(make_requests(1, 1))
  with pytest.raises(ValueError, match=r"VerifyPlan.caps=\[2.7\] " + bad):  # not truncated
    make_engine(_Fractional(k=K, drafter=NGram(k=K))).generate(make_requests(1, 1))
  # A drafter that drafts fewer than k tokens is refused when built, not in the step.
  with pytest.raises(ValueError, match="k=4 must be <= its drafter's k=2"):
    VerifySkip(k=K, drafter=NGram(k=2))
  with pytest.raises(ValueError, match="plans_verify needs runs_on='fused'"):
    make_engine(_HostPlanner())


@pytest.mark.slow  # its own compiles (EAGLE-3 head steps at each verify length)
def test_fused_head_with_hidden_layers_equals_ar(make_engine, reference):
  """A fused drafter reading target hidden states (EAGLE-3's chain, coupled: no q) runs
  fused under verify_skip (its device hooks are the drafter's) and keeps greedy outputs."""
  from methods.eagle3 import Eagle3  # noqa: PLC0415

  requests = make_requests(2, 4)
  method = VerifySkip(k=K, drafter=Eagle3(k=K, feature_layers=(1, 2, 2), coupled_sampling=True))
  engine = make_engine(method)
  assert engine.fused and engine.caps.plans_verify and engine.caps.target_hidden_layers
  outputs, metrics = engine.generate(requests)
  assert [o.output_token_ids for o in outputs] == reference(requests)
  check_counters(metrics, outputs, K)
  assert engine._method_state.counters["verified"] > 0
