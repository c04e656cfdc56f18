"""Bytes one decode step must read: the HBM roofline of a step.

A decode step streams every weight once (embedding rows are gathered, not streamed) and
reads the KV cache of every row; at batch sizes where the step is bandwidth-bound its
time is at least ``step_read_bytes / read bandwidth``. Used by ``benchmarks.step_cost``
and ``harness.engine_loop`` for their ``roofline_ms`` columns.
"""

from __future__ import annotations

from models.config import ModelConfig

__all__ = ["kv_read_bytes", "step_read_bytes", "weight_read_bytes"]


def _itemsize(cfg: ModelConfig) -> int:
  return 2 if cfg.dtype == "bfloat16" else 4


def weight_read_bytes(cfg: ModelConfig, batch: int) -> int:
  """Bytes of weights one step reads (``batch`` embedding rows gathered, the rest streamed).

  Counts q/k/v/o, gate/up/down and both norms per layer, the final norm and the LM head
  (``d * vocab``) at the model's dtype (2 bytes for bfloat16, else 4).
  """
  d, f, n, k, h, v = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
                      cfg.head_dim, cfg.vocab_size)
  per_layer = d * n * h * 2 + d * k * h * 2 + 3 * d * f + 2 * d
  return _itemsize(cfg) * (cfg.num_layers * per_layer + d * v + d + batch * d)


def kv_read_bytes(cfg: ModelConfig, batch: int, context: int) -> int:
  """Bytes of K and V one step reads: ``batch`` rows of ``context`` tokens, every layer."""
  return _itemsize(cfg) * batch * context * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim


def step_read_bytes(cfg: ModelConfig, batch: int, context: int) -> int:
  """``weight_read_bytes + kv_read_bytes``: the step's roofline numerator (bytes)."""
  return weight_read_bytes(cfg, batch) + kv_read_bytes(cfg, batch, context)
