"""Architecture shapes of known models by name: the one table random-weight models use.

``SHAPES["llama3-8b"]`` is the ``ModelConfig`` of Meta-Llama-3-8B (the released HF
``config.json``: layers, widths, heads, vocabulary, RoPE base and scaling, context,
tied or untied head), with no tokenizer ids. ``models.zoo.load_model("random:<name>")``
builds one with random weights; the step benchmarks time them. ``param_count`` counts a
config's parameters without allocating any.

Every shape's ``dtype`` is "bfloat16" (the released checkpoints' dtype) except ``tiny``
("float32", a CPU test size); loaders override it with the dtype they are asked for.
"""

from __future__ import annotations

from models.config import ModelConfig

__all__ = ["SHAPES", "param_count"]

# Llama 3.1+ "llama3" RoPE scaling, as HF's rope_scaling items (sorted by key).
_LLAMA31_ROPE = (("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
                 ("original_max_position_embeddings", 8192.0), ("rope_type", "llama3"))
_LLAMA32_ROPE = (("factor", 32.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
                 ("original_max_position_embeddings", 8192.0), ("rope_type", "llama3"))

_LLAMA = {"family": "llama", "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "dtype": "bfloat16"}
_QWEN25 = {"family": "qwen2", "vocab_size": 151936, "num_kv_heads": 2, "attention_bias": True,
           "tie_word_embeddings": True, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
           "max_position_embeddings": 32768, "dtype": "bfloat16"}

SHAPES: dict[str, ModelConfig] = {
    # Meta-Llama-3-8B: 8.03e9 parameters.
    "llama3-8b": ModelConfig(
        **_LLAMA, vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=8192,
        tie_word_embeddings=False),
    # Llama-3.3-70B-Instruct: 7.06e10 parameters.
    "llama3.3-70b": ModelConfig(
        **_LLAMA, vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80,
        num_heads=64, num_kv_heads=8, head_dim=128, max_position_embeddings=131072,
        rope_scaling=_LLAMA31_ROPE, tie_word_embeddings=False),
    # Llama-3.2-1B: 1.24e9 parameters (tied embeddings).
    "llama3.2-1b": ModelConfig(
        **_LLAMA, vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
        num_heads=32, num_kv_heads=8, head_dim=64, max_position_embeddings=131072,
        rope_scaling=_LLAMA32_ROPE, tie_word_embeddings=True),
    # SmolLM2-135M(-Instruct): 1.35e8 parameters.
    "smollm2-135m": ModelConfig(
        family="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
        num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
        max_position_embeddings=8192, tie_word_embeddings=True, dtype="bfloat16"),
    # Qwen2.5-Coder-1.5B(-Instruct): 1.54e9 parameters.
    "qwen2.5-coder-1.5b": ModelConfig(
        **_QWEN25, hidden_size=1536, intermediate_size=8960, num_layers=28, num_heads=12,
        head_dim=128),
    # Qwen2.5-Coder-0.5B(-Instruct): 4.94e8 parameters.
    "qwen2.5-coder-0.5b": ModelConfig(
        **_QWEN25, hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14,
        head_dim=64),
    # Qwen3-8B: 8.19e9 parameters (HF config.json: q/k RMSNorm, untied head).
    "qwen3-8b": ModelConfig(
        family="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
        num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6,
        rope_theta=1e6, max_position_embeddings=40960, tie_word_embeddings=False,
        qk_norm=True, dtype="bfloat16"),
    # Qwen3-0.6B: 5.96e8 parameters (tied embeddings); the seed paper's draft for Qwen3-8B.
    "qwen3-0.6b": ModelConfig(
        family="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
        num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6,
        rope_theta=1e6, max_position_embeddings=40960, tie_word_embeddings=True,
        qk_norm=True, dtype="bfloat16"),
    # A CPU-test size (f32): 2 layers, D 64, V 512; 1.07e5 parameters.
    "tiny": ModelConfig(
        family="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16),
}


def param_count(cfg: ModelConfig) -> int:
  """Number of parameters of a ``models.llama.Transformer`` with config ``cfg``.

  Counted from the shapes (nothing is allocated): embedding ``V*D``, untied LM head
  ``D*V``, final norm ``D``, and per layer q/k/v/o ``D*N*H + 2*D*K*H + N*H*D``, gate/up/down
  ``3*D*F``, two norms ``2*D`` (four with ``sandwich_norms``), q/k/v biases
  ``(N + 2K)*H`` with ``attention_bias`` and q/k norms ``2H`` with ``qk_norm``.
  Example: ``SHAPES["llama3-8b"]`` has 8,030,261,248.
  """
  d, f, n, k, h = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
                   cfg.head_dim)
  layer = 2 * d * n * h + 2 * d * k * h + 3 * d * f + 2 * d
  if cfg.sandwich_norms:
    layer += 2 * d
  if cfg.attention_bias:
    layer += (n + 2 * k) * h
  if cfg.qk_norm:
    layer += 2 * h
  head = 0 if cfg.tie_word_embeddings else d * cfg.vocab_size
  return cfg.vocab_size * d + head + d + cfg.num_layers * layer
