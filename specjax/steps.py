"""Jitted device step functions: the target forward and the shared verification.

Hot-loop steps are plain ``jax.jit`` functions over ``(params, kv_caches, batch)``
with the caches donated; the NNX module is split once at load (``split_model``).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
from flax import nnx

from models.llama import unstack_layer_params
from specjax.batch import AttentionMetadata
from specjax.verify import rejection_sample

__all__ = ["SplitModel", "split_model", "forward_step", "verify_step"]


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
