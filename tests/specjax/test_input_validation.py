"""Caller errors raise ValueError naming the bad value (no model step is compiled)."""

import pytest
from flax import nnx

from methods.registry import make_method
from models.config import ModelConfig
from models.llama import Transformer
from specjax.config import EngineConfig, SamplingParams
from specjax.engine import Engine
from specjax.request import Request


def _model(vocab_size):
  cfg = ModelConfig(family="llama", vocab_size=vocab_size, hidden_size=8, intermediate_size=16,
                    num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4)
  return nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0)))  # shapes only: nothing runs


@pytest.mark.parametrize("temperature", [-0.5, -1e-6, float("nan")])
def test_negative_temperature(temperature):
  with pytest.raises(ValueError, match=f"temperature={temperature}"):
    SamplingParams(temperature=temperature)


@pytest.mark.parametrize("top_p", [0.0, -0.1, 1.5, 1.0000001])
def test_top_p_outside_unit_interval(top_p):
  with pytest.raises(ValueError, match=f"top_p={top_p}"):
    SamplingParams(top_p=top_p)


def test_other_sampling_params():
  with pytest.raises(ValueError, match="top_k=-1"):
    SamplingParams(top_k=-1)
  with pytest.raises(ValueError, match="max_tokens=0"):
    SamplingParams(max_tokens=0)
  with pytest.raises(ValueError, match="stop="):
    SamplingParams(stop=("",))
  assert SamplingParams(stop="x").stop == ("x",)
  SamplingParams(temperature=0.0, top_p=1.0)  # boundary values are fine


def test_engine_config_values():
  with pytest.raises(ValueError, match="max_num_seqs=0"):
    EngineConfig(max_num_seqs=0)
  with pytest.raises(ValueError, match="num_pages=1"):
    EngineConfig(max_model_len=64, page_size=16, num_pages=1)
  for sizes in [(), (3, 8), (8, 4, 16), (0, 16), (16, 32), (4.0, 16)]:
    with pytest.raises(ValueError, match=r"decode_batch_sizes=.* must be increasing ints in "
                                         r"\[1, max_num_seqs=16\], the last 16"):
      EngineConfig(max_num_seqs=16, decode_batch_sizes=sizes)
  config = EngineConfig(max_num_seqs=16, decode_batch_sizes=[4, 16])
  assert config.decode_batch_sizes == (4, 16)
  assert [config.decode_batch(n) for n in (1, 4, 5, 16)] == [4, 4, 16, 16]
  assert [EngineConfig(max_num_seqs=12).decode_batch(n) for n in (1, 3, 5, 9, 12)] == [
      1, 4, 8, 12, 12]  # default: powers of two, capped


@pytest.fixture(scope="module")
def engine():
  config = EngineConfig(max_num_seqs=2, max_model_len=16, page_size=4)
  return Engine(_model(32), make_method("ngram", 2), config)


@pytest.mark.parametrize("length", [16, 17, 40])
def test_prompt_longer_than_max_model_len(engine, length):
  req = Request("long", tuple(range(length)) if length < 32 else (1,) * length)
  with pytest.raises(ValueError, match=f"prompt length {length} must be < max_model_len=16"):
    engine.generate([req])


def test_bad_prompts(engine):
  with pytest.raises(ValueError, match=r"\[0, 32\)"):
    engine.generate([Request("oov", (3, 32))])
  with pytest.raises(ValueError, match="'dup'"):
    engine.generate([Request("dup", (1, 2)), Request("dup", (3,))])
  with pytest.raises(ValueError, match=">= 1 token"):
    engine.generate([Request("empty", ())])


def test_draft_target_vocab_mismatch():
  with pytest.raises(ValueError, match="vocab_size=40.*vocab_size=32"):
    Engine(_model(32), make_method("draft_model", 2), EngineConfig(max_model_len=16),
           draft=_model(40))


def test_draft_model_method_needs_a_draft():
  with pytest.raises(ValueError, match="'draft_model' needs a draft model"):
    Engine(_model(32), make_method("draft_model", 2), EngineConfig(max_model_len=16))
