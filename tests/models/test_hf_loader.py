"""The safetensors loader reproduces `transformers` logits and hidden states.

Each case builds a tiny random `transformers` model (torch CPU, f32, fixed seed; every
weight re-drawn, norms and biases included, so a wrong mapping cannot hide behind an
all-ones init), writes it with `save_pretrained` (safetensors), loads the directory with
`load_hf_directory` and compares against the torch forward: logits and hidden_states
(0, 1, num_layers) within atol 1e-4, rtol 0.
"""

import math

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from models import testing  # noqa: E402
from models.loaders.hf_safetensors import load_hf_directory  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

ATOL = 1e-4
_DIMS = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             max_position_embeddings=256)

CASES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False)),
    "llama3_rope": ("LlamaConfig", "LlamaForCausalLM", dict(
        tie_word_embeddings=True, rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=8))),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True,
                                                      rope_theta=1000.0)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=False)),
    # Layers: sliding, full, sliding; window 4 < sequence length 15; local RoPE base 100.
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_hidden_layers=3, sliding_window=4, sliding_window_pattern=2,
        rope_local_base_freq=100.0, rope_theta=10000.0, query_pre_attn_scalar=16)),
    # Gemma 3 4B+ style linear RoPE scaling on the global layers.
    "gemma3_linear_rope": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_hidden_layers=2, sliding_window=4, sliding_window_pattern=2,
        rope_local_base_freq=100.0, rope_theta=10000.0, query_pre_attn_scalar=8,
        rope_scaling=dict(rope_type="linear", factor=4.0))),
}


def _randomize_(model, seed):
  """Re-draws every parameter (norms around their identity, projections ~ 1/sqrt(fan_in))."""
  gen = torch.Generator().manual_seed(seed)
  plus_one = "Gemma3" in type(model).__name__
  hidden = model.config.hidden_size
  with torch.no_grad():
    for name, p in model.named_parameters():
      z = torch.randn(p.shape, generator=gen, dtype=torch.float32)
      if "norm" in name:
        p.copy_(0.1 * z + (0.0 if plus_one else 1.0))
      elif name.endswith("bias"):
        p.copy_(0.1 * z)
      elif "embed_tokens" in name:
        p.copy_(z / math.sqrt(hidden) if plus_one else z)
      else:
        p.copy_(z / math.sqrt(p.shape[1]))


def _write_checkpoint(case, path, seed=0):
  config_cls, model_cls, extra = CASES[case]
  config = getattr(transformers, config_cls)(**{**_DIMS, **extra})
  config._attn_implementation = "eager"
  torch.manual_seed(seed)
  model = getattr(transformers, model_cls)(config).eval()
  _randomize_(model, seed)
  model.save_pretrained(path)
  return model


@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_hidden_states_match_transformers(case, tmp_path):
  hf_model = _write_checkpoint(case, tmp_path)
  cfg, model = load_hf_directory(tmp_path)
  num_layers = cfg.num_layers
  if case.startswith("gemma3"):
    assert cfg.sliding_window == 4 and cfg.global_every == 2 and cfg.rope_local_theta == 100.0
  tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (3, 15))
  with torch.no_grad():
    want = hf_model(torch.as_tensor(tokens), output_hidden_states=True)
  layers = (0, 1, num_layers)
  got = testing.full_forward(model, tokens, page_size=4, seed=2, hidden_layers=layers)
  np.testing.assert_allclose(np.asarray(got.logits), want.logits.numpy(), rtol=0, atol=ATOL,
                             err_msg=f"{case} logits")
  assert len(want.hidden_states) == num_layers + 1
  for i, layer in enumerate(layers):
    np.testing.assert_allclose(np.asarray(got.hidden[i]), want.hidden_states[layer].numpy(),
                               rtol=0, atol=ATOL, err_msg=f"{case} hidden_states[{layer}]")
