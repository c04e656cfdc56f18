"""One frozen config dataclass for the Llama-family decoders (Llama 3, Qwen2/3, Gemma 3)."""

from __future__ import annotations

import dataclasses

__all__ = ["ModelConfig", "FAMILIES"]

FAMILIES = ("llama", "qwen2", "qwen3", "gemma3")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
  """Architecture of a decoder-only transformer.

  Attributes name the glossary axes: ``vocab_size`` V, ``hidden_size`` D,
  ``intermediate_size`` F, ``num_heads`` N, ``num_kv_heads`` K, ``head_dim`` H.
  Family switches: ``attention_bias`` (Qwen2 q/k/v bias), ``qk_norm`` (Qwen3, Gemma 3
  per-head RMSNorm), ``sandwich_norms`` (Gemma 3 post-attention/post-FFN norms),
  ``norm_plus_one`` (Gemma RMSNorm scales by 1 + w), ``scale_embeddings`` (Gemma:
  embeddings times sqrt(D)), ``sliding_window`` with ``global_every`` (Gemma 3: layers
  with ``i % global_every == global_every - 1`` are global, the others local with
  ``rope_local_theta``).
  """

  family: str
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rms_norm_eps: float = 1e-6
  rope_theta: float = 10000.0
  rope_local_theta: float | None = None
  # HF rope_parameters items of the global layers: rope_type "llama3" (Llama 3.1) or "linear".
  rope_scaling: tuple[tuple[str, float | str], ...] | None = None
  max_position_embeddings: int = 8192
  tie_word_embeddings: bool = True
  attention_bias: bool = False
  qk_norm: bool = False
  sandwich_norms: bool = False
  norm_plus_one: bool = False
  scale_embeddings: bool = False
  hidden_act: str = "silu"  # "silu" | "gelu_tanh"
  query_pre_attn_scalar: float | None = None  # scores scaled by its -1/2 (default head_dim)
  sliding_window: int | None = None
  global_every: int | None = None
  bos_token_id: int | None = None
  eos_token_ids: tuple[int, ...] = ()
  dtype: str = "float32"  # activation/parameter dtype: "float32" | "bfloat16"

  def __post_init__(self):
    if self.family not in FAMILIES:
      raise ValueError(f"family={self.family!r} must be one of {FAMILIES}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"{self.num_heads=} must be a multiple of {self.num_kv_heads=}")
    if self.hidden_act not in ("silu", "gelu_tanh"):
      raise ValueError(f"hidden_act={self.hidden_act!r} must be 'silu' or 'gelu_tanh'")
    if self.dtype not in ("float32", "bfloat16"):
      raise ValueError(f"dtype={self.dtype!r} must be 'float32' or 'bfloat16'")

  def is_local_layer(self, layer: int) -> bool:
    """True for sliding-window (local) layers."""
    if self.sliding_window is None:
      return False
    if self.global_every is None:
      return True
    return layer % self.global_every != self.global_every - 1

  def layer_rope_theta(self, layer: int) -> float:
    if self.is_local_layer(layer) and self.rope_local_theta is not None:
      return self.rope_local_theta
    return self.rope_theta

  @property
  def sm_scale(self) -> float:
    return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

  def replace(self, **kw) -> ModelConfig:
    return dataclasses.replace(self, **kw)
