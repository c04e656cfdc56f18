"""Flax NNX decoder for the Llama family (Llama 3, Qwen2/2.5, Qwen3, Gemma 3).

One ragged call serves prefill, decode and verify:
``model(kv_caches, tokens, metadata) -> (kv_caches, ModelOutput)``. The model never
knows which speculative method runs; callers ask for hidden states by layer index, and
may run a contiguous ``layer_range`` (LayerSkip's early exit and its continuation; see
``Transformer.__call__``).
Architectures follow the HF ``transformers`` implementations (LlamaForCausalLM,
Qwen2ForCausalLM, Qwen3ForCausalLM, Gemma3ForCausalLM), which the loader tests compare
against logit for logit.

Layers are stored stacked (every parameter of ``Transformer.layers`` has a leading
``num_layers`` axis) and run with ``jax.lax.scan``, so XLA compiles one layer body per
step shape instead of ``num_layers`` unrolled copies. Where local (sliding-window) and
global layers mix (Gemma 3), the attention kernels still get the window as a static
int: the body holds both attention calls and ``lax.cond`` picks the layer's (scanning
groups of ``global_every`` unrolled layers instead compiled as slowly as the unrolled
model and ran 35 % slower on CPU). The KV caches of all layers are one array
(``init_kv_caches``) that the scan carries and updates in place.

The price: each scanned layer slices its weights out of the stack and XLA's CPU backend
materializes that slice before the matmul (GPU too, unless XLA fuses dynamic slices into
its GEMMs), so a step also writes and re-reads one copy of each layer's weights. On a
2-core CPU this cost nothing measurable for SmolLM2-135M (14 MB per f32 layer, cache
sized) but doubled the decode step of Gemma-3-1B-sized f32 layers (108 MB each).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.config import ModelConfig
from models.layers import activation, apply_rope, project, rms_norm, rope_inv_freq
from pallas_kernels.paged_attention import (
  kv_cache_shape,
  paged_attention,
  query_positions,
  write_kv,
)
from pallas_kernels.paged_attention.metadata import AttentionMetadata

__all__ = [
    "DecoderLayer",
    "ModelOutput",
    "StackedDecoderLayers",
    "TensorParallel",
    "Transformer",
    "init_kv_caches",
    "kv_cache_heads",
    "unstack_layer_params",
]


class ModelOutput(NamedTuple):
  """``logits``: ``f32[B, R, V]`` at the requested rows; ``hidden``: tuple of ``[B, T, D]``.

  ``hidden[i]`` is HF's ``hidden_states[hidden_layers[i]]``: index 0 is the embedding
  output, index ``j`` the output of layer ``j - 1``, index ``num_layers`` the final
  normalized state fed to the LM head. With ``layer_range=(start, stop)`` the logits
  are the LM head of the final norm of layer ``stop - 1``'s output, and index ``stop <
  num_layers`` is that output before the norm (what a continuation call takes).
  """

  logits: jax.Array
  hidden: tuple[jax.Array, ...]


@dataclasses.dataclass(frozen=True)
class TensorParallel:
  """How a ``Transformer``'s attention is partitioned over one mesh axis (static).

  Set on a model by ``specjax.sharding.shard_model`` (``model.tensor_parallel``), which
  also places the weights column/row-parallel on ``axis``; the model then runs each
  layer's KV write and paged attention under ``jax.shard_map`` over ``axis``: every
  device gets ``N / m`` query heads and the ``K' / m`` KV heads they read (``m`` the
  axis size, ``K'`` the cache's KV heads). Everything else is left to GSPMD, which
  follows the weights' ``NamedSharding`` s. When ``m > K`` the cache holds each KV head
  ``m / K`` times (``K' = m``; ``specjax.sharding.kv_cache_heads``) and the step repeats
  k and v before writing them (tpu-inference does the same): the KV pool then costs
  ``m / K`` times the memory of an unreplicated one and each device projects all ``K``
  heads' k and v.

  Attributes:
    mesh: a ``jax.sharding.Mesh`` holding ``axis``.
    axis: the tensor-parallel mesh axis name.
  """

  mesh: jax.sharding.Mesh
  axis: str = "model"

  @property
  def size(self) -> int:
    return int(self.mesh.shape[self.axis])

  def heads_map(self, fn, *head_args, replicated=()):
    """``jax.shard_map(fn)`` with ``head_args`` (each ``[.., .., heads, H]``) split on
    their head axis and ``replicated`` (a pytree) whole on every device; ``fn``
    returns a tuple of head-split arrays."""
    from jax.sharding import PartitionSpec as P  # noqa: PLC0415

    heads = P(None, None, self.axis, None)

    return jax.shard_map(fn, mesh=self.mesh, in_specs=(*(heads,) * len(head_args), P()),
                         out_specs=heads, check_vma=False)(*head_args, replicated)


def _dtype(cfg: ModelConfig):
  return jnp.bfloat16 if cfg.dtype == "bfloat16" else jnp.float32


def _param(rngs: nnx.Rngs, shape, dtype, std=0.02):
  return nnx.Param(std * jax.random.normal(rngs.params(), shape, jnp.float32).astype(dtype))


def _ones(shape, dtype, zero: bool):
  return nnx.Param(jnp.zeros(shape, dtype) if zero else jnp.ones(shape, dtype))


def _layer_param_shapes(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], bool]]:
  """One layer's parameters: name -> (shape, is a norm scale), in creation order."""
  d, n, k, h, f = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                   cfg.intermediate_size)
  shapes = {"attn_norm": ((d,), True), "q": ((d, n, h), False), "k": ((d, k, h), False),
            "v": ((d, k, h), False), "o": ((n, h, d), False)}
  if cfg.attention_bias:
    shapes.update(q_bias=((n, h), False), k_bias=((k, h), False), v_bias=((k, h), False))
  if cfg.qk_norm:
    shapes.update(q_norm=((h,), True), k_norm=((h,), True))
  if cfg.sandwich_norms:
    shapes.update(post_attn_norm=((d,), True), post_ffn_norm=((d,), True))
  shapes.update(ffn_norm=((d,), True), gate=((d, f), False), up=((d, f), False),
                down=((f, d), False))
  return shapes


def _init_layer_params(module: nnx.Module, cfg: ModelConfig, rngs: nnx.Rngs, lead=()) -> None:
  """Sets one layer's parameters on ``module``, each with leading axes ``lead``."""
  dt = _dtype(cfg)
  for name, (shape, is_norm) in _layer_param_shapes(cfg).items():
    full = (*lead, *shape)
    setattr(module, name, _ones(full, dt, cfg.norm_plus_one) if is_norm else _param(rngs, full, dt))


def _attention_config(cfg: ModelConfig, layer: int):
  """``(sliding_window, RoPE inv_freq)`` of layer ``layer`` (both static)."""
  local = cfg.is_local_layer(layer)
  inv_freq = rope_inv_freq(cfg.head_dim, cfg.layer_rope_theta(layer),
                           None if local else cfg.rope_scaling)
  return (cfg.sliding_window if local else None), inv_freq


def _decoder_block(cfg: ModelConfig, layer: int | jax.Array, p: Mapping[str, jax.Array],
                   x: jax.Array, kv_pages: jax.Array, meta: AttentionMetadata,
                   positions: jax.Array, implementation,
                   tp: TensorParallel | None = None) -> tuple[jax.Array, jax.Array]:
  """One decoder layer; ``layer`` picks the sliding window and RoPE base only.

  Args:
    cfg: the model config.
    layer: the layer index: a Python int, or a traced ``i32[]`` (inside the layer scan
      of a model with both local and global layers). Attention kernels take the window
      as a static int, so a traced index compiles the local and the global attention
      call and ``lax.cond`` runs the layer's one; its RoPE frequencies are selected.
    p: this layer's parameters by name (no leading layer axis).
    x: ``[B, T, D]`` residual stream.
    kv_pages: ``[num_pages, page_size, 2K, H]`` pool that ``meta.page_indices`` address.
    meta: page table and lengths.
    positions: ``i32[B, T]`` absolute query positions.
    implementation: paged-attention implementation(s).
    tp: None, or the ``TensorParallel`` layout: the KV write and attention then run
      under ``shard_map`` over its axis, and a pool with ``r * K`` KV heads (``r > 1``)
      gets each head's k and v ``r`` times.

  Returns:
    ``(x, kv_pages)`` after the layer.
  """
  eps, p1 = cfg.rms_norm_eps, cfg.norm_plus_one
  h_in = rms_norm(x, p["attn_norm"], eps, p1)
  q = project("BTD,DNH->BTNH", h_in, p["q"])
  k = project("BTD,DKH->BTKH", h_in, p["k"])
  v = project("BTD,DKH->BTKH", h_in, p["v"])
  if cfg.attention_bias:
    q, k, v = q + p["q_bias"], k + p["k_bias"], v + p["v_bias"]
  if cfg.qk_norm:
    q = rms_norm(q, p["q_norm"], eps, p1)
    k = rms_norm(k, p["k_norm"], eps, p1)

  def attend(window, meta, q, kv_pages):
    return paged_attention(
        q, kv_pages, meta.page_indices, meta.kv_lens, meta.q_lens, sm_scale=cfg.sm_scale,
        sliding_window=window, tree_mask=meta.tree_mask, positions=meta.positions,
        implementation=implementation,
    )

  static = isinstance(layer, (int, np.integer))
  if static:
    window, inv_freq = _attention_config(cfg, int(layer))
  else:
    local_of = [cfg.is_local_layer(i) for i in range(cfg.num_layers)]
    local = jnp.asarray(local_of)[layer]
    (window_l, inv_l), (window_g, inv_g) = (
        _attention_config(cfg, local_of.index(kind)) for kind in (True, False))
    inv_freq = jnp.where(local, inv_l, inv_g)
  q = apply_rope(q, positions, inv_freq)
  k = apply_rope(k, positions, inv_freq)
  repeat = kv_pages.shape[2] // (2 * cfg.num_kv_heads)
  if repeat > 1:  # m > K: every device holds (copies of) the one KV head its q heads read
    k, v = jnp.repeat(k, repeat, axis=2), jnp.repeat(v, repeat, axis=2)

  def write_and_attend(q, k, v, kv_pages, shared):
    meta, local = shared
    kv_pages = write_kv(kv_pages, k, v, meta.page_indices, meta.kv_lens, meta.q_lens)
    if static:
      return attend(window, meta, q, kv_pages), kv_pages
    return jax.lax.cond(local, functools.partial(attend, window_l, meta),
                        functools.partial(attend, window_g, meta), q, kv_pages), kv_pages

  shared = (meta, None if static else local)
  if tp is None:
    attn, kv_pages = write_and_attend(q, k, v, kv_pages, shared)
  else:
    attn, kv_pages = tp.heads_map(write_and_attend, q, k, v, kv_pages, replicated=shared)
  # Contract over N*H as one axis: XLA CPU turned "BTNH,NHD->BTD" into a transposing copy
  # of the whole o weight every step (slower than the matmul itself).
  out = project("BTE,ED->BTD", attn.reshape(*attn.shape[:2], -1),
                   p["o"].reshape(-1, p["o"].shape[-1]))
  if cfg.sandwich_norms:
    out = rms_norm(out, p["post_attn_norm"], eps, p1)
  x = x + out
  h_ffn = rms_norm(x, p["ffn_norm"], eps, p1)
  gate = activation(cfg.hidden_act, project("BTD,DF->BTF", h_ffn, p["gate"]))
  up = project("BTD,DF->BTF", h_ffn, p["up"])
  out = project("BTF,FD->BTD", gate * up, p["down"])
  if cfg.sandwich_norms:
    out = rms_norm(out, p["post_ffn_norm"], eps, p1)
  return x + out, kv_pages


class DecoderLayer(nnx.Module):
  """One pre-norm attention + gated MLP block (with Gemma 3 sandwich norms when configured).

  Usable on its own (e.g. a draft head's layer); the ``Transformer`` keeps its layers in
  one :class:`StackedDecoderLayers` instead. ``layer`` fixes the static attention config
  (sliding window, RoPE base) via ``cfg.is_local_layer(layer)``.
  """

  def __init__(self, cfg: ModelConfig, layer: int, rngs: nnx.Rngs):
    self.cfg, self.layer = cfg, layer
    _init_layer_params(self, cfg, rngs)

  def weights(self) -> dict[str, jax.Array]:
    """This layer's parameter values by name."""
    return {name: getattr(self, name)[...] for name in _layer_param_shapes(self.cfg)}

  def __call__(self, x, kv_pages, meta: AttentionMetadata, positions, implementation):
    """``x [B, T, D]``, one layer's ``kv_pages`` -> ``(x, kv_pages)`` (see ``_decoder_block``)."""
    return _decoder_block(self.cfg, self.layer, self.weights(), x, kv_pages, meta, positions,
                          implementation)


class StackedDecoderLayers(nnx.Module):
  """All ``num_layers`` decoder layers, each parameter stacked on a leading layer axis.

  Attribute names match :class:`DecoderLayer` (``q: [num_layers, D, N, H]``, ...).
  ``layers[i]`` returns layer ``i`` as a standalone :class:`DecoderLayer` holding copies
  of its parameters (for inspection or to seed another module; writes to it do not
  reach the stack).
  """

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    self.num_layers = cfg.num_layers
    _init_layer_params(self, cfg, rngs, lead=(cfg.num_layers,))

  def weights(self) -> dict[str, jax.Array | tuple[jax.Array, ...]]:
    """Parameter values by name: stacked arrays (leading axis ``num_layers``), or tuples
    of ``num_layers`` per-layer arrays after ``unstack_layer_params``."""
    return {name: getattr(self, name).get_value() for name in _layer_param_shapes(self.cfg)}

  def __getitem__(self, i: int) -> DecoderLayer:
    """Layer ``i`` (negative counts from the end) as a detached ``DecoderLayer``."""
    if not isinstance(i, (int, np.integer)):
      raise TypeError(f"layer index {i!r} must be an int")
    if not -self.num_layers <= i < self.num_layers:
      raise IndexError(f"layer {i=} out of range for {self.num_layers} layers")
    i = int(i) % self.num_layers
    cfg = self.cfg
    layer = nnx.eval_shape(lambda: DecoderLayer(cfg, i, nnx.Rngs(0)))
    for name, w in self.weights().items():
      setattr(layer, name, nnx.Param(w[i]))
    return layer


class Transformer(nnx.Module):
  """Decoder-only LM. Parameters are stored einsum-ready (``q: [D, N, H]``, ``o: [N, H, D]``,
  ``embed: [V, D]``, ``lm_head: [D, V]`` when untied); layer parameters carry a leading
  ``num_layers`` axis (``layers.q: [num_layers, D, N, H]``).

  ``tensor_parallel`` (a static attribute, None unless ``specjax.sharding.shard_model``
  set a ``TensorParallel``) runs the attention of every layer under ``shard_map``.
  """

  tensor_parallel: TensorParallel | None = None

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    dt = _dtype(cfg)
    self.embed = _param(rngs, (cfg.vocab_size, cfg.hidden_size), dt)
    self.layers = StackedDecoderLayers(cfg, rngs)
    self.final_norm = _ones((cfg.hidden_size,), dt, cfg.norm_plus_one)
    if not cfg.tie_word_embeddings:
      self.lm_head = _param(rngs, (cfg.hidden_size, cfg.vocab_size), dt)

  def embed_tokens(self, tokens: jax.Array) -> jax.Array:
    """``i32[B, T] -> [B, T, D]`` (Gemma scales by sqrt(D) in the parameter dtype)."""
    x = jnp.take(self.embed[...], jnp.maximum(tokens, 0), axis=0)
    if self.cfg.scale_embeddings:
      x = x * jnp.asarray(self.cfg.hidden_size**0.5, x.dtype)
    return x

  def lm_weight(self) -> jax.Array:
    """The LM head as ``[D, V]`` in the parameter dtype (the tied embedding transposed)."""
    if self.cfg.tie_word_embeddings:
      return self.embed[...].T
    return self.lm_head[...]

  def lm_logits(self, h: jax.Array) -> jax.Array:
    """Final-normed hidden ``[..., D] -> f32[..., V]``."""
    # Matmul in the parameter dtype with f32 accumulation (no f32 copy of the head); the
    # tied embedding is contracted as stored ([V, D]) so no transposed copy is made.
    if self.cfg.tie_word_embeddings:
      w = self.embed[...]
      return project("...D,VD->...V", h.astype(w.dtype), w,
                     preferred_element_type=jnp.float32)
    w = self.lm_head[...]
    return project("...D,DV->...V", h.astype(w.dtype), w, preferred_element_type=jnp.float32)

  def __call__(
      self,
      kv_caches: jax.Array,
      tokens: jax.Array | None,
      meta: AttentionMetadata,
      *,
      hidden_layers: tuple[int, ...] = (),
      logits_indices: jax.Array | None = None,
      implementation: str | tuple[str, ...] = "reference",
      layer_range: tuple[int, int] | None = None,
      hidden_states: jax.Array | None = None,
  ) -> tuple[jax.Array, ModelOutput]:
    """Runs the step, through all layers or a contiguous range of them.

    Early exit (LayerSkip): ``layer_range=(start, stop)`` (static) runs layers
    ``start, ..., stop - 1`` only and applies the shared final norm and LM head to the
    output of layer ``stop - 1``. The contract, for ``E`` in ``[1, num_layers)``:

    * Draft (exit at ``E``): ``layer_range=(0, E)``, ``hidden_layers=(E,)``. The logits
      ``f32[B, R, V]`` are the LM head of ``final_norm(h)`` where ``h [B, T, D]`` (model
      dtype) is the raw residual stream after layer ``E - 1``, returned as
      ``ModelOutput.hidden[0]`` (HF ``hidden_states[E]``). KV is written for layers
      ``[0, E)`` only.
    * Continue (verify the rest): ``layer_range=(E, num_layers)``,
      ``hidden_states=h [B, T, D]``: the residual stream of the same ``T`` query tokens
      after layer ``E - 1`` (the draft calls' ``hidden[0]`` rows, concatenated per row by
      the caller), with ``meta`` describing those tokens exactly as for a full call
      (their ``kv_lens``, ``q_lens``, positions). ``tokens`` is then ignored (may be
      None). Layers ``[E, num_layers)`` attend to and write only their own pages;
      layers ``[0, E)`` of these positions must already hold their KV (written by the
      draft calls). The result equals one full call on the same tokens: same logits,
      same KV in every layer.

    Args:
      kv_caches: ``[num_layers * num_pages, page_size, 2K, H]`` from ``init_kv_caches``
        (layer ``l``'s pages are rows ``l * num_pages`` to ``(l + 1) * num_pages - 1``);
        always all layers' caches, whatever ``layer_range``.
      tokens: ``i32[B, T]`` (padding anything; masked by ``meta.q_lens``); unused (may be
        None) when ``hidden_states`` is given.
      meta: page table and lengths (see ``specjax.batch.AttentionMetadata``).
      hidden_layers: static HF ``hidden_states`` indices to return, each in
        ``[start, stop]``: index ``j`` is the raw output of layer ``j - 1`` (``start``:
        the input of the range, 0: the embedding output), except ``j == num_layers``,
        the final-normed state.
      logits_indices: ``i32[B, R]`` token indices whose logits to compute; all T if None.
      implementation: paged-attention implementation(s).
      layer_range: static ``(start, stop)`` with ``0 <= start < stop <= num_layers``;
        None (the default) is ``(0, num_layers)`` and runs the same code.
      hidden_states: ``[B, T, D]`` in the model dtype, HF ``hidden_states[start]`` of the
        ``T`` query tokens, used instead of embedding ``tokens``; required when
        ``start > 0``.

    Returns:
      Updated caches (same shape; pages of layers outside ``layer_range`` unchanged) and
      ``ModelOutput``.

    Raises:
      ValueError: a bad ``layer_range``; a hidden layer index outside it; missing,
        misshapen or wrongly typed ``hidden_states``; ``kv_caches`` is not one array of
        this model's layers, KV heads and head dim.
    """
    cfg = self.cfg
    num_layers = cfg.num_layers
    full = (0, num_layers)
    if layer_range is None:
      layer_range = full
    if (not isinstance(layer_range, tuple) or len(layer_range) != 2
        or not all(isinstance(i, (int, np.integer)) for i in layer_range)
        or not 0 <= layer_range[0] < layer_range[1] <= num_layers):
      raise ValueError(f"{layer_range=} must be a tuple (start, stop) of ints with "
                       f"0 <= start < stop <= {num_layers=}")
    start, stop = int(layer_range[0]), int(layer_range[1])
    for i in hidden_layers:
      if not start <= i <= stop:
        raise ValueError(f"hidden layer {i=} must be in [{start}, {stop}] "
                         f"({layer_range=}, {num_layers=})")
    tp = self.tensor_parallel
    heads = 2 * kv_cache_heads(cfg, tp)
    shape = getattr(kv_caches, "shape", None)
    if (shape is None or len(shape) != 4 or shape[0] % num_layers
        or shape[2:] != (heads, cfg.head_dim)):
      raise ValueError(f"kv_caches must be one [num_layers * num_pages, page_size, "
                       f"{heads}, {cfg.head_dim}] array from init_kv_caches "
                       f"({num_layers=}); got {shape or type(kv_caches).__name__}")
    if hidden_states is None:
      if start > 0:
        raise ValueError(f"{layer_range=} starts after layer 0: pass hidden_states "
                         f"[B, T, {cfg.hidden_size}], the output of layer {start - 1}")
      x = self.embed_tokens(tokens)
    else:
      hs = getattr(hidden_states, "shape", None)
      want_t = () if tokens is None else tuple(tokens.shape)
      if (hs is None or len(hs) != 3 or hs[2] != cfg.hidden_size
          or (want_t and tuple(hs[:2]) != want_t)):
        raise ValueError(f"hidden_states must be [B, T, {cfg.hidden_size}]"
                         f"{f' with B, T = {want_t}' if want_t else ''}; got {hs}")
      if hidden_states.dtype != _dtype(cfg):
        raise ValueError(f"hidden_states.dtype={hidden_states.dtype} must be the model dtype "
                         f"{cfg.dtype}")
      x = hidden_states
    positions = meta.positions
    if positions is None:
      positions = query_positions(meta.kv_lens, meta.q_lens, x.shape[1])
    hidden = {start: x}

    # All layers' pages form one pool and layer l's pages start at row l * num_pages, so
    # the attention kernels see one array that the scan carries and updates in place
    # (slicing a layer out would copy its whole cache every step). Example: num_pages 64,
    # layer 2, page table [5, 9, -1] -> [133, 137, -1] (padding stays -1).
    num_pages = kv_caches.shape[0] // num_layers
    pool = kv_caches

    def layer_meta(layer):
      table = meta.page_indices
      table = jnp.where(table >= 0, table + layer * num_pages, -1).astype(table.dtype)
      return dataclasses.replace(meta, page_indices=table)

    stacked = self.layers.weights()
    if isinstance(stacked["q"], (tuple, list)):
      # Unrolled (``unstack_layer_params``): each layer reads its own weight arrays.
      for layer in range(start, stop):
        p = {n: w[layer] for n, w in stacked.items()}
        x, pool = _decoder_block(cfg, layer, p, x, pool, layer_meta(layer), positions,
                                 implementation, tp)
        if layer + 1 in hidden_layers and layer + 1 < num_layers:
          hidden[layer + 1] = x
      return self._head(x, stop, hidden, hidden_layers, logits_indices, pool)
    # Layer l's output is hidden_states[l + 1]; the last layer's is replaced by the final
    # norm's and the range's last layer's is x after the scan, so only outputs of layers
    # start .. stop - 2 are collected, each into its slot of a carried buffer (slot
    # len(collect) takes the other layers). Example: range (0, 4) of 6 layers with
    # hidden_layers (0, 2, 4): layer 1's output goes to slot 0, x after the scan is
    # hidden_states[4], the input hidden_states[0].
    collect = sorted({i - 1 for i in hidden_layers if start + 1 <= i <= stop - 1})
    slot_of = np.full((num_layers,), len(collect), np.int32)
    slot_of[collect] = np.arange(len(collect), dtype=np.int32)

    # A Python int layer index when every layer has the same attention config (one
    # compiled attention call), else the traced index (local/global picked per layer).
    uniform = len({cfg.is_local_layer(i) for i in range(num_layers)}) == 1

    def layer_step(carry, xs):
      x, pool, buf = carry
      layer, p = xs
      if p is None:  # a partial range: index this layer out of the whole stack
        p = {n: w[layer] for n, w in stacked.items()}
      x, pool = _decoder_block(cfg, 0 if uniform else layer, p, x, pool, layer_meta(layer),
                               positions, implementation, tp)
      if collect:
        buf = jax.lax.dynamic_update_index_in_dim(buf, x, jnp.asarray(slot_of)[layer], 0)
      return (x, pool, buf), None

    # The full range scans over the stack itself; a partial one indexes the stack in the
    # body rather than slicing [start:stop] out of it first (a copy of those layers'
    # weights every call).
    per_layer = stacked if (start, stop) == full else None
    buf = jnp.zeros((len(collect) + 1,) + x.shape, x.dtype) if collect else None
    (x, pool, buf), _ = jax.lax.scan(layer_step, (x, pool, buf),
                                     (jnp.arange(start, stop, dtype=jnp.int32), per_layer))
    for s, layer in enumerate(collect):
      hidden[layer + 1] = buf[s]

    return self._head(x, stop, hidden, hidden_layers, logits_indices, pool)

  def _head(self, x, stop, hidden, hidden_layers, logits_indices, pool):
    """Final norm, requested hidden states and logits after layer ``stop - 1``."""
    cfg = self.cfg
    normed = rms_norm(x, self.final_norm[...], cfg.rms_norm_eps, cfg.norm_plus_one)
    # hidden_states[num_layers] is the normed state (HF); an early exit's is the raw one.
    hidden[stop] = normed if stop == cfg.num_layers else x
    if logits_indices is not None:
      normed = jnp.take_along_axis(normed, logits_indices[:, :, None], axis=1)
    out = ModelOutput(self.lm_logits(normed), tuple(hidden[i] for i in hidden_layers))
    return pool, out


def unstack_layer_params(state: nnx.State) -> nnx.State:
  """Splits a ``Transformer`` state's stacked layer parameters into per-layer arrays.

  ``Transformer.__call__`` then runs its layers unrolled, each matmul reading that
  layer's own weight array. With stacked weights (the default after construction and
  loading) the layers run in one ``lax.scan``, which compiles ~5x faster but makes XLA
  copy each layer's weight slice out of the stack every step: SmolLM2-135M f32 decode on
  a 2-core CPU took 88 ms/step scanned vs 62 ms unrolled (batch 1; 183 vs 135 ms at
  batch 4), compile 2 s vs 11 s per step shape. On GPUs the copies double the weight
  traffic of a memory-bound decode step.

  Args:
    state: ``nnx.split(transformer)[1]`` (or a params sub-state of it).

  Returns:
    A new state (arrays are slices: the input state is unchanged); merge it with the
    same graphdef.

  Raises:
    ValueError: the state has no stacked ``layers`` parameters.
  """
  layers = state.get("layers") if hasattr(state, "get") else None
  if layers is None:
    raise ValueError("state has no 'layers' entry: expected nnx.split(Transformer)[1]")
  out = jax.tree_util.tree_map(lambda v: v, state,
                               is_leaf=lambda v: isinstance(v, nnx.Variable))
  for name, var in list(layers.items()):
    if isinstance(var, nnx.Variable) and not isinstance(var.get_value(), (tuple, list)):
      value = var.get_value()
      if isinstance(value, jax.ShapeDtypeStruct):  # an abstract model (nnx.eval_shape)
        parts = tuple(jax.ShapeDtypeStruct(value.shape[1:], value.dtype)
                      for _ in range(value.shape[0]))
      else:
        parts = tuple(value[i] for i in range(value.shape[0]))
      out["layers"][name] = var.replace(parts)
  return out


def kv_cache_heads(cfg: ModelConfig, tp: TensorParallel | None = None) -> int:
  """KV heads the pool stores: ``K``, or the tensor-parallel size ``m`` when ``m > K``
  (each head then stored ``m / K`` times; see ``TensorParallel``).

  Raises:
    ValueError: ``m`` and ``K`` do not divide one another, or ``N`` is not a multiple
      of ``m``.
  """
  k, m = cfg.num_kv_heads, 1 if tp is None else tp.size
  if k % m and m % k:
    raise ValueError(f"tensor-parallel size {m} and num_kv_heads={k} must divide one another")
  if cfg.num_heads % m:
    raise ValueError(f"num_heads={cfg.num_heads} must be a multiple of the tensor-parallel "
                     f"size {m}")
  return max(k, m)


def init_kv_caches(cfg: ModelConfig, num_pages: int, page_size: int, dtype=None,
                   num_kv_heads: int | None = None) -> jax.Array:
  """Zeroed paged KV caches of all layers, stacked on the page axis.

  Returns ``[num_layers * num_pages, page_size, 2K, H]``: layer ``l``'s cache, in the
  one-layer layout of ``pallas_kernels.paged_attention.kv_cache_shape``, is rows
  ``l * num_pages`` to ``(l + 1) * num_pages - 1`` (``caches.reshape(num_layers,
  num_pages, page_size, 2K, H)[l]``). One page table addresses the same page ids in
  every layer. Pass the whole array to ``Transformer.__call__`` (donated in the jitted
  steps); it is one array, not a list, so the layer scan updates it in place.
  ``num_kv_heads`` overrides ``K`` (``kv_cache_heads`` of a tensor-parallel model).
  """
  shape = kv_cache_shape(num_pages, page_size, num_kv_heads or cfg.num_kv_heads, cfg.head_dim)
  return jnp.zeros((cfg.num_layers * shape[0], *shape[1:]), dtype or _dtype(cfg))
