"""EAGLE-1 and EAGLE-3 draft heads (one decoder layer fed back on its own output).

Sources:
  * EAGLE-1: Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature
    Uncertainty". Input at position i is ``fc(concat(embed(x_{i+1}), f_i))`` with
    ``f_i`` the target's final (normed) hidden state; one decoder layer predicts
    ``f_{i+1}``; the target LM head turns it into a token. Drafting feeds the head's
    own output back as the next feature.
  * EAGLE-3: Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large
    Language Models via Training-Time Test". ``fc`` maps the concatenation of three
    target hidden states (low, middle, high layers) to D; the decoder layer's attention
    reads ``concat(norm(embed(x_{i+1})), norm(h_i))`` (2D wide) with ``h_i`` as the
    residual; no feature loss; trained with "training-time test" (the head unrolled on
    its own outputs); optional reduced draft vocabulary with a draft -> target id map.
  * FR-Spec (``restrict_draft_vocab``): Zhao et al. 2025, "FR-Spec: Accelerating
    Large-Vocabulary Language Models via Frequency-Ranked Speculative Sampling".

The attention sees a sliding window of stored target features (``models.heads.blocks``);
for EAGLE the match between drafting and training is exact at any length (tested).

Glossary: B batch, T positions (training), W window slots, D model dim, F feature dim,
V target vocab, V' draft vocab, U unrolled draft depths.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import TYPE_CHECKING

import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.head_trees import eagle2_tree
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
from models.heads.vocab import VocabMap, validate_vocab_map
from models.layers import project

if TYPE_CHECKING:
  from models.config import ModelConfig
  from models.heads.config import HeadConfig

__all__ = ["Eagle1Head", "Eagle3Head", "EagleHead", "default_eagle3_layers",
           "restrict_draft_vocab"]


def default_eagle3_layers(num_layers: int) -> tuple[int, int, int]:
  """EAGLE-3's low/middle/high taps as HF ``hidden_states`` indices.

  EAGLE-3 (and SpecForge) capture the outputs of layers ``1, L/2 - 1, L - 4``, i.e.
  ``hidden_states`` indices ``2, L/2, L - 3``; clamped to ``[1, L]`` for tiny models.
  Example: L = 30 (SmolLM2-135M) -> (2, 15, 27); L = 2 -> (2, 1, 1).
  """
  return tuple(min(max(i, 1), num_layers) for i in (2, num_layers // 2, num_layers - 3))


class EagleHead(DraftHead):
  """What EAGLE-1 and EAGLE-3 share: chain drafting, EAGLE-2 trees and training-time test.

  Slot ``i`` pairs the target feature ``f_i`` (position i) with the next token
  ``x_{i+1}``; its output ``g_i`` predicts ``x_{i+2}`` (and, for EAGLE-1, ``f_{i+1}``).
  The subclasses supply the three pieces that differ: ``real_hidden``, ``layer_inputs``
  and ``draft_logits``.
  """

  # -- pieces shared by drafting and training
  @abc.abstractmethod
  def real_hidden(self, feats):
    """Target features ``[B, S, F]`` -> the hidden stream ``[B, S, D]``."""

  @abc.abstractmethod
  def layer_inputs(self, target, tokens, hidden):
    """``tokens i32[B, S]`` (x_{i+1}), ``hidden [B, S, D]`` -> (attention input, residual)."""

  @abc.abstractmethod
  def draft_logits(self, target, g):
    """``g [..., D]`` -> logits over the draft vocabulary ``f32[..., V']``."""

  # -- drafting
  def draft(self, target, tokens, feats, num_valid, positions, num_steps: int, pick: DraftFn):
    """Drafts ``num_steps`` tokens per row by feeding the head's output back.

    Args and returns as ``DraftHead.draft``.
    """
    _, width = tokens.shape
    total = width + num_steps - 1  # real slots + fed-back draft slots
    pos = window_positions(positions + num_steps - 1, total)
    slot = jnp.arange(total)
    valid = (slot[None] >= width - num_valid[:, None]) & (slot[None] < width)
    x_attn, resid = self.layer_inputs(target, tokens, self.real_hidden(feats))
    k, v = self.layer.kv(x_attn, pos[:, :width])
    pad = ((0, 0), (0, num_steps - 1), (0, 0), (0, 0))
    k, v = jnp.pad(k, pad), jnp.pad(v, pad)

    # A Python loop (num_steps is static): straight-line code that XLA fuses across
    # steps, without a device loop per draft call.
    q_attn, q_resid = x_attn[:, -1:], resid[:, -1:]
    toks, probs = [], []
    for j in range(num_steps):
      s = width - 1 + j  # the query's slot; its K/V is (re)written here (same at j = 0)
      q_pos = pos[:, s:s + 1]
      kj, vj = self.layer.kv(q_attn, q_pos)
      k = k.at[:, s:s + 1].set(kj)
      v = v.at[:, s:s + 1].set(vj)
      valid = valid | (slot[None] == s)
      # The query sees every real slot (the window ends at its chain start) and the
      # chain's own slots so far; ``valid`` is True exactly for those.
      g = self.layer(q_attn, q_resid, q_pos, k, v, valid[:, None, :])  # [B, 1, D]
      tok, p = pick(self.to_target_logits(self.draft_logits(target, g[:, 0])), j)
      toks.append(tok)
      probs.append(p)
      if j + 1 < num_steps:
        q_attn, q_resid = self.layer_inputs(target, tok[:, None], g)
    return stack_steps(toks, probs)

  def draft_tree(self, target, tokens, feats, num_valid, positions, depth: int,
                 branching: int, num_nodes: int):
    """EAGLE-2 dynamic tree (``models.head_trees.eagle2_tree``); inputs as ``draft``.

    Returns ``(tokens i32[B, num_nodes], parents i32[B, num_nodes])``, parents first.
    """
    return eagle2_tree(self, target, tokens, feats, num_valid, positions, depth, branching,
                       num_nodes)

  # -- training
  def train_logits(self, target, g, depth: int):
    """Depth ``depth``'s output ``[B, T, D]`` -> draft-vocabulary logits."""
    return self.draft_logits(target, g)

  @property
  def max_depth(self) -> int | None:
    """Most chain depths it drafts (None: any, by feeding its output back)."""
    return None

  def label_offset(self, depth: int) -> tuple[int, int]:
    """``(shift, first)``: output q of this depth predicts the target's greedy token
    after position ``q + shift`` and is valid from ``q >= first`` (chain start >= 0)."""
    return 1, depth

  def unrolled(self, target, tokens, feats, lengths, depth: int):
    """Training-time test: the head unrolled ``depth`` steps on its own outputs.

    Depth u at position q continues the chain that started from the real feature at
    position ``q - u``: it attends to the ``window`` real slots ending at q - u and to
    the chain's own slots at q - u + 1 .. q (depths 1 .. u), exactly the keys draft
    step u sees in ``draft``. Tokens are teacher-forced (``x_{q+1}``).

    Args:
      tokens: ``i32[B, T]`` the sequence ``x``.
      feats: ``[B, T, F]`` target features at every position.
      lengths: ``i32[B]`` real tokens per row.
      depth: U >= 1 (static).

    Returns:
      List over u of ``g^u [B, T, D]``; ``g^u[:, q]`` predicts ``x_{q+2}`` and is valid
      for ``u <= q <= lengths - 2``.
    """
    cfg = self.cfg
    b, t = tokens.shape
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))
    valid = pos < lengths[:, None]
    nxt = jnp.concatenate([tokens[:, 1:], jnp.zeros((b, 1), tokens.dtype)], 1)
    hidden = self.real_hidden(feats)
    keys, values, outs = [], [], []
    for u in range(depth):
      if u > 0:  # H^u[q] = g^{u-1}[q - 1]
        hidden = jnp.concatenate([jnp.zeros_like(outs[-1][:, :1]), outs[-1][:, :-1]], 1)
      x_attn, resid = self.layer_inputs(target, nxt, hidden)
      k, v = self.layer.kv(x_attn, pos)
      keys.append(k)
      values.append(v)
      masks = [band_mask(pos - u, pos, valid, cfg.window)]
      for w in range(1, u + 1):  # the chain slot of depth w sits at q - u + w
        masks.append((pos[:, :, None] - u + w == pos[:, None, :]) & valid[:, None, :])
      g = self.layer(x_attn, resid, pos, jnp.concatenate(keys, 1),
                     jnp.concatenate(values, 1), jnp.concatenate(masks, 2))
      outs.append(g)
    return outs


class Eagle1Head(EagleHead):
  """EAGLE-1: ``fc(concat(embed(x_{i+1}), f_i))`` through one decoder layer; the target's
  LM head reads the output directly. Params: ``fc f32[2D, D]``, ``attn_norm f32[D]``,
  ``layer`` (``HeadLayer``, attention input D wide)."""

  kind = "eagle"
  train_depth = 1
  regresses_features = True

  def __init__(self, cfg: HeadConfig, rng: np.random.Generator, draft_to_target=None):
    super().__init__(cfg, draft_to_target)
    d = cfg.hidden_size
    self.fc = normal_param(rng, (2 * d, d), (2 * d) ** -0.5)
    self.attn_norm = ones_param((d,))
    self.layer = HeadLayer(cfg, d, rng)

  def real_hidden(self, feats):
    return feats

  def layer_inputs(self, target, tokens, hidden):
    emb = target.embed_tokens(tokens).astype(jnp.float32)
    x = project("BSE,ED->BSD", jnp.concatenate([emb, hidden], -1), self.fc[...])
    return param_norm(x, self.attn_norm, self.cfg.rms_norm_eps), x

  def draft_logits(self, target, g):
    return target.lm_logits(g)


class Eagle3Head(EagleHead):
  """EAGLE-3: three target taps fused by ``fc``, a 2D-wide attention input, an output
  norm, and optionally its own reduced-vocabulary LM head. Params: ``fc f32[F, D]``,
  ``embed_norm``, ``hidden_norm``, ``out_norm`` ``f32[D]``, ``layer`` (attention input 2D
  wide); with ``draft_vocab_size`` V' also ``lm_head f32[D, V']`` and the non-trainable
  ``d2t i32[V']`` (``VocabMap``)."""

  kind = "eagle3"
  train_depth = 3

  num_feature_layers = 3
  reduced_vocab = True

  def __init__(self, cfg: HeadConfig, rng: np.random.Generator,
               draft_to_target: np.ndarray | None = None):
    super().__init__(cfg, draft_to_target)
    d = cfg.hidden_size
    self.fc = normal_param(rng, (cfg.feature_dim, d), cfg.feature_dim**-0.5)
    self.embed_norm = ones_param((d,))
    self.hidden_norm = ones_param((d,))
    self.layer = HeadLayer(cfg, 2 * d, rng)
    self.out_norm = ones_param((d,))
    if cfg.draft_vocab_size is not None:
      m = validate_vocab_map(draft_to_target, cfg.draft_vocab_size, cfg.vocab_size)
      self.lm_head = normal_param(rng, (d, cfg.draft_vocab_size), d**-0.5)
      self.d2t = VocabMap(jnp.asarray(m))

  @classmethod
  def default_feature_layers(cls, target: ModelConfig) -> tuple[int, ...]:
    return default_eagle3_layers(target.num_layers)

  def real_hidden(self, feats):
    return jnp.einsum("BSF,FD->BSD", feats, self.fc[...])

  def layer_inputs(self, target, tokens, hidden):
    eps = self.cfg.rms_norm_eps
    emb = target.embed_tokens(tokens).astype(jnp.float32)
    x_attn = jnp.concatenate([param_norm(emb, self.embed_norm, eps),
                              param_norm(hidden, self.hidden_norm, eps)], -1)
    return x_attn, hidden

  def draft_logits(self, target, g):
    h = param_norm(g, self.out_norm, self.cfg.rms_norm_eps)
    if self.cfg.draft_vocab_size is None:
      return target.lm_logits(h)
    return jnp.einsum("...D,DV->...V", h, self.lm_head[...], preferred_element_type=jnp.float32)

  def to_target_logits(self, logits):
    """Draft-vocabulary logits -> ``f32[..., V]`` (-inf outside the draft vocabulary)."""
    if self.cfg.draft_vocab_size is None:
      return logits
    full = jnp.full(logits.shape[:-1] + (self.cfg.vocab_size,), -jnp.inf, jnp.float32)
    return full.at[..., self.d2t[...]].set(logits)

  def from_target_logits(self, logits):
    """Target-vocabulary logits ``[..., V]`` -> ``[..., V']`` (the draft ids' columns)."""
    if self.cfg.draft_vocab_size is None:
      return logits
    return jnp.take(logits, self.d2t[...], axis=-1)

  def init_from_target(self, target) -> None:
    """With its own vocabulary, the LM head starts as the target LM head's columns of the
    draft ids (``lm_head = W[:, d2t]``, the FR-Spec head of ``restrict_draft_vocab``), so
    training refines the target's own output geometry instead of a random one."""
    if self.cfg.draft_vocab_size is None:
      return
    self.lm_head[...] = jnp.take(target.lm_weight().astype(jnp.float32), self.d2t[...], axis=1)

  def to_target_ids(self, draft_ids):
    """Draft-vocabulary ids ``i32[...]`` -> target ids (the identity without a reduced
    vocabulary). The map is sorted, so the order of ids (and argmax / top-k ties) is
    the same in both vocabularies."""
    if self.cfg.draft_vocab_size is None:
      return draft_ids
    return self.d2t[...][draft_ids]

  def draft_ids(self, target_ids):
    """Target ids -> draft-vocabulary ids (-1 where absent)."""
    if self.cfg.draft_vocab_size is None:
      return target_ids
    t2d = jnp.full((self.cfg.vocab_size,), -1, jnp.int32)
    t2d = t2d.at[self.d2t[...]].set(jnp.arange(self.cfg.draft_vocab_size, dtype=jnp.int32))
    return t2d[jnp.maximum(target_ids, 0)]


def restrict_draft_vocab(head: Eagle3Head, lm_weight, draft_to_target) -> Eagle3Head:
  """An EAGLE-3 head that drafts from a subset of the target vocabulary, made without
  training: FR-Spec keeps the target LM head's rows of the most frequent tokens, so each
  draft step's LM head reads ``V'`` of ``V`` rows. Tokens outside the subset are never
  drafted; verification is unchanged (lossless).

  Args:
    head: an ``Eagle3Head`` (kind "eagle3") that uses the target's LM head
      (``draft_vocab_size`` None).
    lm_weight: the target LM head ``[D, V]`` (the tied embedding transposed).
    draft_to_target: ``i32[V']`` the kept target ids (sorted, distinct, in [0, V)).

  Returns:
    A new head: the same weights, ``draft_vocab_size = V'``, ``lm_head = lm_weight[:, ids]``.

  Raises:
    ValueError: another kind, a head with its own vocabulary, a weight of another shape,
      or a map that is not sorted and distinct ids in [0, V).
  """
  cfg = head.cfg
  if not isinstance(head, Eagle3Head) or cfg.draft_vocab_size is not None:
    raise ValueError(f"head kind={cfg.kind!r}, draft_vocab_size={cfg.draft_vocab_size} must "
                     "be an eagle3 head on the target's LM head (draft_vocab_size None)")
  lm_weight = np.asarray(lm_weight, np.float32)
  if lm_weight.shape != (cfg.hidden_size, cfg.vocab_size):
    raise ValueError(f"lm_weight shape={lm_weight.shape} must be (D, V)="
                     f"({cfg.hidden_size}, {cfg.vocab_size})")
  ids = np.asarray(draft_to_target)
  if ids.ndim != 1 or not 1 <= ids.shape[0] <= cfg.vocab_size or np.any(np.diff(ids) <= 0):
    raise ValueError(f"draft_to_target shape={ids.shape} must be [V'] with 1 <= V' <= "
                     f"{cfg.vocab_size}, sorted and distinct")
  new_cfg = dataclasses.replace(cfg, draft_vocab_size=int(ids.shape[0]))
  ids = validate_vocab_map(ids, new_cfg.draft_vocab_size, cfg.vocab_size)
  out = Eagle3Head(new_cfg, np.random.default_rng(0), ids)  # as make_head(new_cfg, 0, ids)
  state = nnx.state(out, nnx.Param)
  params = nnx.to_pure_dict(nnx.state(head, nnx.Param))
  params["lm_head"] = jnp.asarray(lm_weight[:, ids])
  nnx.replace_by_pure_dict(state, params)
  nnx.update(out, state)
  return out
