"""The one interface every draft head kind implements (``DraftHead``).

A head reads target features and shares the target's token embedding and LM head (an
EAGLE-3 head may instead own a reduced-vocabulary LM head). The target is passed to each
call; the head never stores it. A kind is one subclass; ``models.heads.registry`` maps
its name (``HeadConfig.kind``) to it, and nothing else branches on the name.

Class-level hooks describe the kind's ``HeadConfig`` (how many feature layers, default
taps, extra checks); instance methods are the drafting and training interface that
``methods.learned`` and ``methods.training`` call.

Glossary: B batch, T positions (training), W window slots, D model dim, F feature dim
(``len(feature_layers) * D``), V target vocab, V' draft vocab.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

import jax
from flax import nnx

if TYPE_CHECKING:
  from models.config import ModelConfig
  from models.heads.config import HeadConfig

__all__ = ["DraftFn", "DraftHead"]

# pick(logits f32[B, V], step j) -> (tokens i32[B], probs f32[B, V] or None)
DraftFn = Callable[[jax.Array, int], tuple[jax.Array, jax.Array | None]]


class DraftHead(nnx.Module, abc.ABC):
  """A learned draft head of one kind (an ``nnx.Module``; its params are ``nnx.Param``).

  Subclasses take ``(cfg, rng, draft_to_target=None)``: ``rng`` a numpy Generator (the
  init draws from it in a fixed order, so a seed fixes the weights), ``draft_to_target``
  only for kinds with ``reduced_vocab``.

  Attributes:
    cfg: the ``HeadConfig``.
    kind: the ``HeadConfig.kind`` of this class (``models.heads.registry`` maps it back).
    num_feature_layers: entries of ``HeadConfig.feature_layers`` the kind reads.
    reduced_vocab: whether ``HeadConfig.draft_vocab_size`` may be set.
    has_modules: whether ``HeadConfig.num_modules`` counts the head's modules (the
      longest chain it drafts) rather than being 1.
    train_depth: the draft depth training unrolls by default (None: ``num_modules``).
    max_train_depth: the deepest training may unroll (None: no limit beyond
      ``num_modules`` for kinds ``has_modules``).
    regresses_features: whether training also regresses the next target feature
      (EAGLE-1's feature loss, Li et al. 2024, "EAGLE: Speculative Sampling Requires
      Rethinking Feature Uncertainty").
  """

  kind: ClassVar[str] = ""  # the kind name the registry maps to this class
  num_feature_layers: ClassVar[int] = 1
  reduced_vocab: ClassVar[bool] = False
  has_modules: ClassVar[bool] = False
  train_depth: ClassVar[int | None] = None
  max_train_depth: ClassVar[int | None] = None
  regresses_features: ClassVar[bool] = False

  def __init__(self, cfg: HeadConfig, draft_to_target=None):
    """Checks that ``cfg.kind`` is this class's ``kind`` and stores ``cfg``."""
    if cfg.kind != self.kind:
      raise ValueError(f"kind={cfg.kind!r} must name {type(self).__name__} in the head "
                       f"registry (kind {self.kind!r})")
    if draft_to_target is not None and cfg.draft_vocab_size is None:
      raise ValueError("draft_to_target is only for eagle3 heads with draft_vocab_size")
    self.cfg = cfg

  # -- the kind's config (class-level: no head is built)
  @classmethod
  def default_feature_layers(cls, target: ModelConfig) -> tuple[int, ...]:
    """Target HF ``hidden_states`` indices read by default: the final (normed) state."""
    return (target.num_layers,)

  @classmethod
  def check_target(cls, cfg: HeadConfig, target: ModelConfig) -> None:
    """Kind-specific checks that ``cfg`` fits ``target`` (after the common ones)."""

  # -- drafting
  @abc.abstractmethod
  def draft(self, target, tokens, feats, num_valid, positions, num_steps: int, pick: DraftFn):
    """Drafts ``num_steps`` tokens per row from the window.

    Args:
      target: the target ``Transformer`` (embedding and LM head are used).
      tokens: ``i32[B, W]``; slot s holds ``x_{i+1}`` for the feature in slot s, so the
        last slot holds the pending token.
      feats: ``[B, W, F]``; slot ``W - 1`` holds ``f_{m-2}``, the feature of the last
        token whose KV is written (the pending token is ``x_{m-1}``).
      num_valid: ``i32[B]`` real slots (right-aligned), >= 1.
      positions: ``i32[B]`` absolute position of slot ``W - 1`` (= m - 2).
      num_steps: draft length (static).
      pick: ``(logits f32[B, V], j) -> (tokens i32[B], probs or None)``.

    Returns:
      ``(tokens i32[B, num_steps], probs f32[B, num_steps, V] or None)``: ``probs`` stacks
      what ``pick`` returned (any pytree of ``[B, ...]`` arrays, stacked on axis 1).
    """

  # -- training
  @abc.abstractmethod
  def unrolled(self, target, tokens, feats, lengths, depth: int) -> list[jax.Array]:
    """Outputs of depths ``0 .. depth - 1`` at every position, teacher-forced.

    Args:
      tokens: ``i32[B, T]`` the sequence ``x``.
      feats: ``[B, T, F]`` target features at every position.
      lengths: ``i32[B]`` real tokens per row.
      depth: U >= 1 (static).

    Returns:
      List over u of ``[B, T, D]``; ``label_offset(u)`` says which token each predicts.
    """

  @abc.abstractmethod
  def train_logits(self, target, g, depth: int) -> jax.Array:
    """Depth ``depth``'s output ``g [B, T, D]`` -> draft-vocabulary logits ``f32[B, T, V']``."""

  @property
  def max_depth(self) -> int | None:
    """Most chain depths it drafts (None: any): one module each by default."""
    return self.cfg.num_modules

  def label_offset(self, depth: int) -> tuple[int, int]:
    """``(shift, first)``: output q of this depth predicts the target's greedy token
    after position ``q + shift`` and is valid from ``q >= first``. By default module
    ``depth + 1`` at position i predicts the token after ``i + depth + 1``."""
    return depth + 1, 0

  # -- vocabulary (the identity unless the head owns a reduced vocabulary)
  def draft_ids(self, target_ids):
    """Target ids -> draft-vocabulary ids (-1 where absent)."""
    return target_ids

  def to_target_ids(self, draft_ids):
    """Draft-vocabulary ids ``i32[...]`` -> target ids."""
    return draft_ids

  def to_target_logits(self, logits):
    """Draft-vocabulary logits -> ``f32[..., V]`` (-inf outside the draft vocabulary)."""
    return logits

  def from_target_logits(self, logits):
    """Target-vocabulary logits ``[..., V]`` -> the draft vocabulary's ``[..., V']``."""
    return logits

  # -- training
  def init_from_target(self, target) -> None:
    """Copies what the head starts training from out of the target (a
    ``models.llama.Transformer``); nothing by default."""
    del target

