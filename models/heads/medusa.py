"""Medusa-1 heads: residual blocks on the target's last hidden state, one per depth.

Source: Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with
Multiple Decoding Heads". Head j is a residual block ``h + SiLU(h W_j + b_j)`` on the
target's last hidden state ``f_i``; it predicts ``x_{i+1+j}`` (the LM head itself
predicts ``x_{i+1}``). Here the heads reuse the target LM head (Medusa initialises its
per-head LM heads from it) to keep the heads small.

Glossary: B batch, W window slots, D model dim, V target vocab.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.head_trees import medusa_tree
from models.heads.base import DraftFn, DraftHead
from models.heads.blocks import normal_param, stack_steps
from models.layers import project

if TYPE_CHECKING:
  from models.heads.config import HeadConfig

__all__ = ["MedusaHead"]


class _ResBlock(nnx.Module):
  def __init__(self, d: int, rng: np.random.Generator):
    self.w = normal_param(rng, (d, d), d**-0.5)
    self.b = nnx.Param(jnp.zeros((d,), jnp.float32))

  def __call__(self, h):
    return h + jax.nn.silu(project("...D,DE->...E", h, self.w[...]) + self.b[...])


class MedusaHead(DraftHead):
  """Medusa-1: ``num_modules`` residual heads on the target's last hidden state.

  Params: ``blocks[j]`` with ``w f32[D, D]`` and ``b f32[D]``.
  """

  kind = "medusa"

  has_modules = True

  def __init__(self, cfg: HeadConfig, rng: np.random.Generator, draft_to_target=None):
    super().__init__(cfg, draft_to_target)
    self.blocks = nnx.List([_ResBlock(cfg.hidden_size, rng) for _ in range(cfg.num_modules)])

  def draft(self, target, tokens, feats, num_valid, positions, num_steps: int, pick: DraftFn):
    """Head j (1-based) on ``f_{m-2}`` (the last slot) drafts ``d_j = x_{m-1+j}``."""
    if num_steps > self.cfg.num_modules:
      raise ValueError(f"{num_steps=} must be <= num_modules={self.cfg.num_modules}")
    out_tokens, out_probs = [], []
    for j in range(num_steps):
      tok, probs = pick(target.lm_logits(self.blocks[j](feats[:, -1])), j)
      out_tokens.append(tok)
      out_probs.append(probs)
    return stack_steps(out_tokens, out_probs)

  def draft_tree(self, target, tokens, feats, num_valid, positions, depth: int,
                 branching: int, num_nodes: int):
    """Medusa candidate tree (``models.head_trees.medusa_tree``); inputs as ``draft``.

    Returns ``(tokens i32[B, num_nodes], parents i32[B, num_nodes])``, parents first.

    Raises:
      ValueError: ``depth`` exceeds ``num_modules``.
    """
    if depth > self.cfg.num_modules:
      raise ValueError(f"{depth=} must be <= num_modules={self.cfg.num_modules}")
    return medusa_tree(self, target, feats, depth, branching, num_nodes)

  def train_logits(self, target, h, depth: int):
    return target.lm_logits(h)

  def unrolled(self, target, tokens, feats, lengths, depth: int):
    """Head u+1 at position i predicts ``x_{i+u+2}``."""
    return [self.blocks[u](feats) for u in range(depth)]
