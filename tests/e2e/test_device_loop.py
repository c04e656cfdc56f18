"""The device-resident engine loop: on-device commit, fused proposers, async dispatch.

Per-row decode state lives on the device (``specjax.slots``) and each engine iteration
is one jitted ``specjax.steps.engine_step`` that drafts (fused methods), verifies and
commits with the stop rules on the device (``commit_on_device``). These tests check:

- ``commit_on_device`` keeps exactly the tokens ``RequestState.append`` keeps (literal
  rows: stop id, EOS, ``ignore_eos``, ``max_tokens`` and ``max_model_len`` inside the
  run, inactive and padding rows), and the slot's history, length and finished flag;
- fused (device) n-gram gives the host n-gram's outputs and per-step counters;
- ``steps_per_dispatch`` > 1 keeps greedy outputs (rows ending mid-call, preemption,
  EOS / stop ids / stop strings inside an accepted run);
- asynchronous scheduling dispatches step n+1 before reading step n;
- a seeded sampled request does not depend on its partners or on steps_per_dispatch;
- a constant drafter with synthetic acceptance 1 commits min(k + 1, remaining) tokens
  per row and step, fused or on the host.
"""

from __future__ import annotations

import copy
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from e2e_lib import (
    ENGINE_CONFIG,
    MAX_MODEL_LEN,
    VOCAB,
    check_counters,
    decode,
    full_logits,
    make_requests,
)

from harness.synthetic import ConstantDrafter
from methods.ngram import NGram
from specjax.config import SamplingParams
from specjax.engine import Engine
from specjax.request import Request, RequestState
from specjax.slots import init_slots, slot_rows, write_slots
from specjax.steps import commit_on_device

WORKLOADS = {
    "batch1": dict(seed=1, n=1),
    "batch3": dict(seed=2, n=3),
    "batch8": dict(seed=3, n=8),
    "queue12": dict(seed=4, n=12),
}
# As test_greedy_equivalence.PREEMPT_WORKLOAD: 8 long requests need up to 32 pages of 16.
PREEMPT_WORKLOAD = dict(seed=5, n=8, prompt_len=(6, 20), max_tokens=(8, 26))


def _requests(spec):
  spec = dict(spec)
  return make_requests(spec.pop("seed"), spec.pop("n"), **spec)


def _step_counters(metrics):
  """Per step: (rows, drafted, accepted, emitted, accepted/drafted per position)."""
  return [(s.num_rows, s.num_draft_tokens, s.num_accepted, s.num_emitted,
           tuple(int(a) for a in s.accepted_per_position),
           tuple(int(d) for d in s.drafted_per_position)) for s in metrics.steps]


def _request_counters(outputs):
  return [(o.num_steps, o.num_draft_tokens, o.num_accepted_tokens) for o in outputs]


# ------------------------------------------------------------- 1. commit_on_device
EOS = 47
NUM_SLOTS = 8
NUM_STOP_IDS = 8


@jax.jit
def _commit(slots, row_slots, toks, live):
  rows = slot_rows(slots, row_slots)
  return commit_on_device(slots, row_slots, rows, toks, rows["active"] & live)


def _state(prompt_len, num_out, rid, **sampling):
  """A decode-ready ``RequestState`` with ``num_out`` outputs already committed."""
  prompt = tuple((3 * i + 1) % 40 for i in range(prompt_len))
  req = Request(rid, prompt, SamplingParams(**sampling))
  return RequestState(req, np.zeros(2, np.uint32), [*prompt, *[20 + i for i in range(num_out)]])


# (state, slot, emitted tokens of the step (-1 padded), live): one case per stop rule.
def _cases():
  return [
      # a stop id inside the run: [3, 7] kept, 9 and 11 dropped
      (_state(5, 2, "stop_id", max_tokens=20, stop_token_ids=(7,)), 3, [3, 7, 9, 11, -1], True),
      # EOS inside the run
      (_state(4, 0, "eos", max_tokens=20), 0, [5, 6, EOS, 8, 9], True),
      # ignore_eos: EOS kept, stop id 1 ends it
      (_state(6, 1, "ignore_eos", max_tokens=20, ignore_eos=True, stop_token_ids=(1,)), 5,
       [EOS, EOS, 1, 2, -1], True),
      # max_tokens inside the run: 2 outputs done, max 4 -> [1, 2] kept
      (_state(3, 2, "max_tokens", max_tokens=4), 1, [1, 2, 3, -1, -1], True),
      # max_model_len inside the run: 29 tokens, M = 32 -> [4, 5, 6] kept
      (_state(28, 1, "max_model_len", max_tokens=20), 6, [4, 5, 6, 7, 8], True),
      # an inactive (live=False) real row: nothing happens to its slot
      (_state(7, 0, "inactive", max_tokens=20), 2, [1, 2, 3, 4, 5], False),
      # no stop: every emitted token kept (a stop id past the -1 padding is ignored)
      (_state(2, 0, "no_stop", max_tokens=10, stop_token_ids=(13,)), 7, [9, 10, 11, 12, -1], True),
      # max_tokens = 1, first token
      (_state(9, 0, "one_token", max_tokens=1), 4, [30, 31, -1, -1, -1], True),
  ]


def _host_commit(st, toks, live):
  """``RequestState.append`` token by token; the kept tokens (unchanged if not live)."""
  kept = []
  if not live or st.finish_reason is not None:
    return kept
  for t in toks:
    if t < 0:
      break
    kept.append(int(t))
    if st.append(int(t), eos_ids=frozenset({EOS}), max_model_len=MAX_MODEL_LEN, decode=None):
      break
  return kept


def test_commit_on_device_matches_host_append():
  cases = _cases()
  states = [c[0] for c in cases]
  slot_ids = [c[1] for c in cases]
  slots = init_slots(NUM_SLOTS, MAX_MODEL_LEN, NUM_STOP_IDS)
  slots = write_slots(slots, slot_ids, states, frozenset({EOS}))
  host = [copy.deepcopy(st) for st in states]
  # One padding row (slot -1, gathers slot 0's state) whose tokens must be dropped.
  row_slots = jnp.asarray([*slot_ids, -1], jnp.int32)
  live = jnp.asarray([c[3] for c in cases] + [True])
  # Two steps: the second checks that rows finished in the first are inactive.
  steps = [np.asarray([c[2] for c in cases] + [[40, 41, 42, 43, 44]], np.int32),
           np.asarray([[11, 12, 13, -1, -1]] * (len(cases) + 1), np.int32)]
  for n, toks in enumerate(steps):
    before = jax.tree.map(np.asarray, slots)
    slots, kept, num_kept = _commit(slots, row_slots, jnp.asarray(toks), live)
    kept, num_kept = np.asarray(kept), np.asarray(num_kept)
    for i, (st, (_, slot, _, is_live)) in enumerate(zip(host, cases)):
      want = _host_commit(st, toks[i], is_live)
      name = f"step {n} {st.request.request_id}"
      assert num_kept[i] == len(want), name
      assert kept[i].tolist() == want + [-1] * (toks.shape[1] - len(want)), name
      assert int(slots.num_tokens[slot]) == len(st.tokens), name
      assert np.asarray(slots.tokens[slot, : len(st.tokens)]).tolist() == st.tokens, name
      assert bool(slots.finished[slot]) == (st.finish_reason is not None), name
    # Padding row: nothing kept; untouched slots (4 was never written) unchanged.
    assert num_kept[-1] == 0 and (kept[-1] == -1).all()
    unused = [s for s in range(NUM_SLOTS) if s not in slot_ids]
    for s in unused:
      assert int(slots.num_tokens[s]) == before.num_tokens[s]
      assert bool(slots.finished[s]) == bool(before.finished[s])
  finished = {st.request.request_id: st.finish_reason for st in host}
  # The literal cases hit what they claim (else the comparison above proves little);
  # "no_stop" ends in step 2 on its stop id 13.
  assert {k for k, v in finished.items() if v is not None} == {
      "stop_id", "eos", "ignore_eos", "max_tokens", "max_model_len", "one_token", "no_stop"}
  assert [len(st.tokens) for st in host] == [7 + 2, 4 + 3, 7 + 3, 5 + 2, 29 + 3, 7, 2 + 4 + 3,
                                             9 + 1]


# ------------------------------------------------------------- 2. fused vs host ngram
@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_fused_ngram_equals_host_ngram(target, reference, workload):
  """Same outputs, per-request counters and (synchronously, one iteration per call)
  per-step counters.

  Under async scheduling the host learns of a finished row one step late, so a queued
  request (or one waiting for pages) joins one step later than with the host drafter,
  and with several iterations per call (the default) a row that ends inside a call
  leaves its slot at the call's end: the per-step rows then differ, the per-request
  counters do not.
  """
  requests = _requests(WORKLOADS[workload])
  host_out, host_met = Engine(target, NGram(k=4, device=False), ENGINE_CONFIG,
                              decode=decode).generate(requests)
  expected = reference(requests)
  assert [o.output_token_ids for o in host_out] == expected
  one = ENGINE_CONFIG.replace(steps_per_dispatch=1)
  for config in (ENGINE_CONFIG, one, one.replace(async_scheduling=False)):
    engine = Engine(target, NGram(k=4), config, decode=decode)
    assert engine.fused
    out, met = engine.generate(requests)
    assert [o.output_token_ids for o in out] == expected
    assert [o.finish_reason for o in out] == [o.finish_reason for o in host_out]
    assert _request_counters(out) == _request_counters(host_out)
    check_counters(met, out, 4)
    if config.steps_per_dispatch == 1 and (not config.async_scheduling
                                           or workload in ("batch1", "batch3")):
      assert _step_counters(met) == _step_counters(host_met)
  if workload == "queue12":  # n-gram drafts something here (else the counters are trivial)
    assert sum(o.num_draft_tokens for o in host_out) > 0
    assert sum(o.num_accepted_tokens for o in host_out) > 0


# ------------------------------------------------------------- 3. steps_per_dispatch
def _spy_mid_call_ends(monkeypatch):
  """Counts rows that end inside a multi-iteration call (active, then inactive)."""
  ends = []
  real = Engine._read_oldest

  def spy(self, sched, metrics, start):
    call = self._inflight[0]
    res = np.asarray(call["results"])[:, : len(call["rows"])]
    active = res[..., -1] >= 0  # [N, rows]
    ends.append(int(np.sum(active[:-1] & ~active[1:])))
    return real(self, sched, metrics, start)

  monkeypatch.setattr(Engine, "_read_oldest", spy)
  return ends


# The CI tier runs each method, each steps_per_dispatch and each workload once; the other
# combinations (their own compiles each) are slow.
_CI_SPD = {("ar", 2, "batch8"), ("ngram", 3, "batch8"), ("ngram", 2, "preempt"),
           ("ar", 3, "preempt")}
SPD_CASES = [pytest.param(m, spd, w, marks=() if (m, spd, w) in _CI_SPD else pytest.mark.slow,
                          id=f"{m}-spd{spd}-{w}")
             for m in ("ar", "ngram") for spd in (2, 3) for w in ("batch8", "preempt")]


@pytest.mark.parametrize("method, spd, workload", SPD_CASES)
def test_steps_per_dispatch_keeps_greedy_outputs(make_engine, reference, monkeypatch, method,
                                                 spd, workload):
  """Rows ending inside a call idle for its rest; preemption drains the calls first."""
  _spd_case(make_engine, reference, monkeypatch, method, spd, workload)


def _spd_case(make_engine, reference, monkeypatch, method, spd, workload):
  requests = _requests(PREEMPT_WORKLOAD if workload == "preempt" else WORKLOADS[workload])
  ends = _spy_mid_call_ends(monkeypatch)
  m = NGram(k=4) if method == "ngram" else "ar"
  engine = make_engine(m, ENGINE_CONFIG.replace(steps_per_dispatch=spd))
  outputs, metrics = engine.generate(requests)
  assert [o.output_token_ids for o in outputs] == reference(requests)
  check_counters(metrics, outputs, engine.k)
  assert sum(ends) > 0, "no row ended inside a call"
  if workload == "preempt":
    assert metrics.num_preemptions > 0
    assert sum(o.num_preemptions for o in outputs) == metrics.num_preemptions


# Found by simulating greedy n-gram SD on the reference: in each, the stop lands on an
# accepted draft that is not the step's last token (e.g. "stop_id": the step after its
# 4th output accepts drafts [16, 34, 42], so stop id 34 cuts 42 and the bonus token).
STOP_EOS = 34
STOP_REQUESTS = [
    Request("stop_id", (16, 18, 34, 36, 18, 16, 34, 42, 0),
            SamplingParams(max_tokens=23, stop_token_ids=(34,), ignore_eos=True)),
    Request("stop_str", (6, 18, 32, 37, 36, 18, 16, 34, 42, 29),
            SamplingParams(max_tokens=22, stop=(decode([16, 34]),), ignore_eos=True)),
    Request("eos", (35, 9, 36, 18, 16, 34, 42, 25), SamplingParams(max_tokens=24)),
]


@pytest.fixture(scope="module")
def stop_baseline(make_engine):
  """Plain decoding, one step per call: the outputs every other run must match."""
  requests = STOP_REQUESTS + make_requests(11, 3, prefix="p", ignore_eos=True)
  out, _ = make_engine("ar", eos_token_ids=(STOP_EOS,)).generate(requests)
  return requests, out


def test_stop_baseline_is_what_the_cases_claim(stop_baseline, reference):
  requests, out = stop_baseline
  free = [Request(r.request_id, r.prompt_token_ids,
                  SamplingParams(max_tokens=r.sampling.max_tokens, ignore_eos=True))
          for r in requests[:3]]
  full = reference(free)
  by_id = {o.request_id: o for o in out}
  assert by_id["stop_id"].output_token_ids == full[0][:6]
  assert by_id["stop_str"].output_token_ids == full[1][:5]
  assert by_id["stop_str"].text == decode(full[1][:3])  # the stop string is cut from the text
  assert by_id["eos"].output_token_ids == full[2][:4]
  for rid in ("stop_id", "stop_str", "eos"):
    assert by_id[rid].finish_reason == "stop"


@pytest.mark.parametrize("method, spd", [("ngram", 1), ("ngram", 3), ("ar", 3)])
def test_stops_inside_accepted_run(make_engine, stop_baseline, method, spd):
  requests, want = stop_baseline
  m = NGram(k=4) if method == "ngram" else "ar"
  engine = make_engine(m, ENGINE_CONFIG.replace(steps_per_dispatch=spd),
                       eos_token_ids=(STOP_EOS,))
  out, metrics = engine.generate(requests)
  for o, w in zip(out, want):
    assert (o.request_id, o.output_token_ids, o.finish_reason, o.text) == (
        w.request_id, w.output_token_ids, w.finish_reason, w.text)
  check_counters(metrics, out, engine.k)
  if method == "ngram":
    for o in out[:3]:
      # The last step ended on an accepted draft: its later drafts and bonus were cut.
      assert len(o.output_token_ids) == o.num_accepted_tokens + o.num_steps - 1, o
      assert o.num_accepted_tokens >= 1, o


# ------------------------------------------------------------- 4. async dispatch order
def spy_order(monkeypatch):
  """The engine's calls in order: "D" per dispatch, "R<n>" per read with n calls in
  flight (monkeypatched ``Engine._dispatch`` / ``_read_oldest``)."""
  order = []
  real_dispatch, real_read = Engine._dispatch, Engine._read_oldest

  def dispatch(self, *args, **kwargs):
    order.append("D")
    return real_dispatch(self, *args, **kwargs)

  def read(self, *args, **kwargs):
    order.append(f"R{len(self._inflight)}")
    return real_read(self, *args, **kwargs)

  monkeypatch.setattr(Engine, "_dispatch", dispatch)
  monkeypatch.setattr(Engine, "_read_oldest", read)
  return order


def test_async_dispatches_before_reading(target, reference, monkeypatch):
  requests = _requests(WORKLOADS["batch3"])
  order = spy_order(monkeypatch)
  out, _ = Engine(target, NGram(k=4), ENGINE_CONFIG, decode=decode).generate(requests)
  assert [o.output_token_ids for o in out] == reference(requests)
  seq = "".join(o[0] for o in order)
  # D1 D2 R1 D3 R2 ... Dn R(n-1), then the drain reads Dn: step n+1 is dispatched
  # before step n is read, two calls in flight at every read but the last.
  assert re.fullmatch(r"D(DR)+R", seq), seq
  assert order.count("R2") == seq.count("R") - 1 and order[-1] == "R1", order
  async_dispatches = seq.count("D")

  order.clear()
  sync = Engine(target, NGram(k=4), ENGINE_CONFIG.replace(async_scheduling=False),
                decode=decode)
  out, _ = sync.generate(requests)
  assert [o.output_token_ids for o in out] == reference(requests)
  seq = "".join(o[0] for o in order)
  assert re.fullmatch(r"(DR)+", seq), seq
  assert set(order) == {"D", "R1"}
  # Async may run one wasted step past the last finish, never fewer steps.
  assert async_dispatches in (seq.count("D"), seq.count("D") + 1)


# ------------------------------------------------------------- 5. seeded sampling
# Alone it drafts 7 n-gram tokens and accepts 1: both rejection branches run.
SEEDED = Request("seeded", (16, 18, 34, 36, 18, 16, 34, 42, 0),
                 SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=12))


def _partners(name):
  """3 sampled partners (batch bucket 4), the seeded request at different rows. "top_k"
  and "top_p" steps use the jnp sampler only; "temperature" and "greedy" partners make
  "fused+jnp" steps (the seeded row takes the jnp result), their own compiles: slow."""
  mt = (10, 12)
  if name == "top_k":
    a = make_requests(21, 3, prefix="a", temperature=1.0, top_k=5, seed=3, max_tokens=mt)
    return [*a, SEEDED]
  if name == "top_p":
    a = make_requests(22, 2, prefix="b", temperature=1.2, top_p=0.8, seed=4, max_tokens=mt)
    b = make_requests(23, 1, prefix="c", temperature=0.7, top_k=3, seed=5, max_tokens=mt)
    return [a[0], SEEDED, a[1], *b]
  if name == "temperature":
    return [SEEDED, *make_requests(24, 3, prefix="d", temperature=0.5, seed=6, max_tokens=mt)]
  greedy = make_requests(25, 1, prefix="e", max_tokens=mt)
  return [*greedy, *make_requests(26, 2, prefix="f", temperature=1.2, top_p=0.8, seed=7,
                                  max_tokens=mt), SEEDED]


def _run_seeded(target, requests, config=ENGINE_CONFIG):
  out, metrics = Engine(target, NGram(k=4), config, decode=decode).generate(requests)
  check_counters(metrics, out, 4)
  return {o.request_id: o for o in out}["seeded"]


@pytest.fixture(scope="module")
def seeded_alone(target):
  return _run_seeded(target, [SEEDED])


def test_seeded_fused_ngram_alone(target, seeded_alone):
  o = seeded_alone
  assert len(o.output_token_ids) == 12
  assert o.num_draft_tokens > o.num_accepted_tokens > 0  # accepted and rejected drafts
  spd3 = _run_seeded(target, [SEEDED], ENGINE_CONFIG.replace(steps_per_dispatch=3))
  assert spd3.output_token_ids == o.output_token_ids
  # The seed matters (else the partner checks would be vacuous).
  other = Request("seeded", SEEDED.prompt_token_ids,
                  SamplingParams(temperature=0.8, top_p=0.9, seed=2, max_tokens=12))
  assert _run_seeded(target, [other]).output_token_ids != o.output_token_ids


@pytest.mark.parametrize("partners", [
    "top_k", "top_p", pytest.param("temperature", marks=pytest.mark.slow),
    pytest.param("greedy", marks=pytest.mark.slow)])
def test_seeded_fused_ngram_ignores_partners(target, seeded_alone, partners):
  batch = _partners(partners)
  assert len(batch) == 4
  o = _run_seeded(target, batch)  # a fresh engine
  assert o.output_token_ids == seeded_alone.output_token_ids


# ------------------------------------------------------------- 6. constant drafter
def _constant_schedule(request, k=3):
  """Per step (budget, emitted) of a request under drafts that are always accepted."""
  n, out, steps = len(request.prompt_token_ids), 0, []
  while out < request.sampling.max_tokens and n < MAX_MODEL_LEN:
    budget = min(k, MAX_MODEL_LEN - n, request.sampling.max_tokens - out - 1)
    emitted = min(k + 1, request.sampling.max_tokens - out, MAX_MODEL_LEN - n)
    steps.append((budget, emitted))
    out, n = out + emitted, n + emitted
  return steps


# Three steps each (one batch bucket): max_tokens 12 and 9 and 10 cut the last step's
# run (4, 1 and 2 tokens), the 21-token prompt reaches max_model_len (4, 4, 3).
CONSTANT_REQUESTS = [
    Request(f"c{i}", tuple(int(t) for t in np.random.default_rng(30 + i).integers(0, VOCAB, p)),
            SamplingParams(max_tokens=m))
    for i, (p, m) in enumerate([(3, 12), (2, 9), (5, 10), (21, 20)])]


def test_constant_drafter_full_acceptance(target):
  requests = CONSTANT_REQUESTS
  config = ENGINE_CONFIG.replace(synthetic_acceptance=(1.0,))
  fused = Engine(target, ConstantDrafter(k=3), config, decode=decode)
  assert fused.fused
  out, met = fused.generate(requests)
  host_out, host_met = Engine(target, ConstantDrafter(k=3, device=False), config,
                              decode=decode).generate(requests)
  assert [o.output_token_ids for o in out] == [o.output_token_ids for o in host_out]
  assert _request_counters(out) == _request_counters(host_out)
  assert _step_counters(met) == _step_counters(host_met)
  check_counters(met, out, 3)

  schedules = [_constant_schedule(r) for r in requests]
  assert [[e for _, e in s] for s in schedules] == [[4, 4, 4], [4, 4, 1], [4, 4, 2], [4, 4, 3]]
  assert met.num_preemptions == 0
  histories = []
  for r, o, sched in zip(requests, out, schedules):
    assert o.finish_reason == "length", o
    assert o.num_steps == len(sched)
    assert o.num_draft_tokens == o.num_accepted_tokens == sum(b for b, _ in sched)
    assert len(o.output_token_ids) == sum(e for _, e in sched)
    seq, pos = list(r.prompt_token_ids), 0
    for budget, emitted in sched:
      chunk = o.output_token_ids[pos: pos + emitted]
      assert chunk[:budget] == [seq[-1]] * min(budget, emitted)  # accepted copies of pending
      if emitted > budget:  # the bonus token: the target's argmax after the drafts
        histories.append((seq + chunk[:-1], chunk[-1]))
      seq, pos = seq + chunk, pos + emitted
  logits = full_logits(target, [h for h, _ in histories])
  assert np.argmax(logits, axis=-1).tolist() == [t for _, t in histories]
  # Every step commits min(4, remaining) tokens per row (all rows start together).
  for i, s in enumerate(met.steps):
    live = [sched[i] for sched in schedules if i < len(sched)]
    assert s.num_rows == len(live), i
    assert s.num_emitted == sum(e for _, e in live), i
    assert s.num_accepted == s.num_draft_tokens == sum(b for b, _ in live), i
  assert len(met.steps) == max(len(s) for s in schedules)
