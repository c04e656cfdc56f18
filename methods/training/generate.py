"""Greedy generation for training data: one jitted device loop per batch.

``regenerate`` needs tens of thousands of greedy target responses; the engine's host
scheduler spends its time per step and per request, which dominates for a small target at
a large batch. Here a fixed batch is prefilled once and decoded by a ``lax.fori_loop``
on the device (dense page table: row b owns pages ``b * P .. b * P + P - 1``), with the
same model call and the same greedy rule as the engine's AR steps; ``tests/methods/
test_generate.py`` checks the tokens equal the engine's (method "ar", f32).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.llama import init_kv_caches
from pallas_kernels.paged_attention.metadata import AttentionMetadata

__all__ = ["greedy_generate"]

_PAGE = 16


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "width"))
def _greedy_loop(graphdef, params, prompts, prompt_lens, eos_ids, *, max_new_tokens, width):
  """``prompts i32[B, P]`` right-padded -> ``(out i32[B, max_new_tokens], num i32[B])``.

  ``width`` (a multiple of the page size, >= P + max_new_tokens) is the KV capacity per
  row; ``eos_ids i32[E]`` (E >= 1, -1 = none) end a row after that token is emitted.
  """
  model = nnx.merge(graphdef, params)
  batch = prompts.shape[0]
  pages = width // _PAGE
  caches = init_kv_caches(model.cfg, batch * pages, _PAGE)
  table = jnp.arange(batch * pages, dtype=jnp.int32).reshape(batch, pages)
  caches, out = model(caches, prompts, AttentionMetadata(table, prompt_lens, prompt_lens),
                      logits_indices=(prompt_lens - 1)[:, None])
  first = jnp.argmax(out.logits[:, 0], -1).astype(jnp.int32)

  def body(i, carry):
    caches, tok, toks, num, done = carry
    toks = toks.at[:, i].set(jnp.where(done, 0, tok))
    num = num + (~done).astype(jnp.int32)
    done = done | jnp.any(tok[:, None] == eos_ids[None], -1)
    meta = AttentionMetadata(table, prompt_lens + i + 1, jnp.ones_like(prompt_lens))
    caches, o = model(caches, tok[:, None], meta, logits_indices=jnp.zeros((batch, 1), jnp.int32))
    return caches, jnp.argmax(o.logits[:, 0], -1).astype(jnp.int32), toks, num, done

  init = (caches, first, jnp.zeros((batch, max_new_tokens), jnp.int32),
          jnp.zeros((batch,), jnp.int32), jnp.zeros((batch,), bool))
  # The last iteration's forward is wasted; it keeps the loop body uniform.
  _, _, toks, num, _ = jax.lax.fori_loop(0, max_new_tokens, body, init)
  return toks, num


def greedy_generate(target, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                    eos_token_ids: Sequence[int] = (), batch_size: int = 64,
                    progress: Callable[[int], object] | None = None) -> list[list[int]]:
  """Greedy responses (the EOS token included when emitted), ``batch_size`` rows at a time.

  Args:
    target: a ``SplitModel`` (``specjax.steps.split_model``) or a ``Transformer``.
    prompts: token ids, each non-empty.
    max_new_tokens: response budget (>= 1).
    eos_token_ids: a row ends after emitting one of these.
    batch_size: rows per device loop; the last batch is padded, so every batch has one
      compiled shape.
    progress: optional callable, given the number of prompts done after each batch.

  Returns:
    One list of generated token ids per prompt, in order.

  Raises:
    ValueError: an empty prompt, or ``max_new_tokens`` / ``batch_size`` < 1.
  """
  if max_new_tokens < 1 or batch_size < 1:
    raise ValueError(f"{max_new_tokens=} and {batch_size=} must be >= 1")
  if any(len(p) == 0 for p in prompts):
    raise ValueError("every prompt must have at least one token")
  if hasattr(target, "graphdef"):
    graphdef, params = target.graphdef, target.params
  else:
    graphdef, params = nnx.split(target)
  width_p = _PAGE * math.ceil(max(len(p) for p in prompts) / _PAGE)
  width = _PAGE * math.ceil((width_p + max_new_tokens) / _PAGE)
  eos = np.asarray(list(eos_token_ids) or [-1], np.int32)
  out: list[list[int]] = []
  for start in range(0, len(prompts), batch_size):
    chunk = prompts[start:start + batch_size]
    toks = np.zeros((batch_size, width_p), np.int32)
    lens = np.ones(batch_size, np.int32)  # padding rows: one token
    for i, p in enumerate(chunk):
      toks[i, : len(p)] = p
      lens[i] = len(p)
    gen, num = _greedy_loop(graphdef, params, toks, lens, eos,
                            max_new_tokens=max_new_tokens, width=width)
    gen, num = np.asarray(gen), np.asarray(num)
    out.extend(gen[i, : num[i]].tolist() for i in range(len(chunk)))
    if progress is not None:
      progress(len(chunk))
  return out
