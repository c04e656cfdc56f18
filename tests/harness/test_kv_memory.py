"""KV memory per token: the target's from its config, and each method's additions."""

import types

import pytest

from harness import kv_memory
from methods.registry import make_method
from models.shapes import SHAPES


def test_target_bytes_from_config():
  # Llama-3-8B: 32 layers x 2 (K, V) x 8 KV heads x 128 dims x 2 bytes (bf16).
  assert kv_memory.target_kv_bytes_per_token(SHAPES["llama3-8b"]) == 32 * 2 * 8 * 128 * 2
  assert kv_memory.target_kv_bytes_per_token(SHAPES["llama3-8b"], "float32") == 262144


def test_draft_model_adds_its_kv_seed_pair():
  # Qwen3-8B: 36 x 2 x 8 x 128 x 2 = 147456; Qwen3-0.6B: 28 x 2 x 8 x 128 x 2 = 114688.
  mem = kv_memory.method_memory(make_method("draft_model", 4), SHAPES["qwen3-8b"],
                                SHAPES["qwen3-0.6b"])
  assert mem.target_per_token == 147456
  assert mem.extra_per_token == {"draft_kv": 114688}
  assert mem.ratio_to_target == pytest.approx(262144 / 147456)  # 1.778: seed's "1.77x"
  with pytest.raises(ValueError, match="needs a draft model"):
    kv_memory.method_memory(make_method("draft_model", 4), SHAPES["qwen3-8b"])


def test_host_methods_and_heads():
  cfg = SHAPES["llama3-8b"]
  assert kv_memory.method_memory(make_method("ngram", 4), cfg).ratio_to_target == 1.0
  fused = kv_memory.method_memory(make_method("eagle3", 4, feature_layers=(2, 16, 29)), cfg)
  assert fused.extra_per_token == {"device_features": 3 * 4096 * 2}  # bf16 features per token
  assert fused.device_per_token == 131072 + 3 * 4096 * 2 and not fused.extra_per_sequence
  head = kv_memory.method_memory(make_method("eagle3", 4, feature_layers=(2, 16, 29),
                                             fused=False), cfg)
  assert head.device_per_token == 131072
  assert head.extra_per_sequence == {"host_features": 64 * 3 * 4096 * 4}
  suffix_like = types.SimpleNamespace(
      name="suffix_like", capabilities=make_method("ngram", 4).capabilities,
      describe=lambda: {"method": "suffix_like", "max_depth": 24})
  mem = kv_memory.method_memory(suffix_like, cfg)
  assert mem.extra_per_token == {"host_suffix_tree": 24 * kv_memory.SUFFIX_NODE_BYTES}
  assert mem.device_per_token == 131072  # host memory is not device KV
  with pytest.raises(ValueError, match="dtype='int4' must be one of"):
    kv_memory.target_kv_bytes_per_token(cfg, "int4")


def test_table_and_runtime_column():
  df = kv_memory.memory_table(method_names=("ar", "draft_model"))
  row = df[(df.target == "qwen3-8b") & (df.method == "draft_model")].iloc[0]
  assert row.kv_bytes_per_token == 262144 and row.draft == "qwen3-0.6b"
  assert not ((df.target == "smollm2-135m") & (df.method == "draft_model")).any()
  runtime = types.SimpleNamespace(target=types.SimpleNamespace(config=SHAPES["llama3-8b"]),
                                  draft=types.SimpleNamespace(config=SHAPES["llama3.2-1b"]))
  # Llama-3.2-1B: 16 x 2 x 8 x 64 x 2 = 32768.
  assert kv_memory.method_kv_bytes_per_token(make_method("draft_model", 4), runtime) == 163840
  runtime.draft = None
  assert kv_memory.method_kv_bytes_per_token(make_method("ngram", 4), runtime) == 131072
