"""Flax NNX decoder for the Llama family (Llama 3, Qwen2/2.5, Qwen3, Gemma 3).

One ragged call serves prefill, decode and verify:
``model(kv_caches, tokens, metadata) -> (kv_caches, ModelOutput)``. The model never
knows which speculative method runs; callers ask for hidden states by layer index.
Architectures follow the HF ``transformers`` implementations (LlamaForCausalLM,
Qwen2ForCausalLM, Qwen3ForCausalLM, Gemma3ForCausalLM), which the loader tests compare
against logit for logit.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import ModelConfig
from models.layers import activation, apply_rope, rms_norm, rope_inv_freq
from pallas_kernels.paged_attention import kv_cache_shape, paged_attention, query_positions, write_kv
from specjax.batch import AttentionMetadata

__all__ = ["ModelOutput", "Transformer", "init_kv_caches"]

_List = getattr(nnx, "List", list)


class ModelOutput(NamedTuple):
  """``logits``: ``f32[B, R, V]`` at the requested rows; ``hidden``: tuple of ``[B, T, D]``.

  ``hidden[i]`` is HF's ``hidden_states[hidden_layers[i]]``: index 0 is the embedding
  output, index ``j`` the output of layer ``j - 1``, index ``num_layers`` the final
  normalized state fed to the LM head.
  """

  logits: jax.Array
  hidden: tuple[jax.Array, ...]


def _dtype(cfg: ModelConfig):
  return jnp.bfloat16 if cfg.dtype == "bfloat16" else jnp.float32


def _param(rngs: nnx.Rngs, shape, dtype, std=0.02):
  return nnx.Param(std * jax.random.normal(rngs.params(), shape, jnp.float32).astype(dtype))


def _ones(shape, dtype, zero: bool):
  return nnx.Param(jnp.zeros(shape, dtype) if zero else jnp.ones(shape, dtype))


class DecoderLayer(nnx.Module):
  """Pre-norm attention + gated MLP block (with Gemma 3 sandwich norms when configured)."""

  def __init__(self, cfg: ModelConfig, layer: int, rngs: nnx.Rngs):
    d, n, k, h, f = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                     cfg.intermediate_size)
    dt = _dtype(cfg)
    zero = cfg.norm_plus_one
    self.cfg, self.layer = cfg, layer
    self.attn_norm = _ones((d,), dt, zero)
    self.q = _param(rngs, (d, n, h), dt)
    self.k = _param(rngs, (d, k, h), dt)
    self.v = _param(rngs, (d, k, h), dt)
    self.o = _param(rngs, (n, h, d), dt)
    if cfg.attention_bias:
      self.q_bias = _param(rngs, (n, h), dt)
      self.k_bias = _param(rngs, (k, h), dt)
      self.v_bias = _param(rngs, (k, h), dt)
    if cfg.qk_norm:
      self.q_norm = _ones((h,), dt, zero)
      self.k_norm = _ones((h,), dt, zero)
    if cfg.sandwich_norms:
      self.post_attn_norm = _ones((d,), dt, zero)
      self.post_ffn_norm = _ones((d,), dt, zero)
    self.ffn_norm = _ones((d,), dt, zero)
    self.gate = _param(rngs, (d, f), dt)
    self.up = _param(rngs, (d, f), dt)
    self.down = _param(rngs, (f, d), dt)

  def __call__(self, x, kv_pages, meta: AttentionMetadata, positions, implementation):
    cfg = self.cfg
    eps, p1 = cfg.rms_norm_eps, cfg.norm_plus_one
    h_in = rms_norm(x, self.attn_norm[...], eps, p1)
    q = jnp.einsum("BTD,DNH->BTNH", h_in, self.q[...])
    k = jnp.einsum("BTD,DKH->BTKH", h_in, self.k[...])
    v = jnp.einsum("BTD,DKH->BTKH", h_in, self.v[...])
    if cfg.attention_bias:
      q, k, v = q + self.q_bias[...], k + self.k_bias[...], v + self.v_bias[...]
    if cfg.qk_norm:
      q = rms_norm(q, self.q_norm[...], eps, p1)
      k = rms_norm(k, self.k_norm[...], eps, p1)
    inv_freq = rope_inv_freq(cfg.head_dim, cfg.layer_rope_theta(self.layer),
                             cfg.rope_scaling if not cfg.is_local_layer(self.layer) else None)
    q = apply_rope(q, positions, inv_freq)
    k = apply_rope(k, positions, inv_freq)
    kv_pages = write_kv(kv_pages, k, v, meta.page_indices, meta.kv_lens, meta.q_lens)
    window = cfg.sliding_window if cfg.is_local_layer(self.layer) else None
    attn = paged_attention(
        q, kv_pages, meta.page_indices, meta.kv_lens, meta.q_lens,
        sm_scale=cfg.sm_scale, sliding_window=window, tree_mask=meta.tree_mask,
        implementation=implementation,
    )
    out = jnp.einsum("BTNH,NHD->BTD", attn, self.o[...])
    if cfg.sandwich_norms:
      out = rms_norm(out, self.post_attn_norm[...], eps, p1)
    x = x + out
    h_ffn = rms_norm(x, self.ffn_norm[...], eps, p1)
    gate = activation(cfg.hidden_act, jnp.einsum("BTD,DF->BTF", h_ffn, self.gate[...]))
    up = jnp.einsum("BTD,DF->BTF", h_ffn, self.up[...])
    out = jnp.einsum("BTF,FD->BTD", gate * up, self.down[...])
    if cfg.sandwich_norms:
      out = rms_norm(out, self.post_ffn_norm[...], eps, p1)
    return x + out, kv_pages


class Transformer(nnx.Module):
  """Decoder-only LM. Parameters are stored einsum-ready (``q: [D, N, H]``, ``o: [N, H, D]``,
  ``embed: [V, D]``, ``lm_head: [D, V]`` when untied)."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    dt = _dtype(cfg)
    self.embed = _param(rngs, (cfg.vocab_size, cfg.hidden_size), dt)
    self.layers = _List([DecoderLayer(cfg, i, rngs) for i in range(cfg.num_layers)])
    self.final_norm = _ones((cfg.hidden_size,), dt, cfg.norm_plus_one)
    if not cfg.tie_word_embeddings:
      self.lm_head = _param(rngs, (cfg.hidden_size, cfg.vocab_size), dt)

  def embed_tokens(self, tokens: jax.Array) -> jax.Array:
    """``i32[B, T] -> [B, T, D]`` (Gemma scales by sqrt(D) in the parameter dtype)."""
    x = jnp.take(self.embed[...], jnp.maximum(tokens, 0), axis=0)
    if self.cfg.scale_embeddings:
      x = x * jnp.asarray(self.cfg.hidden_size**0.5, x.dtype)
    return x

  def lm_logits(self, h: jax.Array) -> jax.Array:
    """Final-normed hidden ``[..., D] -> f32[..., V]``."""
    # Matmul in the parameter dtype with f32 accumulation (no f32 copy of the head); the
    # tied embedding is contracted as stored ([V, D]) so no transposed copy is made.
    if self.cfg.tie_word_embeddings:
      w = self.embed[...]
      return jnp.einsum("...D,VD->...V", h.astype(w.dtype), w, preferred_element_type=jnp.float32)
    w = self.lm_head[...]
    return jnp.einsum("...D,DV->...V", h.astype(w.dtype), w, preferred_element_type=jnp.float32)

  def __call__(
      self,
      kv_caches: list[jax.Array],
      tokens: jax.Array,
      meta: AttentionMetadata,
      *,
      hidden_layers: tuple[int, ...] = (),
      logits_indices: jax.Array | None = None,
      implementation: str | tuple[str, ...] = "reference",
  ) -> tuple[list[jax.Array], ModelOutput]:
    """Runs the step.

    Args:
      kv_caches: one ``[num_pages, page_size, 2K, H]`` array per layer.
      tokens: ``i32[B, T]`` (padding anything; masked by ``meta.q_lens``).
      meta: page table and lengths (see ``specjax.batch.AttentionMetadata``).
      hidden_layers: static HF ``hidden_states`` indices to return.
      logits_indices: ``i32[B, R]`` token indices whose logits to compute; all T if None.
      implementation: paged-attention implementation(s).

    Returns:
      Updated caches and ``ModelOutput``.
    """
    cfg = self.cfg
    for i in hidden_layers:
      if not 0 <= i <= cfg.num_layers:
        raise ValueError(f"hidden layer {i=} must be in [0, {cfg.num_layers}]")
    positions = query_positions(meta.kv_lens, meta.q_lens, tokens.shape[1])
    x = self.embed_tokens(tokens)
    hidden = {0: x}
    new_caches = []
    for i, layer in enumerate(self.layers):
      x, cache = layer(x, kv_caches[i], meta, positions, implementation)
      new_caches.append(cache)
      hidden[i + 1] = x
    x = rms_norm(x, self.final_norm[...], cfg.rms_norm_eps, cfg.norm_plus_one)
    hidden[cfg.num_layers] = x
    if logits_indices is not None:
      x = jnp.take_along_axis(x, logits_indices[:, :, None], axis=1)
    logits = self.lm_logits(x)
    return new_caches, ModelOutput(logits, tuple(hidden[i] for i in hidden_layers))


def init_kv_caches(cfg: ModelConfig, num_pages: int, page_size: int, dtype=None) -> list[jax.Array]:
  """Zeroed paged KV caches, one per layer (layout from ``kv_cache_shape``)."""
  shape = kv_cache_shape(num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
  return [jnp.zeros(shape, dtype or _dtype(cfg)) for _ in range(cfg.num_layers)]
