"""DeepSeek-V3 multi-token prediction (MTP) head: sequential modules, one per draft depth.

Source: DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", section 2.2. Module j maps
``concat(RMSNorm(h^{j-1}_i), RMSNorm(embed(x_{i+j})))`` through a projection and one
transformer block to ``h^j_i``, which predicts ``x_{i+j+1}``; ``h^0`` is the target's
final hidden state.

Attention sees a sliding window (``models.heads.blocks``). Drafting matches training
exactly while the sequence fits the window; beyond it, module j > 1 at the window's left
edge sees lower-module states that were themselves computed from a truncated window
(training computes them with full windows), a small approximation near slot 0 that does
not affect losslessness.

Glossary: B batch, S slots / positions, W window slots, D model dim, V target vocab.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.heads.base import DraftFn, DraftHead
from models.heads.blocks import (
    HeadLayer,
    band_mask,
    normal_param,
    ones_param,
    param_norm,
    stack_steps,
    window_positions,
)
from models.layers import project

if TYPE_CHECKING:
  from models.heads.config import HeadConfig

__all__ = ["MTPHead"]


class _MTPModule(nnx.Module):
  def __init__(self, cfg: HeadConfig, rng: np.random.Generator):
    d = cfg.hidden_size
    self.cfg = cfg
    self.hidden_norm = ones_param((d,))
    self.embed_norm = ones_param((d,))
    self.proj = normal_param(rng, (2 * d, d), (2 * d) ** -0.5)
    self.attn_norm = ones_param((d,))
    self.layer = HeadLayer(cfg, d, rng)
    self.out_norm = ones_param((d,))

  def __call__(self, target, tokens, hidden, pos, valid):
    """``tokens i32[B, S]`` (x_{i+j}), ``hidden [B, S, D]`` (h^{j-1}) -> ``h^j [B, S, D]``."""
    eps = self.cfg.rms_norm_eps
    emb = target.embed_tokens(tokens).astype(jnp.float32)
    x = project("BSE,ED->BSD", jnp.concatenate(
        [param_norm(hidden, self.hidden_norm, eps), param_norm(emb, self.embed_norm, eps)], -1),
        self.proj[...])
    x_attn = param_norm(x, self.attn_norm, eps)
    k, v = self.layer.kv(x_attn, pos)
    return self.layer(x_attn, x, pos, k, v, band_mask(pos, pos, valid, self.cfg.window))

  def logits(self, target, h):
    return target.lm_logits(param_norm(h, self.out_norm, self.cfg.rms_norm_eps))


class MTPHead(DraftHead):
  """DeepSeek-V3 multi-token prediction: ``num_modules`` sequential modules.

  Params: ``modules[j]`` with ``hidden_norm``, ``embed_norm``, ``attn_norm``, ``out_norm``
  ``f32[D]``, ``proj f32[2D, D]`` and ``layer`` (``HeadLayer``, attention input D wide).
  """

  kind = "mtp"

  has_modules = True

  def __init__(self, cfg: HeadConfig, rng: np.random.Generator, draft_to_target=None):
    super().__init__(cfg, draft_to_target)
    self.modules = nnx.List([_MTPModule(cfg, rng) for _ in range(cfg.num_modules)])

  def draft(self, target, tokens, feats, num_valid, positions, num_steps: int, pick: DraftFn):
    """Module j (1-based) runs over the window and drafts ``d_j`` from its last slot.

    Args and returns as ``DraftHead.draft``; ``num_steps <= num_modules``. Module j at
    slot s (position i) reads token ``x_{i+j}``: ``ext[s + j - 1]`` where ``ext`` is
    the token window followed by the drafts so far (``ext[W - 1 + t] = d_t``).
    """
    if num_steps > self.cfg.num_modules:
      raise ValueError(f"{num_steps=} must be <= num_modules={self.cfg.num_modules}")
    _, width = tokens.shape
    pos = window_positions(positions, width)
    valid = jnp.arange(width)[None] >= width - num_valid[:, None]
    ext, hidden = tokens, feats
    out_tokens, out_probs = [], []
    for j in range(num_steps):
      module = self.modules[j]
      hidden = module(target, ext[:, j: j + width], hidden, pos, valid)
      tok, probs = pick(module.logits(target, hidden[:, -1]), j)
      out_tokens.append(tok)
      out_probs.append(probs)
      ext = jnp.concatenate([ext, tok[:, None]], 1)
    return stack_steps(out_tokens, out_probs)

  def train_logits(self, target, h, depth: int):
    return self.modules[depth].logits(target, h)

  def unrolled(self, target, tokens, feats, lengths, depth: int):
    """Modules 1..depth with teacher tokens: ``h^u[:, i]`` predicts ``x_{i+u+2}``."""
    b, t = tokens.shape
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))
    valid = pos < lengths[:, None]
    hidden, outs = feats, []
    for u in range(depth):
      shifted = jnp.concatenate([tokens[:, u + 1:], jnp.zeros((b, u + 1), tokens.dtype)], 1)
      hidden = self.modules[u](target, shifted, hidden, pos, valid)
      outs.append(hidden)
    return outs
