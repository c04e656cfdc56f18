"""``models.llama.fuse_projections``: one q/k/v and one gate/up GEMM per layer computes
what the separate projections compute, stacked or unrolled, for every family's layer
options (attention biases, q/k norms, sandwich norms)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from models import testing
from models.llama import fuse_projections, unstack_layer_params

jax.config.update("jax_default_matmul_precision", "highest")

PROMPT = [5, 3]
ATOL, RTOL = 1e-5, 1e-5  # f32 rounding: the fused GEMM may sum in another order


def _logits(model, seed=0):
  """Logits of a prefill then a 2-token step of two rows."""
  rng = np.random.default_rng(seed)
  kv = testing.PagedKV(model.cfg, 2, 16, page_size=4, seed=2)
  first = kv.step(model, rng.integers(0, model.cfg.vocab_size, (2, max(PROMPT))), PROMPT)
  second = kv.step(model, rng.integers(0, model.cfg.vocab_size, (2, 2)), [2, 2])
  return np.asarray(first.logits), np.asarray(second.logits)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma3"])
@pytest.mark.parametrize("execution", ["scan", "unrolled"])
def test_fused_equals_separate(family, execution):
  model = testing.random_model(testing.tiny_config(family, num_layers=3), seed=1)
  graphdef, state = nnx.split(model)
  if execution == "unrolled":
    state = unstack_layer_params(state)
  fused_def, fused_state = fuse_projections(graphdef, state)
  names = set(fused_state["layers"].keys())
  assert {"qkv", "gate_up"} <= names and not names & {"q", "k", "v", "gate", "up"}
  for want, got in zip(_logits(nnx.merge(graphdef, state)),
                       _logits(nnx.merge(fused_def, fused_state))):
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL)


def test_fused_layer_view_and_errors():
  model = testing.random_model(testing.tiny_config("qwen2", num_layers=2), seed=4)
  graphdef, state = nnx.split(model)
  fused_def, fused_state = fuse_projections(graphdef, state)
  layer = nnx.merge(fused_def, fused_state).layers[1]
  assert set(layer.weights()) >= {"qkv", "gate_up"} and "q" not in layer.weights()
  np.testing.assert_array_equal(
      np.asarray(layer.weights()["gate_up"]),
      np.concatenate([np.asarray(model.layers[1].weights()[n]) for n in ("gate", "up")], -1))
  with pytest.raises(ValueError, match="unfused"):
    fuse_projections(fused_def, fused_state)
