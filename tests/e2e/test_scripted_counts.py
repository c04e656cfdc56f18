"""Scripted drafters give exact acceptance counts; stops inside accepted runs (G4, G5).

``ScriptedDrafter`` replays the greedy reference continuation: always right, always
wrong, or right for exactly j positions. Under greedy verification every step's
drafted / accepted / emitted counts then follow from the budget rule alone
(``expected_counts``), so the engine's counters must match them exactly.

With the always-right drafter and k = 4 every step commits a run of 4 accepted drafts
plus the bonus token; an EOS id, stop token id, stop string, ``max_tokens`` or
``max_model_len`` that lands inside such a run must end the request exactly as plain
AR decoding does, and nothing after the stop may be emitted or counted.
"""

import numpy as np
import pytest
from e2e_lib import (
    ENGINE_CONFIG,
    MAX_MODEL_LEN,
    K,
    check_counters,
    decode,
    expected_counts,
    make_requests,
    scripted_drafter,
)

from methods.registry import make_method
from specjax.config import SamplingParams
from specjax.metrics import summarize
from specjax.request import Request

# Mixed prompts and max_tokens (fits the pool: no preemption), batch of 5.
COUNT_REQUESTS = make_requests(11, 5, prompt_len=(2, 12))
COUNT_REQUESTS.append(Request("long", tuple(range(3, 23)), SamplingParams(max_tokens=40)))


def _expected(requests, outputs, num_right):
  """Summed expected counters over requests (sums do not depend on batch composition)."""
  per_request, acc_pos, drafted_pos = {}, np.zeros(K, int), np.zeros(K, int)
  for r, o in zip(requests, outputs):
    steps = expected_counts(len(r.prompt_token_ids), len(o), r.sampling.max_tokens,
                            num_right=num_right)
    per_request[r.request_id] = steps
    for drafted, accepted, _ in steps:
      acc_pos[:accepted] += 1
      drafted_pos[:drafted] += 1
  return per_request, acc_pos, drafted_pos


@pytest.mark.parametrize("num_right", [None, 0, 1, 2, 3])
def test_scripted_exact_counts(make_engine, reference, num_right):
  requests = COUNT_REQUESTS
  expected_out = reference(requests)
  engine = make_engine(scripted_drafter(requests, reference, num_right))
  outputs, metrics = engine.generate(requests)
  assert [o.output_token_ids for o in outputs] == expected_out
  check_counters(metrics, outputs, K)
  per_request, acc_pos, drafted_pos = _expected(requests, expected_out, num_right)
  for o in outputs:
    steps = per_request[o.request_id]
    assert o.num_steps == len(steps), o.request_id
    assert o.num_draft_tokens == sum(s[0] for s in steps), o.request_id
    assert o.num_accepted_tokens == sum(s[1] for s in steps), o.request_id
  all_steps = [s for steps in per_request.values() for s in steps]
  drafted, accepted, emitted = (sum(s[i] for s in all_steps) for i in range(3))
  assert sum(s.num_draft_tokens for s in metrics.steps) == drafted
  assert sum(s.num_accepted for s in metrics.steps) == accepted
  assert sum(s.num_emitted for s in metrics.steps) == emitted
  np.testing.assert_array_equal(np.sum([s.accepted_per_position for s in metrics.steps], 0), acc_pos)
  np.testing.assert_array_equal(np.sum([s.drafted_per_position for s in metrics.steps], 0),
                                drafted_pos)
  summary = summarize(metrics, outputs, K)
  assert summary["tau"] == pytest.approx(emitted / len(all_steps))
  assert summary["acceptance_rate"] == pytest.approx(accepted / drafted)
  if num_right is None:
    assert summary["acceptance_rate"] == 1.0
    assert all(summary[f"accept_rate_pos{j + 1}"] == 1.0 for j in range(K))
  elif num_right == 0:
    assert accepted == 0 and summary["tau"] == 1.0
  else:
    assert all(summary[f"accept_rate_pos{j + 1}"] == 1.0 for j in range(num_right))
    assert all(summary[f"accept_rate_pos{j + 1}"] == 0.0 for j in range(num_right, K))
  # Hand-checked example: the 20-token prompt with k = 4 runs 5 + 5 + 2 tokens (the
  # third step drafts 2 = max_model_len - 30, accepts both, and its bonus token is cut
  # by max_model_len).
  if num_right is None:
    assert per_request["long"] == [(4, 4, 5), (4, 4, 5), (2, 2, 2)]


# ---------------------------------------------------------------- stops (G4)
PROMPT = (5, 17, 33, 2, 40, 9)
_RUN_INSIDE = (1, 2, 3, 6, 7, 8)  # output indices strictly inside an accepted run of k = 4


@pytest.fixture(scope="module")
def continuation(reference):
  req = Request("c", PROMPT, SamplingParams(max_tokens=MAX_MODEL_LEN, ignore_eos=True))
  return reference([req])[0]


def _first_new(cont):
  """Indices inside accepted runs whose token does not occur earlier in the output."""
  return [s for s in _RUN_INSIDE if cont[s] not in cont[:s]]


def _stop_requests(cont):
  firsts = _first_new(cont)
  assert len(firsts) >= 2, f"test model gives no usable stop positions in {cont}"
  reqs = []
  for s in firsts:
    reqs.append(Request(f"stop_id@{s}", PROMPT,
                        SamplingParams(max_tokens=26, stop_token_ids=(cont[s],))))
  text = decode(cont)
  for s in _RUN_INSIDE:
    stop = decode(cont[s - 1: s + 1])
    if text.find(stop) == s - 1:  # first occurrence ends at token s
      reqs.append(Request(f"stop_str@{s}", PROMPT, SamplingParams(max_tokens=26, stop=(stop,))))
  for m in (1, 3, 7, 8, 26):
    reqs.append(Request(f"max_tokens={m}", PROMPT, SamplingParams(max_tokens=m)))
  reqs.append(Request("max_model_len", tuple(range(3, 23)), SamplingParams(max_tokens=40)))
  reqs.append(Request("max_model_len_odd", tuple(range(3, 24)), SamplingParams(max_tokens=40)))
  assert sum(r.request_id.startswith("stop_str") for r in reqs) >= 2
  return reqs


def _run_both(make_engine, reference, requests, eos_ids=()):
  script = scripted_drafter(requests, reference)
  sd_out, sd_metrics = make_engine(script, eos_token_ids=eos_ids).generate(requests)
  ar_out, ar_metrics = make_engine(make_method("ar"), eos_token_ids=eos_ids).generate(requests)
  return sd_out, sd_metrics, ar_out, ar_metrics


def _check_same_as_ar(requests, sd_out, sd_metrics, ar_out, ar_metrics):
  for r, s, a in zip(requests, sd_out, ar_out):
    assert s.output_token_ids == a.output_token_ids, r.request_id
    assert s.finish_reason == a.finish_reason, r.request_id
    assert s.text == a.text, r.request_id
  check_counters(sd_metrics, sd_out, K)
  check_counters(ar_metrics, ar_out, 0)
  for r, o in zip(requests, sd_out):
    steps = expected_counts(len(r.prompt_token_ids), len(o.output_token_ids),
                            r.sampling.max_tokens)
    assert o.num_steps == len(steps), r.request_id
    assert o.num_accepted_tokens == sum(s[1] for s in steps), r.request_id
  total = sum(len(o.output_token_ids) for o in sd_out)
  assert sum(s.num_emitted for s in sd_metrics.steps) == total
  assert sum(s.num_emitted for s in ar_metrics.steps) == total


def test_stops_inside_accepted_run(make_engine, reference, continuation):
  cont = continuation
  requests = _stop_requests(cont)
  sd_out, sd_metrics, ar_out, ar_metrics = _run_both(make_engine, reference, requests)
  _check_same_as_ar(requests, sd_out, sd_metrics, ar_out, ar_metrics)
  by_id = {o.request_id: o for o in sd_out}
  text = decode(cont)
  for r in requests:
    o = by_id[r.request_id]
    kind, _, arg = r.request_id.partition("@")
    if kind in ("stop_id", "stop_str"):
      s = int(arg)
      assert o.output_token_ids == cont[: s + 1], r.request_id  # the stop token is kept
      assert o.finish_reason == "stop"
      if kind == "stop_str":
        assert o.text == text[: s - 1]  # text ends before the stop string
        assert len(o.output_token_ids) == s + 1
      else:
        assert o.text == text[: s + 1]
      # The stop sits inside a 5-token run: the run was cut, nothing after it counted.
      last = expected_counts(len(PROMPT), s + 1, 26)[-1]
      assert last[2] < K + 1 and last[1] == last[2]
  assert by_id["max_tokens=7"].output_token_ids == cont[:7]
  assert by_id["max_tokens=7"].finish_reason == "length"
  mml = by_id["max_model_len"]
  assert len(mml.output_token_ids) == MAX_MODEL_LEN - 20 and mml.finish_reason == "length"
  odd = by_id["max_model_len_odd"]
  assert len(odd.output_token_ids) == MAX_MODEL_LEN - 21 and odd.finish_reason == "length"


def test_eos_inside_accepted_run(make_engine, reference, continuation):
  cont = continuation
  s = _first_new(cont)[-1]
  eos = cont[s]
  requests = [
      Request("eos", PROMPT, SamplingParams(max_tokens=26)),
      Request("ignore_eos", PROMPT, SamplingParams(max_tokens=26, ignore_eos=True)),
      Request("eos_short", PROMPT, SamplingParams(max_tokens=s)),  # length first
  ]
  sd_out, sd_metrics, ar_out, ar_metrics = _run_both(make_engine, reference, requests,
                                                     eos_ids=(eos,))
  _check_same_as_ar(requests, sd_out, sd_metrics, ar_out, ar_metrics)
  assert sd_out[0].output_token_ids == cont[: s + 1] and sd_out[0].finish_reason == "stop"
  assert sd_out[1].output_token_ids == cont[:26] and sd_out[1].finish_reason == "length"
  assert sd_out[2].output_token_ids == cont[:s] and sd_out[2].finish_reason == "length"
  assert sd_out[0].text == decode(cont[: s + 1])
  assert ENGINE_CONFIG.max_num_seqs >= len(requests)
