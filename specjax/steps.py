"""Jitted device step functions: the target forward, the shared verification and the
KV/hidden-state fix-ups after tree verification.

Hot-loop steps are plain ``jax.jit`` functions over ``(params, kv_caches, batch)``
with the caches donated; the NNX module is split once at load (``split_model``).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from models.llama import unstack_layer_params
from pallas_kernels.paged_attention import copy_kv
from pallas_kernels.paged_attention.metadata import AttentionMetadata
from specjax.verify import fused_rejection_sample, rejection_sample, tree_rejection_sample

__all__ = ["SplitModel", "split_model", "forward_step", "fused_verify_step", "gather_rows",
           "move_kv_step", "tree_verify_step", "verify_step"]


class SplitModel(NamedTuple):
  """A model split once for jitted steps: static ``graphdef`` + ``params`` pytree."""

  config: Any
  graphdef: Any
  params: Any


def split_model(model: nnx.Module, unroll_layers: bool = True) -> SplitModel:
  """Splits ``model`` once for the jitted steps.

  Args:
    model: a ``models.llama.Transformer``.
    unroll_layers: give each layer its own weight arrays so the step runs its layers
      unrolled (faster steps, slower compiles; see ``models.llama.unstack_layer_params``);
      False keeps the stacked weights and the layer scan.
  """
  graphdef, params = nnx.split(model)
  if unroll_layers:
    params = unstack_layer_params(params)
  return SplitModel(model.cfg, graphdef, params)


@functools.partial(
    jax.jit,
    static_argnames=("graphdef", "hidden_layers", "implementation"),
    donate_argnames=("kv_caches",),
)
def forward_step(
    graphdef,
    params,
    kv_caches,
    tokens: jax.Array,
    meta: AttentionMetadata,
    logits_indices: jax.Array,
    *,
    hidden_layers: tuple[int, ...] = (),
    implementation: str | tuple[str, ...] = "reference",
):
  """One ragged model call (prefill chunk, decode, or verify).

  Args:
    graphdef, params: from ``split_model``.
    kv_caches: per-layer paged KV (donated).
    tokens: ``i32[B, T]``.
    meta: ``AttentionMetadata`` of the padded batch.
    logits_indices: ``i32[B, R]`` rows of T whose logits are returned.

  Returns:
    ``(kv_caches, logits f32[B, R, V], hidden tuple of [B, T, D])``.
  """
  model = nnx.merge(graphdef, params)
  kv_caches, out = model(
      kv_caches, tokens, meta, hidden_layers=hidden_layers, logits_indices=logits_indices,
      implementation=implementation,
  )
  return kv_caches, out.logits, out.hidden


verify_step = jax.jit(rejection_sample, static_argnames=("all_greedy",))
fused_verify_step = jax.jit(fused_rejection_sample, static_argnames=("implementation",
                                                                     "interpret"))
tree_verify_step = jax.jit(tree_rejection_sample, static_argnames=("all_greedy",))


@functools.partial(jax.jit, static_argnames=("num_layers",), donate_argnames=("kv_caches",))
def move_kv_step(kv_caches, page_indices, src_positions, dst_positions, *, num_layers: int):
  """Copies KV positions ``src -> dst`` of every row in every layer (tree paths).

  Args:
    kv_caches: ``[num_layers * num_pages, page_size, 2K, H]`` (``init_kv_caches``), donated.
    page_indices: ``i32[B, pages_per_seq]``, -1 padded (the same ids in every layer).
    src_positions, dst_positions: ``i32[B, M]``, -1 = no copy.
    num_layers: static.

  Returns:
    The updated caches. Layer l's pages are rows ``l * num_pages ..`` of the one array,
    so the copy runs once over ``num_layers * B`` rows whose tables are offset by
    ``l * num_pages`` (e.g. num_pages 64, layer 2: page 5 -> 133; -1 stays -1).
  """
  num_pages = kv_caches.shape[0] // num_layers
  offsets = (jnp.arange(num_layers, dtype=page_indices.dtype) * num_pages)[:, None, None]
  tables = jnp.where(page_indices[None] >= 0, page_indices[None] + offsets, -1)
  flat = lambda x: x.reshape(-1, x.shape[-1])
  tile = lambda x: flat(jnp.broadcast_to(x[None], (num_layers, *x.shape)))
  return copy_kv(kv_caches, flat(tables), tile(src_positions), tile(dst_positions))


@jax.jit
def gather_rows(hidden: tuple, rows: jax.Array) -> tuple:
  """``hidden`` tuple of ``[B, T, D]`` -> the same with ``out[b, i] = h[b, rows[b, i]]``
  (``rows i32[B, T]``); puts a tree path's hidden states in commit order."""
  return tuple(jnp.take_along_axis(h, rows[:, :, None], axis=1) for h in hidden)
