"""Tiny models and paged-KV helpers for tests (f32, CPU-sized).

``tiny_config(family)`` gives a few-layer config per family; ``random_model`` fills a
``Transformer`` with well-scaled random weights (norm scales and biases too, so a wrong
mapping shows up in the logits). ``PagedKV`` is a host-side paged cache for one batch:
pages come from a random permutation of the pool as the rows grow, every page starts
filled with NaN, and one page-table column always stays -1 (padding), so a kernel that
reads a slot it should not turns the result into NaN. ``full_forward`` is the uncached
reference: one prefill of the whole sequence.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.config import FAMILIES, ModelConfig
from models.llama import ModelOutput, Transformer, init_kv_caches
from pallas_kernels.paged_attention.metadata import AttentionMetadata

__all__ = [
    "TINY_LLAMA3_ROPE_SCALING",
    "chi_square_pvalue",
    "PagedKV",
    "full_forward",
    "random_model",
    "run_step",
    "tiny_config",
]

# Llama 3.1 "llama3" RoPE scaling with a small original context so the tiny model's
# low-, mid- and high-frequency bands are all touched (H = 8 gives 4 frequencies).
TINY_LLAMA3_ROPE_SCALING = (
    ("factor", 8.0),
    ("high_freq_factor", 4.0),
    ("low_freq_factor", 1.0),
    ("original_max_position_embeddings", 64.0),
    ("rope_type", "llama3"),
)

_TINY_BASE = {
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 8,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_ids": (2,),
}

_TINY_FAMILY = {
    "llama": {},
    "qwen2": {"attention_bias": True, "tie_word_embeddings": True},
    "qwen3": {"qk_norm": True},
    # Layer 0 is local (window 4, RoPE base 100), layer 1 global (base 10000).
    "gemma3": {
        "qk_norm": True, "sandwich_norms": True, "norm_plus_one": True,
        "scale_embeddings": True, "hidden_act": "gelu_tanh", "query_pre_attn_scalar": 16.0,
        "sliding_window": 4, "global_every": 2, "rope_local_theta": 100.0,
        "tie_word_embeddings": True,
    },
}


def tiny_config(family: str = "llama", **overrides) -> ModelConfig:
  """A 2-layer config of ``family`` (D=32, N=4, K=2, H=8, F=64, V=96), f32.

  Args:
    family: one of ``models.config.FAMILIES``.
    **overrides: any ``ModelConfig`` field.

  Raises:
    ValueError: unknown family.
  """
  if family not in _TINY_FAMILY:
    raise ValueError(f"{family=} must be one of {FAMILIES}")
  return ModelConfig(family=family, **{**_TINY_BASE, **_TINY_FAMILY[family], **overrides})


_FAN_IN_AXES = {"q": 1, "k": 1, "v": 1, "o": 2, "gate": 1, "up": 1, "down": 1, "lm_head": 1}


def random_model(cfg: ModelConfig, seed: int = 0) -> Transformer:
  """A ``Transformer`` with random weights scaled so activations stay O(1).

  Projections are ``N(0, 1/fan_in)``, embeddings ``N(0, 1)`` (``N(0, 1/D)`` when
  ``cfg.scale_embeddings``), norm scales ``1 + N(0, 0.1)`` (``N(0, 0.1)`` with
  ``norm_plus_one``), biases ``N(0, 0.1)``. Values come from numpy and the module is
  built abstractly, so nothing is compiled (eager ``jax.random`` per shape costs seconds).
  """
  rng = np.random.default_rng(seed)
  graphdef, abstract_state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0))))
  flat = dict(nnx.to_flat_state(abstract_state))
  # Layer parameters are stacked (``("layers", "q"): [num_layers, D, N, H]``); values are
  # drawn per layer in the order of ``("layers", i, "q")`` paths so seeds give the same
  # weights as when every layer was its own module.
  draws = []
  for path, var in flat.items():
    w = var.get_value()
    if path[0] == "layers":
      draws += [(("layers", i, path[1]), w.shape[1:]) for i in range(w.shape[0])]
    else:
      draws.append((path, w.shape))
  values = {}
  for path, shape in sorted(draws):
    z = rng.standard_normal(shape, dtype=np.float32)
    name = path[-1]
    if name == "embed":
      value = z / math.sqrt(cfg.hidden_size) if cfg.scale_embeddings else z
    elif name.endswith("norm"):
      value = 0.1 * z + (0.0 if cfg.norm_plus_one else 1.0)
    elif name.endswith("bias"):
      value = 0.1 * z
    else:
      fan_in = math.prod(shape[: _FAN_IN_AXES[name]])
      value = z / math.sqrt(fan_in)
    values[path] = value
  new = {}
  for path, var in flat.items():
    w = var.get_value()
    if path[0] == "layers":
      value = np.stack([values["layers", i, path[1]] for i in range(w.shape[0])])
    else:
      value = values[path]
    new[path] = var.replace(jnp.asarray(np.asarray(value, w.dtype)))
  return nnx.merge(graphdef, nnx.from_flat_state(new))


def varied_model(cfg: ModelConfig | None = None, seed: int = 3, scale: float = 3.0) -> Transformer:
  """``random_model`` (default: ``tiny_config("llama")``, seed 3) with every attention
  output projection and the LM head multiplied by ``scale``: sharper logits, so greedy
  text varies instead of repeating one token (the tiny target of the method tests)."""
  model = random_model(cfg or tiny_config("llama"), seed=seed)
  state = nnx.state(model, nnx.Param)
  for path, var in nnx.to_flat_state(state):
    if path[-1] in ("o", "lm_head"):
      var.set_value(var.get_value() * scale)
  nnx.update(model, state)
  return model


@functools.partial(jax.jit, static_argnames=("graphdef", "hidden_layers", "layer_range"))
def _step(graphdef, state, caches, tokens, meta, hidden_layers, layer_range, hidden_states):
  model = nnx.merge(graphdef, state)
  return model(caches, tokens, meta, hidden_layers=hidden_layers, layer_range=layer_range,
               hidden_states=hidden_states)


def run_step(
    model: Transformer,
    caches: jax.Array,
    tokens: jax.Array | None,
    meta: AttentionMetadata,
    *,
    hidden_layers: tuple[int, ...] = (),
    layer_range: tuple[int, int] | None = None,
    hidden_states: jax.Array | None = None,
) -> tuple[jax.Array, ModelOutput]:
  """``model(caches, tokens, meta, ...)`` under one ``jax.jit`` (split once per call)."""
  graphdef, state = nnx.split(model)
  tokens = None if tokens is None else jnp.asarray(tokens, jnp.int32)
  return _step(graphdef, state, caches, tokens, meta, hidden_layers, layer_range, hidden_states)


class PagedKV:
  """A host-side paged KV cache for one test batch.

  Attributes:
    page_size: tokens per page.
    page_indices: ``i32[B, pages_per_seq]`` numpy page table, -1 where unallocated. The
      last column is never allocated.
    kv_lens: ``i32[B]`` committed length of each row.
    caches: ``[num_layers * num_pages, page_size, 2K, H]`` (``init_kv_caches``), NaN
      where unwritten.
  """

  def __init__(
      self,
      cfg: ModelConfig,
      batch: int,
      max_len: int,
      *,
      page_size: int = 4,
      seed: int = 0,
      spare_pages: int = 2,
      fill: float = float("nan"),
  ):
    """Allocates the pool.

    Args:
      cfg: the model config (K, H, num_layers, dtype).
      batch: B.
      max_len: longest row this cache must hold.
      page_size: tokens per page.
      seed: seeds the page permutation.
      spare_pages: pool pages no row ever gets (stay ``fill``).
      fill: initial value of every slot.
    """
    if page_size < 1 or max_len < 1 or batch < 1:
      raise ValueError(f"{page_size=}, {max_len=} and {batch=} must be >= 1")
    self.page_size = page_size
    used_per_seq = math.ceil(max_len / page_size)
    num_pages = batch * used_per_seq + spare_pages
    self._free = [int(p) for p in np.random.default_rng(seed).permutation(num_pages)]
    self.page_indices = np.full((batch, used_per_seq + 1), -1, np.int32)
    self.kv_lens = np.zeros((batch,), np.int32)
    self.caches = jnp.full_like(init_kv_caches(cfg, num_pages, page_size), fill)

  def metadata(self, q_lens: Sequence[int]) -> AttentionMetadata:
    """Metadata for a step appending ``q_lens[b]`` tokens to row ``b`` (allocates pages).

    Example: page_size 4, a row holding 6 tokens (pages 0-1 allocated) that appends 3
    needs ceil(9 / 4) = 3 pages, so logical page 2 gets the next free pool page.
    """
    q_lens = np.asarray(q_lens, np.int32)
    new_lens = self.kv_lens + q_lens
    for b, n in enumerate(new_lens):
      need = math.ceil(n / self.page_size)
      if need >= self.page_indices.shape[1]:
        raise ValueError(f"row {b} would hold {n} tokens, more than this cache's max_len")
      for p in range(need):
        if self.page_indices[b, p] < 0:
          self.page_indices[b, p] = self._free.pop()
    kv_lens = np.where(q_lens > 0, new_lens, 0).astype(np.int32)
    return AttentionMetadata(
        page_indices=jnp.asarray(self.page_indices),
        kv_lens=jnp.asarray(kv_lens),
        q_lens=jnp.asarray(q_lens),
    )

  def step(
      self,
      model: Transformer,
      tokens,
      q_lens: Sequence[int],
      *,
      hidden_layers: tuple[int, ...] = (),
  ) -> ModelOutput:
    """Runs one step (``tokens i32[B, T]``, rows padded past ``q_lens``) and commits it."""
    meta = self.metadata(q_lens)
    self.caches, out = run_step(model, self.caches, tokens, meta, hidden_layers=hidden_layers)
    self.commit(q_lens)
    return out

  def commit(self, q_lens: Sequence[int]) -> None:
    """Adds ``q_lens`` to the committed lengths (after steps run on ``metadata(q_lens)``)."""
    self.kv_lens = self.kv_lens + np.asarray(q_lens, np.int32)

  def truncate(self, row: int, length: int) -> None:
    """Rolls row ``row`` back to ``length`` tokens (stale slots stay, masked by kv_lens)."""
    if not 0 <= length <= self.kv_lens[row]:
      raise ValueError(f"{length=} must be in [0, {self.kv_lens[row]}]")
    self.kv_lens[row] = length


def full_forward(
    model: Transformer,
    tokens,
    *,
    lengths: Sequence[int] | None = None,
    page_size: int = 4,
    seed: int = 0,
    hidden_layers: tuple[int, ...] = (),
) -> ModelOutput:
  """Uncached reference: one prefill into a fresh NaN-filled, randomly paged cache.

  Args:
    model: the model.
    tokens: ``i32[B, T]``; row ``b`` is real up to ``lengths[b]``.
    lengths: real tokens per row (all ``T`` if None).
    page_size: tokens per page.
    seed: seeds the page permutation.
    hidden_layers: HF ``hidden_states`` indices to return.

  Returns:
    ``ModelOutput`` with logits ``f32[B, T, V]`` (rows past ``lengths[b]`` are padding).
  """
  tokens = np.asarray(tokens, np.int32)
  batch, num_tokens = tokens.shape
  lengths = [num_tokens] * batch if lengths is None else list(lengths)
  kv = PagedKV(model.cfg, batch, num_tokens, page_size=page_size, seed=seed)
  return kv.step(model, tokens, lengths, hidden_layers=hidden_layers)


def chi_square_pvalue(counts, probs, n: int) -> float:
  """Chi-square goodness-of-fit p-value of ``counts`` against ``probs * n`` (1-D arrays
  over the same cells). Cells expecting < 5 counts are pooled with the next smallest
  cells until the pool expects >= 5 (the usual validity rule of the test). ``probs``
  must sum to 1 within 1e-4 (else ValueError) and are rescaled to sum to it exactly."""
  from scipy import stats  # noqa: PLC0415

  counts = np.asarray(counts)
  probs = np.asarray(probs, np.float64)
  total = probs.sum()
  if abs(total - 1.0) > 1e-4:
    raise ValueError(f"probs sum to {total}, not 1")
  expected = probs / total * n  # f32 sums drift by ~1e-7; scipy checks sums to ~1e-8
  order = np.argsort(expected)
  pool = 0
  while pool < len(order) and expected[order[: pool + 1]].sum() < 5:
    pool += 1
  if pool:
    pool += 1  # the cell that brings the pool to >= 5
    keep = order[pool:]
    counts = np.append(counts[keep], counts[order[:pool]].sum())
    expected = np.append(expected[keep], expected[order[:pool]].sum())
  return float(stats.chisquare(counts, expected).pvalue)
