"""LayerSkip checkpoints (facebook/layerskip-llama*) are plain LlamaForCausalLM safetensors.

A tiny checkpoint with the layout of facebook/layerskip-llama3.2-1B (Llama 3 RoPE
scaling, tied embeddings; 4 layers here) is written with ``save_pretrained`` and loaded
by the ordinary HF loader. Its early exit at E (our ``layer_range=(0, E)``) must equal
what transformers' ``assistant_early_exit`` drafts with: the model's final norm and LM
head applied to ``hidden_states[E]``; the layerskip method then decodes exactly as AR.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from methods.registry import make_method  # noqa: E402
from models.llama import init_kv_caches  # noqa: E402
from models.loaders.hf_safetensors import load_hf_directory  # noqa: E402
from models.testing import run_step  # noqa: E402
from pallas_kernels.paged_attention.metadata import AttentionMetadata  # noqa: E402
from specjax.config import EngineConfig, SamplingParams  # noqa: E402
from specjax.engine import Engine  # noqa: E402
from specjax.request import Request  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

EXIT = 2


def _write_layerskip_like(path):
  config = transformers.LlamaConfig(
      vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
      tie_word_embeddings=True, rope_theta=500000.0,
      rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                        high_freq_factor=4.0, original_max_position_embeddings=8))
  config._attn_implementation = "eager"
  torch.manual_seed(0)
  model = transformers.LlamaForCausalLM(config).eval()
  gen = torch.Generator().manual_seed(0)
  with torch.no_grad():
    for name, p in model.named_parameters():
      z = torch.randn(p.shape, generator=gen, dtype=torch.float32)
      if "norm" in name:
        p.copy_(1.0 + 0.1 * z)
      elif "embed_tokens" in name:
        p.copy_(z)
      else:  # attention output and MLP scaled up: varied greedy text
        p.copy_(3.0 * z / math.sqrt(p.shape[1]))
  model.save_pretrained(path)
  return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  path = tmp_path_factory.mktemp("layerskip_llama")
  hf = _write_layerskip_like(path)
  cfg, model = load_hf_directory(path)
  return hf, cfg, model


def test_early_exit_logits_match_transformers(checkpoint):
  hf, cfg, model = checkpoint
  assert cfg.num_layers == 4 and cfg.tie_word_embeddings
  tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 16))
  with torch.no_grad():
    out = hf(torch.as_tensor(tokens), output_hidden_states=True)
    want = hf.lm_head(hf.model.norm(out.hidden_states[EXIT])).numpy()
  caches = init_kv_caches(cfg, 8, 4)
  table = jnp.arange(8, dtype=jnp.int32).reshape(2, 4)
  lengths = jnp.full((2,), 16, jnp.int32)
  _, got = run_step(model, caches, tokens, AttentionMetadata(table, lengths, lengths),
                    layer_range=(0, EXIT))
  np.testing.assert_allclose(np.asarray(got.logits), want, rtol=0, atol=1e-4)


@pytest.mark.slow  # new model shapes to compile (~60 s on 2 busy cores); CI's engine tests
def test_layerskip_decodes_the_checkpoint_as_ar(checkpoint):  # use the e2e target
  _, cfg, model = checkpoint
  config = EngineConfig(max_num_seqs=2, max_model_len=32, page_size=8, num_pages=8,
                        min_prefill_bucket=32)
  requests = [Request(f"r{i}", tuple(int(t) for t in p), SamplingParams(max_tokens=14))
              for i, p in enumerate(np.random.default_rng(2).integers(0, 96, (2, 6)))]
  ar, _ = Engine(model, make_method("ar"), config).generate(requests)
  sd, metrics = Engine(model, make_method("layerskip", 3, exit_layer=EXIT), config).generate(
      requests)
  assert [o.output_token_ids for o in sd] == [o.output_token_ids for o in ar]
  assert len({t for o in ar for t in o.output_token_ids}) >= 5  # not a one-token loop
  assert sum(s.num_draft_tokens for s in metrics.steps) > 0
