"""Offline head agreement (``methods.training.agreement``): chain indexing against a
hand count, and the whole path on a tiny target against the training evaluation."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from methods.eagle3 import Eagle3
from methods.training.agreement import chain_agreement, head_agreement
from methods.training.data import TokenDataset, regenerate
from methods.training.trainer import (
    TrainConfig,
    _evaluate,
    _pad_width,
    _train_step,
    make_optimizer,
)
from models.heads import HeadConfig, make_head
from models.testing import random_model, tiny_config
from specjax.config import EngineConfig, SamplingParams
from specjax.engine import Engine
from specjax.request import Request
from specjax.steps import split_model

jax.config.update("jax_default_matmul_precision", "highest")


def test_chain_follows_each_depths_lag():
  """EAGLE lags (depth u at c + u) and MTP lags (all depths at c) on one row."""
  t = 8
  response = np.zeros((3, 1, t), bool)
  response[:, 0, 2:] = True  # chain starts c >= 2 are response starts
  hits = np.zeros((3, 1, t), bool)
  # Chain from c = 2: depth 1 at 2, depth 2 at 3, depth 3 at 4 (EAGLE lags 0, 1, 2).
  hits[0, 0, 2] = hits[1, 0, 3] = hits[2, 0, 4] = True
  hits[0, 0, 5] = True  # chain from 5: depth 1 only (depth 2 at 6 misses)
  hits[2, 0, 7] = True  # a depth-3 hit whose chain broke earlier
  eagle = chain_agreement(hits, response, [0, 1, 2])
  # Starts: depth 1 at c in 2..7 (6); depth 2 needs c + 1 <= 7 (5); depth 3 c + 2 <= 7 (4).
  np.testing.assert_array_equal(eagle.num_starts, [6, 5, 4])
  np.testing.assert_allclose(eagle.chain, [2 / 6, 1 / 5, 1 / 4])
  np.testing.assert_allclose(eagle.top1, [2 / 6, 1 / 6, 2 / 6])
  assert eagle.tau == pytest.approx(1 + 2 / 6 + 1 / 5 + 1 / 4)
  mtp = chain_agreement(hits, response, [0, 0, 0])
  # All depths at c: no start has hits at depths 1 and 2 at the same c.
  np.testing.assert_array_equal(mtp.num_starts, [6, 6, 6])
  np.testing.assert_allclose(mtp.chain, [2 / 6, 0, 0])


@pytest.fixture(scope="module")
def target():
  return split_model(random_model(tiny_config("llama"), seed=3))


@pytest.mark.parametrize("kind", ["eagle3", "mtp"])
def test_head_agreement_matches_training_evaluation(target, kind):
  """Depth-u top-1 equals the trainer's held-out response top-1 on the same data, the
  chain is non-increasing and its first depth is depth 1's top-1 (EAGLE)."""
  extra = {"num_modules": 3} if kind == "mtp" else {}
  layers = (1, 2, 2) if kind == "eagle3" else (2,)
  cfg = HeadConfig.for_target(kind, target.config, feature_layers=layers, window=8, **extra)
  head = make_head(cfg, seed=1)
  rng = np.random.default_rng(0)
  prompts = [tuple(int(t) for t in rng.integers(0, target.config.vocab_size, n))
             for n in (3, 5, 9)]
  data = regenerate(target, prompts, max_new_tokens=12, max_len=24, batch_size=4)
  agree = head_agreement(head, target, data, depth=3, batch_size=2)
  graphdef, params, rest = nnx.split(head, nnx.Param, ...)
  _, _, response_top1 = _evaluate(params, rest, graphdef, target, data, len(data), 3)
  np.testing.assert_allclose(agree.top1, response_top1, rtol=1e-12)
  assert np.all(np.diff(agree.chain) <= 1e-12)
  if kind == "eagle3":
    assert agree.chain[0] == pytest.approx(agree.top1[0])
  if kind == "mtp":  # one module per depth
    with pytest.raises(ValueError, match="depth=4 must be <= 3"):
      head_agreement(head, target, data, depth=4)
  with pytest.raises(ValueError, match="depth=0"):
    head_agreement(head, target, data, depth=0)
  with pytest.raises(ValueError, match="at least one"):
    head_agreement(head, target, TokenDataset(data.tokens[:0], data.lengths[:0],
                                              data.prompt_lengths[:0]), depth=1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _GivenHead(Eagle3):
  head: object = dataclasses.field(default=None, compare=False, hash=False, repr=False)

  def build_head(self, runtime):
    return self.head


def test_stepped_acceptance_equals_the_engines(target):
  """A head trained briefly on the target's own answers (so it agrees often, not
  always) drafts in the engine exactly the chains the offline walk predicts: the
  engine's accepted and drafted counts per position equal ``stepped_counts``. This also
  ties the unroll's response mask to the engine (the first response token is drafted:
  prefill is KV only)."""
  max_len, k, max_tokens = 32, 3, 18
  rng = np.random.default_rng(1)
  prompts = [tuple(int(t) for t in rng.integers(0, target.config.vocab_size, n))
             for n in (4, 6, 9)]
  data = regenerate(target, prompts, max_new_tokens=max_tokens, max_len=max_len,
                    batch_size=4)
  cfg = TrainConfig(kind="eagle3", steps=12, learning_rate=1e-2, warmup_steps=1,
                    window=8, feature_layers=(1, 2, 2))
  head = make_head(cfg.head_config(target.config), seed=1)
  graphdef, params, rest = nnx.split(head, nnx.Param, ...)
  opt = make_optimizer(cfg)
  opt_state = opt.init(params)
  padded = _pad_width(data)
  for _ in range(cfg.steps):
    params, opt_state, *_ = _train_step(params, opt_state, rest, graphdef, target.graphdef,
                                        target.params, padded.tokens, padded.lengths,
                                        depth=k, optimizer=opt)
  nnx.update(head, params)
  agree = head_agreement(head, target, data, depth=k, batch_size=2)
  accepted, drafted = agree.stepped_counts
  # Agreeing often but not always, so rejections move the chain starts: [16, 9, 4] of
  # [24, 23, 22] here.
  assert drafted[0] // 4 <= accepted[0] < drafted[0] and accepted[-1] < accepted[0]

  engine_cfg = EngineConfig(max_num_seqs=4, max_model_len=max_len, page_size=8,
                            num_pages=16, min_prefill_bucket=max_len)
  method = _GivenHead(k=k, feature_layers=(1, 2, 2), window=8, head=head)
  requests = [Request(f"r{i}", p, SamplingParams(max_tokens=max_tokens))
              for i, p in enumerate(prompts)]
  outputs, metrics = Engine(target, method, engine_cfg).generate(requests)
  assert [list(p) + o.output_token_ids for p, o in zip(prompts, outputs)] == [
      list(row[:n]) for row, n in zip(data.tokens, data.lengths)]
  np.testing.assert_array_equal(sum(s.accepted_per_position for s in metrics.steps), accepted)
  np.testing.assert_array_equal(sum(s.drafted_per_position for s in metrics.steps), drafted)
