"""LayerSkip early-exit adapter (kind "early_exit", used by ``methods.layerskip``).

Not from a paper. LayerSkip (Elhoushi et al. 2024, arXiv 2404.16710) trains the *target*
for early exit (layer dropout, early-exit loss) so that the shared final norm and LM head
read layer E's output directly. For a target trained without it this head keeps the
target frozen and learns a small map of layer E's raw output ``h`` (HF
``hidden_states[E]``): ``g = (RMSNorm(h) * s) @ W`` with ``s`` ``f32[D]`` (init 1) and
``W`` ``f32[D, D]`` (init identity), then the target's final norm and LM head. At init it
gives the plain early exit's logits (up to the norms' eps).

Glossary: D model dim, V target vocab.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.heads.base import DraftFn, DraftHead
from models.heads.blocks import ones_param, param_norm
from models.layers import project, rms_norm

if TYPE_CHECKING:
  from models.config import ModelConfig
  from models.heads.config import HeadConfig

__all__ = ["EarlyExitHead"]


class EarlyExitHead(DraftHead):
  """LayerSkip exit adapter (``kind="early_exit"``; see the module docstring).

  ``adapt(h [..., D]) -> g f32[..., D]``; ``exit_logits(target, h) -> f32[..., V]``, the
  target's final norm and LM head on ``g``. It drafts inside ``methods.layerskip`` (which
  runs the target's layers ``[0, E)``); the trainer uses the common head interface
  (``unrolled``, ``train_logits``, ``label_offset``) with depth 1. Params: ``scale f32[D]``,
  ``proj f32[D, D]``.
  """

  kind = "early_exit"
  train_depth = 1
  max_train_depth = 1

  def __init__(self, cfg: HeadConfig, rng: np.random.Generator, draft_to_target=None):
    del rng  # deterministic init: the identity map
    super().__init__(cfg, draft_to_target)
    self.scale = ones_param((cfg.hidden_size,))
    self.proj = nnx.Param(jnp.eye(cfg.hidden_size, dtype=jnp.float32))

  @classmethod
  def default_feature_layers(cls, target: ModelConfig) -> tuple[int, ...]:
    """A quarter of the way up (at least layer 1)."""
    return (max(1, target.num_layers // 4),)

  @classmethod
  def check_target(cls, cfg: HeadConfig, target: ModelConfig) -> None:
    """The exit layer E must leave at least one layer of the target above it."""
    if not 1 <= cfg.feature_layers[0] < target.num_layers:
      raise ValueError(f"early_exit feature_layers={cfg.feature_layers} (the exit layer E) "
                       f"must be in [1, {target.num_layers - 1}] for this target")

  @property
  def exit_layer(self) -> int:
    return self.cfg.feature_layers[0]

  def adapt(self, h):
    return project("...D,DE->...E", param_norm(h.astype(jnp.float32), self.scale,
                                               self.cfg.rms_norm_eps), self.proj[...])

  def exit_logits(self, target, h):
    return self.train_logits(target, self.adapt(h), 0)

  def draft(self, target, tokens, feats, num_valid, positions, num_steps: int, pick: DraftFn):
    """Not a drafter alone: ``methods.layerskip`` runs the target's layers ``[0, E)`` and
    calls ``exit_logits``.

    Raises:
      ValueError: always.
    """
    raise ValueError("an early_exit head drafts inside methods.layerskip (exit_logits), "
                     "not through draft")

  def train_logits(self, target, g, depth: int):
    tc = target.cfg
    return target.lm_logits(rms_norm(g, target.final_norm[...], tc.rms_norm_eps,
                                     tc.norm_plus_one))

  @property
  def max_depth(self) -> int | None:
    """Most chain depths it is trained for (the exit predicts the next token)."""
    return 1

  def label_offset(self, depth: int) -> tuple[int, int]:
    """The exit at position i predicts the target's greedy token after i."""
    return 0, 0

  def unrolled(self, target, tokens, feats, lengths, depth: int):
    if depth != 1:
      raise ValueError(f"{depth=} must be 1 for an early_exit head")
    return [self.adapt(feats)]
