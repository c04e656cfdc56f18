"""Random-weight models by name: the shape table, parameter counts, loading ``random:``."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import testing, zoo
from models.llama import Transformer
from models.random_weights import random_transformer
from models.shapes import SHAPES, param_count


def _module_param_count(cfg):
  """Parameters of an abstract ``Transformer(cfg)`` (``nnx.eval_shape``: nothing allocated)."""
  abstract = nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0)))
  return sum(math.prod(v.shape) for v in jax.tree.leaves(nnx.state(abstract, nnx.Param)))


def test_random_names():
  assert set(zoo.RANDOM_NAMES) >= {
      "random:llama3-8b", "random:llama3.3-70b", "random:llama3.2-1b", "random:smollm2-135m",
      "random:qwen2.5-coder-1.5b", "random:qwen2.5-coder-0.5b", "random:tiny"}
  assert all(zoo.is_random_name(n) for n in zoo.RANDOM_NAMES)
  assert not zoo.is_random_name("smollm2-135m")


def test_llama3_8b_parameter_count():
  cfg = SHAPES["llama3-8b"]
  assert param_count(cfg) == 8_030_261_248
  assert abs(param_count(cfg) / 8.03e9 - 1) < 1e-3


def test_llama3_70b_shape():
  cfg = SHAPES["llama3.3-70b"]
  assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
          cfg.intermediate_size, cfg.vocab_size) == (80, 8192, 64, 8, 128, 28672, 128256)
  assert param_count(cfg) == 70_553_706_496


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_param_count_matches_the_module(name):
  assert param_count(SHAPES[name]) == _module_param_count(SHAPES[name])


def test_load_random_tiny_bf16():
  loaded = zoo.load_model("random:tiny", dtype="bfloat16")
  assert loaded.tokenizer is None and loaded.sha256 is None
  assert loaded.name == loaded.path == "random:tiny"
  assert loaded.config == SHAPES["tiny"].replace(dtype="bfloat16")
  assert loaded.config.eos_token_ids == () and loaded.config.bos_token_id is None
  leaves = jax.tree.leaves(nnx.state(loaded.model, nnx.Param))
  assert {x.dtype for x in leaves} == {jnp.dtype(jnp.bfloat16)}
  tokens = np.random.default_rng(0).integers(0, loaded.config.vocab_size, (2, 9))
  logits = np.asarray(testing.full_forward(loaded.model, tokens).logits)
  assert np.isfinite(logits).all() and 0.3 < logits.std() < 3

  again = zoo.load_model("random:tiny", dtype="bfloat16")
  other = zoo.load_model("random:tiny", dtype="bfloat16", seed=1)
  embed = np.asarray(loaded.model.embed[...], np.float32)
  np.testing.assert_array_equal(embed, np.asarray(again.model.embed[...], np.float32))
  assert not np.array_equal(embed, np.asarray(other.model.embed[...], np.float32))


def test_layers_do_not_depend_on_num_layers():
  cfg = SHAPES["tiny"]
  two, three = random_transformer(cfg, 5), random_transformer(cfg.replace(num_layers=3), 5)
  for name, w in two.layers.weights().items():
    np.testing.assert_array_equal(np.asarray(w), np.asarray(three.layers.weights()[name])[:2])
  q = np.asarray(two.layers.q[...])
  assert abs(q.std() * math.sqrt(cfg.hidden_size) - 1) < 0.1  # N(0, 1/fan_in)


def test_unknown_random_shape():
  with pytest.raises(ValueError, match=r"name='random:gpt5' must be one of \['random:llama3-8b'"):
    zoo.load_model("random:gpt5")
  with pytest.raises(ValueError, match="dtype='float16' must be 'float32' or 'bfloat16'"):
    zoo.load_model("random:tiny", dtype="float16")
  with pytest.raises(ValueError, match="seed='0' must be an int"):
    random_transformer(SHAPES["tiny"], "0")
