"""LayerSkip exit adapter: trained by the head trainer, loaded by the layerskip method.

The CI training test (a few steps, the engine on the trained adapter) lives in
tests/e2e/test_layerskip.py, where it shares the engine tests' compiled steps. The tiny
target here (2 layers) exits at E = 1. The adapter (RMSNorm scale + D x D linear,
identity at init) learns to map layer 0's output to the target's greedy tokens through
the target's own final norm and LM head. Training data is the target's own greedy
continuations (``regenerate``, as the training pipeline does); acceptance is measured by
the engine on other prompts.
"""

import jax
import numpy as np
import pytest
from flax import nnx

from methods.layerskip import LayerSkip
from methods.training.data import regenerate
from methods.training.trainer import TrainConfig, train
from models.heads import EarlyExitHead, HeadConfig, load_head, make_head
from models.testing import varied_model
from specjax.config import EngineConfig, SamplingParams
from specjax.engine import Engine
from specjax.request import Request
from specjax.steps import split_model

jax.config.update("jax_default_matmul_precision", "highest")

MAX_LEN = 32
ENGINE = EngineConfig(max_num_seqs=4, max_model_len=MAX_LEN, page_size=8, num_pages=32,
                      min_prefill_bucket=MAX_LEN)
EXIT = 1


@pytest.fixture(scope="module")
def target():
  model = varied_model()
  return split_model(model)


def _prompts(seed, n):
  rng = np.random.default_rng(seed)
  return [tuple(int(t) for t in rng.integers(0, 96, size=int(rng.integers(3, 8))))
          for _ in range(n)]


def _accept_rate(target, method, prompts):
  requests = [Request(f"r{i}", p, SamplingParams(max_tokens=MAX_LEN - len(p) - 1))
              for i, p in enumerate(prompts)]
  outputs, metrics = Engine(target, method, ENGINE).generate(requests)
  accepted = sum(s.num_accepted for s in metrics.steps)
  drafted = sum(s.num_draft_tokens for s in metrics.steps)
  return accepted / drafted, [o.output_token_ids for o in outputs]


@pytest.mark.slow  # ~200 s on 2 busy CPU cores (regeneration, training, 2 engines)
def test_adapter_training_lowers_loss_and_keeps_acceptance(target, tmp_path):
  data = regenerate(target, _prompts(0, 40), max_new_tokens=24, max_len=MAX_LEN, batch_size=8)
  train_data, held = data.split(8)
  cfg = TrainConfig(kind="early_exit", steps=30, batch_size=8, learning_rate=2e-2,
                    warmup_steps=2, feature_layers=(EXIT,), eval_every=30,
                    checkpoint_every=30, progress=False, output_dir=str(tmp_path / "run"))
  result = train(cfg, target, train_data, held)
  assert np.all(np.isfinite(result.losses))
  assert result.losses[-5:].mean() < 0.9 * result.losses[:3].mean(), result.losses
  # Exported head (orbax) round-trips and drives the method.
  head = load_head(result.head_dir, target.config)
  assert isinstance(head, EarlyExitHead) and head.exit_layer == EXIT
  trained = LayerSkip(k=3, adapter_path=str(tmp_path / "run"))  # the run dir resolves to head/
  assert trained.exit_layer == EXIT
  prompts = _prompts(1, 8)
  plain_rate, plain_out = _accept_rate(target, LayerSkip(k=3, exit_layer=EXIT), prompts)
  trained_rate, trained_out = _accept_rate(target, trained, prompts)
  assert trained_out == plain_out  # greedy outputs are the target's either way
  assert trained_rate >= plain_rate, (plain_rate, trained_rate)
  print(f"acceptance plain exit {plain_rate:.3f}, trained adapter {trained_rate:.3f}; "
        f"loss {result.losses[0]:.3f} -> {result.losses[-1]:.3f}")


def test_identity_adapter_gives_the_plain_exit(target):
  cfg = HeadConfig.for_target("early_exit", target.config, feature_layers=(EXIT,))
  head = make_head(cfg)
  model = nnx.merge(target.graphdef, target.params)
  h = jax.random.normal(jax.random.key(0), (2, 5, target.config.hidden_size))
  from models.layers import rms_norm  # noqa: PLC0415

  c = target.config
  plain = model.lm_logits(rms_norm(h, model.final_norm[...], c.rms_norm_eps, c.norm_plus_one))
  np.testing.assert_allclose(head.exit_logits(model, h), plain, atol=1e-4)


def test_adapter_errors(target, tmp_path):
  with pytest.raises(ValueError, match=r"must be in \[1, 1\]"):
    HeadConfig.for_target("early_exit", target.config, feature_layers=(2,)).check_target(
        target.config)
  with pytest.raises(ValueError, match="depth=2 must be <= 1"):
    TrainConfig(kind="early_exit", depth=2)
  from models.heads import save_head  # noqa: PLC0415

  save_head(str(tmp_path / "h"), make_head(HeadConfig.for_target(
      "early_exit", target.config, feature_layers=(EXIT,))))
  with pytest.raises(ValueError, match="exit_layer=2 must equal the adapter's exit layer 1"):
    LayerSkip(k=3, exit_layer=2, adapter_path=str(tmp_path / "h"))
  save_head(str(tmp_path / "m"), make_head(HeadConfig.for_target("medusa", target.config)))
  with pytest.raises(ValueError, match="needs an 'early_exit' head"):
    LayerSkip(k=3, adapter_path=str(tmp_path / "m"))
