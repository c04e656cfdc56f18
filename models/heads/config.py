"""``HeadConfig``: the shape of a draft head, saved as ``head_config.json``.

The kind-specific parts (how many feature layers, the default taps, whether a reduced
draft vocabulary is allowed, extra fit checks) are asked of the kind's class through
``models.heads.registry.head_class``.
"""

from __future__ import annotations

import dataclasses
import json

from models.config import ModelConfig
from models.heads.registry import HEAD_CLASSES, head_class

__all__ = ["HeadConfig"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class HeadConfig:
  """Shape of a draft head; the attention geometry follows the target by default.

  Attributes:
    kind: one of ``models.heads.HEAD_KINDS`` (the registry's names).
    hidden_size: D, must equal the target's.
    vocab_size: V, the target's vocabulary.
    num_heads, num_kv_heads, head_dim, intermediate_size: the head's decoder layer.
    rms_norm_eps, rope_theta, rope_scaling: as the target's.
    feature_layers: target HF ``hidden_states`` indices the head reads, concatenated
      in this order into F = ``len(feature_layers) * D`` features (early_exit: ``(E,)``,
      the exit layer, ``1 <= E < num_layers``).
    num_modules: MTP modules / Medusa heads (the longest chain the head drafts); 1 for
      EAGLE (which drafts any length by feeding itself back).
    window: positions the head's attention sees (EAGLE, MTP); see ``models.heads.blocks``.
    draft_vocab_size: EAGLE-3 only: size of the reduced draft vocabulary, or None to
      use the target's LM head.
  """

  kind: str
  hidden_size: int
  vocab_size: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  intermediate_size: int
  rms_norm_eps: float = 1e-6
  rope_theta: float = 10000.0
  rope_scaling: tuple[tuple[str, float | str], ...] | None = None
  feature_layers: tuple[int, ...] = ()
  num_modules: int = 1
  window: int = 64
  draft_vocab_size: int | None = None

  def __post_init__(self):
    cls = head_class(self.kind)  # ValueError for an unknown kind
    object.__setattr__(self, "feature_layers", tuple(int(i) for i in self.feature_layers))
    if self.rope_scaling is not None:
      object.__setattr__(self, "rope_scaling", tuple(tuple(p) for p in self.rope_scaling))
    want = cls.num_feature_layers
    if len(self.feature_layers) != want:
      raise ValueError(f"feature_layers={self.feature_layers} must have {want} entries for "
                       f"kind={self.kind!r}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"{self.num_heads=} must be a multiple of {self.num_kv_heads=}")
    for name in ("num_modules", "window", "hidden_size", "vocab_size"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
    if self.draft_vocab_size is not None:
      if not cls.reduced_vocab:
        kinds = " or ".join(repr(k) for k, c in HEAD_CLASSES.items() if c.reduced_vocab)
        raise ValueError(f"draft_vocab_size={self.draft_vocab_size} is only for kind={kinds}")
      if not 1 <= self.draft_vocab_size <= self.vocab_size:
        raise ValueError(f"draft_vocab_size={self.draft_vocab_size} must be in "
                         f"[1, vocab_size={self.vocab_size}]")

  @property
  def feature_dim(self) -> int:
    """F: width of the concatenated target features."""
    return self.hidden_size * len(self.feature_layers)

  @classmethod
  def for_target(cls, kind: str, target: ModelConfig, **overrides) -> HeadConfig:
    """A head for ``target``: its attention geometry and the kind's default taps.

    Raises:
      ValueError: unknown kind or invalid overrides.
    """
    layers = head_class(kind).default_feature_layers(target)
    base = dict(
        kind=kind, hidden_size=target.hidden_size, vocab_size=target.vocab_size,
        num_heads=target.num_heads, num_kv_heads=target.num_kv_heads,
        head_dim=target.head_dim, intermediate_size=target.intermediate_size,
        rms_norm_eps=target.rms_norm_eps, rope_theta=target.rope_theta,
        rope_scaling=target.rope_scaling, feature_layers=layers,
    )
    return cls(**{**base, **overrides})

  def check_target(self, target: ModelConfig) -> None:
    """Raises ValueError unless this head fits ``target`` (D, V, feature layers)."""
    if (self.hidden_size, self.vocab_size) != (target.hidden_size, target.vocab_size):
      raise ValueError(
          f"head (hidden_size, vocab_size)={(self.hidden_size, self.vocab_size)} must equal "
          f"the target's {(target.hidden_size, target.vocab_size)}")
    if any(not 0 <= i <= target.num_layers for i in self.feature_layers):
      raise ValueError(f"feature_layers={self.feature_layers} must be in "
                       f"[0, {target.num_layers}] for this target")
    head_class(self.kind).check_target(self, target)

  def to_json(self) -> str:
    """The config as JSON (every field, sorted keys): ``head_config.json``."""
    return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

  @classmethod
  def from_json(cls, text: str) -> HeadConfig:
    """Inverse of ``to_json``."""
    d = json.loads(text)
    if d.get("rope_scaling") is not None:
      d["rope_scaling"] = tuple(tuple(p) for p in d["rope_scaling"])
    return cls(**d)
