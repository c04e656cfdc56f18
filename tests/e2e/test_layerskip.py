"""LayerSkip (early-exit self-speculation) through the engine.

The session target has 2 layers: ``exit_layer=1`` drafts with layer 0 plus the shared
final norm and LM head (partial acceptance), ``exit_layer=2`` drafts with the whole model
(the oracle: every greedy draft accepted). Draft and verify share the target's KV pool,
so these tests also check that the draft's KV writes never change the outputs. An
``early_exit`` adapter is trained here for a few steps and then drafts.
"""

import csv

import numpy as np
import pytest
from e2e_lib import (
    DIST_TEMPERATURE,
    DIST_TOP_K,
    MAX_MODEL_LEN,
    VOCAB,
    K,
    assert_target_law,
    check_counters,
    expected_counts,
    law_requests,
    make_requests,
)
from flax import nnx
from test_scripted_counts import (  # noqa: F401  (continuation is a fixture)
  PROMPT,
  _check_same_as_ar,
  _stop_requests,
  continuation,
)

from methods.layerskip import LayerSkip
from methods.registry import make_method
from methods.training.data import TokenDataset
from methods.training.trainer import TrainConfig, _evaluate, _pad_width, train
from models.heads import make_head
from specjax.config import SamplingParams
from specjax.metrics import summarize
from specjax.request import Request

WORKLOADS = {"batch1": (21, 1), "batch3": (22, 3), "batch8": (23, 8), "queue12": (24, 12)}


def _layerskip(exit_layer):
  return make_method("layerskip", K, exit_layer=exit_layer)


@pytest.mark.parametrize("exit_layer,workload", [
    (1, "batch1"), (1, "batch8"),
    # Compile-bound: CI keeps the two above; the oracle (E = 2) runs in CI in the stop tests.
    *(pytest.param(e, w, marks=pytest.mark.slow)
      for e, w in [(1, "batch3"), (1, "queue12"), (2, "batch1"), (2, "batch3"), (2, "batch8"),
                   (2, "queue12")])])
def test_greedy_layerskip_equals_ar(make_engine, reference, exit_layer, workload):
  seed, n = WORKLOADS[workload]
  requests = make_requests(seed, n)
  outputs, metrics = make_engine(_layerskip(exit_layer)).generate(requests)
  assert [o.output_token_ids for o in outputs] == reference(requests)
  check_counters(metrics, outputs, K)
  summary = summarize(metrics, outputs, K)
  drafted = sum(s.num_draft_tokens for s in metrics.steps)
  accepted = sum(s.num_accepted for s in metrics.steps)
  if exit_layer == 2:  # the full model drafts: the oracle accepts everything
    assert drafted > 0 and accepted == drafted
    assert summary["acceptance_rate"] == 1.0
    for o, r in zip(outputs, requests):  # and the counts follow from the budgets alone
      steps = expected_counts(len(r.prompt_token_ids), len(o.output_token_ids),
                              r.sampling.max_tokens)
      assert o.num_steps == len(steps), r.request_id
      assert o.num_accepted_tokens == sum(s[1] for s in steps), r.request_id


def test_early_exit_acceptance_is_partial(make_engine):
  requests = make_requests(23, 8)
  _, metrics = make_engine(_layerskip(1)).generate(requests)
  accepted = sum(s.num_accepted for s in metrics.steps)
  drafted = sum(s.num_draft_tokens for s in metrics.steps)
  assert 0 < accepted < drafted, (accepted, drafted)


@pytest.mark.slow  # new page-table buckets to compile (~30 s on 2 busy cores)
def test_preemption_keeps_outputs(make_engine, reference):
  requests = make_requests(5, 8, prompt_len=(6, 20), max_tokens=(8, 26))
  outputs, metrics = make_engine(_layerskip(1)).generate(requests)
  assert metrics.num_preemptions > 0
  assert [o.output_token_ids for o in outputs] == reference(requests)
  check_counters(metrics, outputs, K)


def _run_both(make_engine, requests, eos_ids=()):
  sd_out, sd_metrics = make_engine(_layerskip(2), eos_token_ids=eos_ids).generate(requests)
  ar_out, ar_metrics = make_engine(make_method("ar"), eos_token_ids=eos_ids).generate(requests)
  return sd_out, sd_metrics, ar_out, ar_metrics


def test_stops_inside_accepted_run(make_engine, continuation):  # noqa: F811
  """With the oracle exit every step is a 5-token accepted run; stops inside it end the
  request exactly as AR does (the shared checks also compare the counts)."""
  requests = _stop_requests(continuation)
  sd_out, sd_metrics, ar_out, ar_metrics = _run_both(make_engine, requests)
  _check_same_as_ar(requests, sd_out, sd_metrics, ar_out, ar_metrics)
  # The oracle: every draft of a request that ran to its length limit was accepted (the
  # shared checks above also match every request's counts to the always-right ones).
  ran = [o for o in sd_out if o.finish_reason == "length"]
  assert all(o.num_accepted_tokens == o.num_draft_tokens for o in ran), ran
  assert sum(o.num_draft_tokens for o in ran) > 0


def test_eos_inside_accepted_run(make_engine, continuation):  # noqa: F811
  cont = continuation
  s = next(i for i in (1, 2, 3, 6, 7, 8) if cont[i] not in cont[:i])
  requests = [Request("eos", PROMPT, SamplingParams(max_tokens=26)),
              Request("eos_short", PROMPT, SamplingParams(max_tokens=s))]
  sd_out, *rest = _run_both(make_engine, requests, eos_ids=(cont[s],))
  _check_same_as_ar(requests, sd_out, *rest)
  assert sd_out[0].output_token_ids == cont[: s + 1] and sd_out[0].finish_reason == "stop"
  assert sd_out[1].output_token_ids == cont[:s] and sd_out[1].finish_reason == "length"


def test_bad_exit_layer_is_refused(make_engine):
  for bad in (0, -1, 1.5, True):
    with pytest.raises(ValueError, match=rf"exit_layer={bad!r} must be"):
      LayerSkip(k=K, exit_layer=bad)
  with pytest.raises(ValueError, match="needs exit_layer"):
    LayerSkip(k=K)
  with pytest.raises(ValueError, match=r"k=0 must be"):
    LayerSkip(k=0, exit_layer=1)
  engine = make_engine(_layerskip(3))  # the target has 2 layers
  with pytest.raises(ValueError, match=r"exit_layer=3 must be in \[1, 2\]"):
    engine.generate(make_requests(21, 1))


# ---------------------------------------------------------------- exit adapter training
EXIT = 1


def _random_data(n, seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, VOCAB, size=(n, MAX_MODEL_LEN)).astype(np.int32)
  lengths = rng.integers(16, MAX_MODEL_LEN + 1, size=n).astype(np.int32)
  for row, ln in zip(tokens, lengths):
    row[ln:] = 0
  return TokenDataset(tokens, lengths, np.full(n, 4, np.int32))


def test_adapter_training_lowers_loss_and_raises_top1(make_engine, reference, target, tmp_path):
  """A few steps on random token rows (labels: the target's greedy tokens): the loss
  falls, held-out top-1 agreement with the target (the greedy acceptance estimate) does
  not fall below the plain exit's, and the trained adapter drafts losslessly."""
  train_data, held = _random_data(40).split(8)
  cfg = TrainConfig(kind="early_exit", steps=20, batch_size=8, learning_rate=2e-2,
                    warmup_steps=2, feature_layers=(EXIT,), eval_every=20,
                    checkpoint_every=20, progress=False, output_dir=str(tmp_path / "run"))
  head = make_head(cfg.head_config(target.config))
  graphdef, params, rest = nnx.split(head, nnx.Param, ...)
  _, top1_before, _ = _evaluate(params, rest, graphdef, target, _pad_width(held), 8, 1)
  result = train(cfg, target, train_data, held)
  assert result.losses[-3:].mean() < 0.9 * result.losses[:3].mean(), result.losses
  with open(result.metrics_csv) as f:
    top1_after = float(list(csv.DictReader(f))[-1]["held_out_top1_pos1"])
  assert top1_after >= top1_before[0], (top1_before, top1_after)
  print(f"held-out top-1 {top1_before[0]:.3f} -> {top1_after:.3f}; "
        f"loss {result.losses[0]:.3f} -> {result.losses[-1]:.3f}")
  requests = make_requests(23, 3, prompt_len=(3, 6))  # few rows: few batch buckets to compile
  method = make_method("layerskip", K, adapter_path=str(tmp_path / "run"))  # resolves head/
  assert method.exit_layer == EXIT
  outputs, metrics = make_engine(method).generate(requests)
  assert [o.output_token_ids for o in outputs] == reference(requests)
  check_counters(metrics, outputs, K)
  _, plain = make_engine(_layerskip(EXIT)).generate(requests)
  rate = {name: sum(s.num_accepted for s in m.steps) / sum(s.num_draft_tokens for s in m.steps)
          for name, m in (("plain", plain), ("adapter", metrics))}
  print(f"engine acceptance {rate}")
  assert rate["adapter"] >= rate["plain"], rate


# ---------------------------------------------------------------- sampling (lossless)
NUM_SAMPLES = 1024


def test_two_token_distribution_matches_target(make_engine, target):
  """Drafts sampled from the early-exit distribution q (passed to the verifier): the
  first two output tokens follow the target's distribution (temperature + top-k)."""
  outputs, metrics = make_engine(_layerskip(1)).generate(law_requests(NUM_SAMPLES, 2))
  check_counters(metrics, outputs, K)
  accepted = sum(s.num_accepted for s in metrics.steps)
  drafted = sum(s.num_draft_tokens for s in metrics.steps)
  assert 0 < accepted < drafted  # both acceptance and rejection paths ran
  assert_target_law(target, outputs, 2)


@pytest.mark.slow  # ~85 s on 2 busy CPU cores: new sampled draft/verify shapes compile
def test_seeded_request_ignores_batch_partners(make_engine):
  # The distribution test's sampling settings (and batch bucket 8): no new sampler compiles.
  params = dict(temperature=DIST_TEMPERATURE, top_k=DIST_TOP_K, max_tokens=12)
  seeded = Request("seeded", (7, 21, 3, 30, 12, 44, 8), SamplingParams(seed=1234, **params))
  engine = make_engine(_layerskip(1))
  partners = make_requests(31, 7, prefix="p", temperature=DIST_TEMPERATURE, top_k=DIST_TOP_K, seed=3)
  alone = engine.generate([seeded, *partners[:4]])[0]
  outputs, metrics = engine.generate([*partners[4:], seeded, *partners[:4]])
  by_id = {o.request_id: o for o in outputs}
  assert by_id["seeded"].output_token_ids == alone[0].output_token_ids
  assert len(alone[0].output_token_ids) == 12
  check_counters(metrics, outputs, K)
