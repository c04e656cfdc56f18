"""Learned draft heads: EAGLE-1, EAGLE-3, MTP, Medusa and the LayerSkip exit adapter (Flax NNX).

Every head reads target features and shares the target's token embedding and LM head
(EAGLE-3 may instead own a reduced-vocabulary LM head with a draft -> target id map).
The target is passed to each call; the head never stores it.

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
  * MTP: DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", section 2.2. Module j maps
    ``concat(RMSNorm(h^{j-1}_i), RMSNorm(embed(x_{i+j})))`` through a projection and one
    transformer block to ``h^j_i``, which predicts ``x_{i+j+1}``; ``h^0`` is the target's
    final hidden state.
  * Medusa: Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with
    Multiple Decoding Heads". Head j is a residual block ``h + SiLU(h W_j + b_j)`` on the
    target's last hidden state ``f_i``; it predicts ``x_{i+1+j}`` (the LM head itself
    predicts ``x_{i+1}``). Here the heads reuse the target LM head (Medusa initialises
    its per-head LM heads from it) to keep the heads small.
  * Early-exit adapter (``kind="early_exit"``, for ``methods.layerskip``): not from a
    paper. LayerSkip (Elhoushi et al. 2024, arXiv 2404.16710) trains the *target* for
    early exit (layer dropout, early-exit loss) so that the shared final norm and LM head
    read layer E's output directly. For a target trained without it this head keeps the
    target frozen and learns a small map of layer E's raw output ``h`` (HF
    ``hidden_states[E]``): ``g = (RMSNorm(h) * s) @ W`` with ``s`` ``f32[D]`` (init 1) and
    ``W`` ``f32[D, D]`` (init identity), then the target's final norm and LM head. At
    init it gives the plain early exit's logits (up to the norms' eps).

Attention context (the documented choice): the decoder layers of EAGLE and MTP attend
over a dense *sliding window* of the last ``window`` positions, recomputed from the
stored target features at every draft call (no head KV cache to keep in sync with
rollback). Training uses the same banded causal mask, so the head sees the same context
in training and in drafting. Within one draft call the window's K/V are projected once
and each draft step appends one K/V slot (a dense, call-local cache). For EAGLE the
match is exact at any length (tested). For MTP it is exact while the sequence fits the
window; beyond it, module j > 1 at the window's left edge sees lower-module states that
were themselves computed from a truncated window (training computes them with full
windows), a small approximation near slot 0 that does not affect losslessness.

Glossary: B batch, T positions (training), W window slots, S key slots, N/K/H attention
heads / KV heads / head dim, D model dim, F feature dim (``len(feature_layers) * D``),
V target vocab, U unrolled draft depths.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.config import ModelConfig
from models.head_trees import eagle2_tree, medusa_tree
from models.layers import apply_rope, project, rms_norm, rope_inv_freq

__all__ = [
    "HEAD_KINDS",
    "DraftFn",
    "EagleHead",
    "EarlyExitHead",
    "HeadConfig",
    "MTPHead",
    "MedusaHead",
    "VocabMap",
    "default_eagle3_layers",
    "load_head",
    "make_head",
    "num_params",
    "restrict_draft_vocab",
    "save_head",
    "validate_vocab_map",
]

HEAD_KINDS = ("eagle", "eagle3", "mtp", "medusa", "early_exit")
_NEG = -1e30  # finite mask value: a fully masked (padding) row stays finite

# pick(logits f32[B, V], step j) -> (tokens i32[B], probs f32[B, V] or None)
DraftFn = Callable[[jax.Array, int], tuple[jax.Array, jax.Array | None]]


def default_eagle3_layers(num_layers: int) -> tuple[int, int, int]:
  """EAGLE-3's low/middle/high taps as HF ``hidden_states`` indices.

  EAGLE-3 (and SpecForge) capture the outputs of layers ``1, L/2 - 1, L - 4``, i.e.
  ``hidden_states`` indices ``2, L/2, L - 3``; clamped to ``[1, L]`` for tiny models.
  Example: L = 30 (SmolLM2-135M) -> (2, 15, 27); L = 2 -> (2, 1, 1).
  """
  return tuple(min(max(i, 1), num_layers) for i in (2, num_layers // 2, num_layers - 3))


@dataclasses.dataclass(frozen=True, kw_only=True)
class HeadConfig:
  """Shape of a draft head; the attention geometry follows the target by default.

  Attributes:
    kind: one of ``HEAD_KINDS``.
    hidden_size: D, must equal the target's.
    vocab_size: V, the target's vocabulary.
    num_heads, num_kv_heads, head_dim, intermediate_size: the head's decoder layer.
    rms_norm_eps, rope_theta, rope_scaling: as the target's.
    feature_layers: target HF ``hidden_states`` indices the head reads, concatenated
      in this order into F = ``len(feature_layers) * D`` features (early_exit: ``(E,)``,
      the exit layer, ``1 <= E < num_layers``).
    num_modules: MTP modules / Medusa heads (the longest chain the head drafts); 1 for
      EAGLE (which drafts any length by feeding itself back).
    window: positions the head's attention sees (EAGLE, MTP); see the module docstring.
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
    if self.kind not in HEAD_KINDS:
      raise ValueError(f"kind={self.kind!r} must be one of {HEAD_KINDS}")
    object.__setattr__(self, "feature_layers", tuple(int(i) for i in self.feature_layers))
    if self.rope_scaling is not None:
      object.__setattr__(self, "rope_scaling", tuple(tuple(p) for p in self.rope_scaling))
    want = 3 if self.kind == "eagle3" else 1
    if len(self.feature_layers) != want:
      raise ValueError(f"feature_layers={self.feature_layers} must have {want} entries for "
                       f"kind={self.kind!r}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"{self.num_heads=} must be a multiple of {self.num_kv_heads=}")
    for name in ("num_modules", "window", "hidden_size", "vocab_size"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
    if self.draft_vocab_size is not None:
      if self.kind != "eagle3":
        raise ValueError(f"draft_vocab_size={self.draft_vocab_size} is only for kind='eagle3'")
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
    if kind not in HEAD_KINDS:
      raise ValueError(f"{kind=} must be one of {HEAD_KINDS}")
    layers = {"eagle3": default_eagle3_layers(target.num_layers),
              "early_exit": (max(1, target.num_layers // 4),)}.get(kind, (target.num_layers,))
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
    if self.kind == "early_exit" and not 1 <= self.feature_layers[0] < target.num_layers:
      raise ValueError(f"early_exit feature_layers={self.feature_layers} (the exit layer E) "
                       f"must be in [1, {target.num_layers - 1}] for this target")

  def to_json(self) -> str:
    return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

  @classmethod
  def from_json(cls, text: str) -> HeadConfig:
    d = json.loads(text)
    if d.get("rope_scaling") is not None:
      d["rope_scaling"] = tuple(tuple(p) for p in d["rope_scaling"])
    return cls(**d)


class VocabMap(nnx.Variable):
  """Non-trainable ``i32[V_draft]`` draft -> target token ids (EAGLE-3)."""


def validate_vocab_map(draft_to_target, draft_vocab_size: int, vocab_size: int) -> np.ndarray:
  """Checks an EAGLE-3 draft -> target id map and returns it as ``i32[V_draft]``.

  Raises:
    ValueError: missing (None), wrong shape, non-integer, out of ``[0, vocab_size)``
      or duplicated ids.
  """
  if draft_to_target is None:
    raise ValueError(f"draft_to_target must be given when {draft_vocab_size=} is set")
  m = np.asarray(draft_to_target)
  if m.shape != (draft_vocab_size,):
    raise ValueError(f"draft_to_target shape={m.shape} must be ({draft_vocab_size},)")
  if not np.issubdtype(m.dtype, np.integer):
    raise ValueError(f"draft_to_target dtype={m.dtype} must be an integer type")
  if m.size and (m.min() < 0 or m.max() >= vocab_size):
    raise ValueError(f"draft_to_target ids must be in [0, {vocab_size=})")
  if len(np.unique(m)) != m.size:
    raise ValueError("draft_to_target must not repeat a target id")
  return m.astype(np.int32)


# ------------------------------------------------------------------ building blocks
def _normal(rng: np.random.Generator, shape, std: float) -> nnx.Param:
  return nnx.Param(jnp.asarray(std * rng.standard_normal(shape, dtype=np.float32)))


def _ones(shape) -> nnx.Param:
  return nnx.Param(jnp.ones(shape, jnp.float32))


def _norm(x, w, eps):
  return rms_norm(x, w[...], eps, False)


def band_mask(q_pos: jax.Array, k_pos: jax.Array, k_valid: jax.Array, window: int) -> jax.Array:
  """``bool[B, T, S]``: key at or before the query, fewer than ``window`` back, valid.

  Example: window 3, query position 5 sees key positions 3, 4, 5.
  """
  diff = q_pos[:, :, None] - k_pos[:, None, :]
  return (diff >= 0) & (diff < window) & k_valid[:, None, :]


def dense_attention(q, k, v, mask, scale: float):
  """GQA attention with f32 logits.

  Args:
    q: ``[B, T, N, H]``; k, v: ``[B, S, K, H]``; mask: ``bool[B, T, S]``.

  Returns:
    ``[B, T, N, H]`` (a fully masked query row averages all keys; callers ignore it).
  """
  b, t, n, h = q.shape
  kh = k.shape[2]
  q = q.reshape(b, t, kh, n // kh, h)
  logits = jnp.einsum("BTKGH,BSKH->BKGTS", q, k, preferred_element_type=jnp.float32) * scale
  logits = jnp.where(mask[:, None, None], logits, _NEG)
  probs = jax.nn.softmax(logits, axis=-1)
  out = jnp.einsum("BKGTS,BSKH->BTKGH", probs.astype(v.dtype), v)
  return out.reshape(b, t, n, h)


class HeadLayer(nnx.Module):
  """One decoder layer whose attention input is ``attn_dim`` wide (D, or 2D for EAGLE-3).

  The caller normalises the attention input; the residual stream is D wide.
  """

  def __init__(self, cfg: HeadConfig, attn_dim: int, rng: np.random.Generator):
    d, n, kh, h, f = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                      cfg.intermediate_size)
    self.cfg = cfg
    self.q = _normal(rng, (attn_dim, n, h), attn_dim**-0.5)
    self.k = _normal(rng, (attn_dim, kh, h), attn_dim**-0.5)
    self.v = _normal(rng, (attn_dim, kh, h), attn_dim**-0.5)
    self.o = _normal(rng, (n, h, d), (n * h) ** -0.5)
    self.ffn_norm = _ones((d,))
    self.gate = _normal(rng, (d, f), d**-0.5)
    self.up = _normal(rng, (d, f), d**-0.5)
    self.down = _normal(rng, (f, d), f**-0.5)

  def _rope(self, x, positions):
    cfg = self.cfg
    return apply_rope(x, positions, rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))

  def kv(self, x_attn, positions):
    """``x_attn [B, S, A]``, ``positions i32[B, S]`` -> roped ``k``, ``v`` ``[B, S, K, H]``."""
    k = project("BSA,AKH->BSKH", x_attn, self.k[...])
    v = project("BSA,AKH->BSKH", x_attn, self.v[...])
    return self._rope(k, positions), v

  def __call__(self, x_attn, resid, positions, k, v, mask):
    """``x_attn [B, T, A]``, ``resid [B, T, D]``, keys ``[B, S, K, H]``, ``mask [B, T, S]``."""
    cfg = self.cfg
    q = self._rope(project("BTA,ANH->BTNH", x_attn, self.q[...]), positions)
    attn = dense_attention(q, k, v, mask, cfg.head_dim**-0.5)
    o = self.o[...]
    x = resid + project("BTE,ED->BTD", attn.reshape(*attn.shape[:2], -1),
                        o.reshape(-1, o.shape[-1]))
    h = _norm(x, self.ffn_norm, cfg.rms_norm_eps)
    gate = jax.nn.silu(project("BTD,DF->BTF", h, self.gate[...]))
    up = project("BTD,DF->BTF", h, self.up[...])
    return x + project("BTF,FD->BTD", gate * up, self.down[...])


def _stack(tokens: list, probs: list):
  """Per-step tokens and ``pick`` outputs (any pytree, e.g. None) stacked on axis 1."""
  return jnp.stack(tokens, 1), jax.tree.map(lambda *p: jnp.stack(p, 1), *probs)


def _window_positions(positions, width: int):
  """Slot positions ``i32[B, width]``: slot ``width - 1`` is at ``positions[b]``.

  Example: positions [7], width 4 -> [[4, 5, 6, 7]].
  """
  return positions[:, None] - (width - 1) + jnp.arange(width, dtype=jnp.int32)[None]


# ------------------------------------------------------------------ heads
class EagleHead(nnx.Module):
  """EAGLE-1 (``kind="eagle"``) and EAGLE-3 (``kind="eagle3"``) draft head.

  Slot ``i`` pairs the target feature ``f_i`` (position i) with the next token
  ``x_{i+1}``; its output ``g_i`` predicts ``x_{i+2}`` (and, for EAGLE-1, ``f_{i+1}``).
  """

  def __init__(self, cfg: HeadConfig, rng: np.random.Generator,
               draft_to_target: np.ndarray | None = None):
    if cfg.kind not in ("eagle", "eagle3"):
      raise ValueError(f"kind={cfg.kind!r} must be 'eagle' or 'eagle3' for EagleHead")
    d = cfg.hidden_size
    self.cfg = cfg
    if cfg.kind == "eagle":
      self.fc = _normal(rng, (2 * d, d), (2 * d) ** -0.5)
      self.attn_norm = _ones((d,))
      self.layer = HeadLayer(cfg, d, rng)
    else:
      self.fc = _normal(rng, (cfg.feature_dim, d), cfg.feature_dim**-0.5)
      self.embed_norm = _ones((d,))
      self.hidden_norm = _ones((d,))
      self.layer = HeadLayer(cfg, 2 * d, rng)
      self.out_norm = _ones((d,))
      if cfg.draft_vocab_size is not None:
        m = validate_vocab_map(draft_to_target, cfg.draft_vocab_size, cfg.vocab_size)
        self.lm_head = _normal(rng, (d, cfg.draft_vocab_size), d**-0.5)
        self.d2t = VocabMap(jnp.asarray(m))
    if cfg.kind == "eagle" or cfg.draft_vocab_size is None:
      if draft_to_target is not None:
        raise ValueError("draft_to_target is only for eagle3 heads with draft_vocab_size")

  # -- pieces shared by drafting and training
  def real_hidden(self, feats):
    """Target features ``[B, S, F]`` -> the hidden stream ``[B, S, D]``."""
    if self.cfg.kind == "eagle":
      return feats
    return jnp.einsum("BSF,FD->BSD", feats, self.fc[...])

  def layer_inputs(self, target, tokens, hidden):
    """``tokens i32[B, S]`` (x_{i+1}), ``hidden [B, S, D]`` -> (attention input, residual)."""
    eps = self.cfg.rms_norm_eps
    emb = target.embed_tokens(tokens).astype(jnp.float32)
    if self.cfg.kind == "eagle":
      x = project("BSE,ED->BSD", jnp.concatenate([emb, hidden], -1), self.fc[...])
      return _norm(x, self.attn_norm, eps), x
    x_attn = jnp.concatenate([_norm(emb, self.embed_norm, eps),
                              _norm(hidden, self.hidden_norm, eps)], -1)
    return x_attn, hidden

  def draft_logits(self, target, g):
    """``g [..., D]`` -> logits over the draft vocabulary ``f32[..., V']``."""
    if self.cfg.kind == "eagle":
      return target.lm_logits(g)
    h = _norm(g, self.out_norm, self.cfg.rms_norm_eps)
    if self.cfg.draft_vocab_size is None:
      return target.lm_logits(h)
    return jnp.einsum("...D,DV->...V", h, self.lm_head[...], preferred_element_type=jnp.float32)

  def to_target_logits(self, logits):
    """Draft-vocabulary logits -> ``f32[..., V]`` (-inf outside the draft vocabulary)."""
    if self.cfg.kind == "eagle" or self.cfg.draft_vocab_size is None:
      return logits
    full = jnp.full(logits.shape[:-1] + (self.cfg.vocab_size,), -jnp.inf, jnp.float32)
    return full.at[..., self.d2t[...]].set(logits)

  def to_target_ids(self, draft_ids):
    """Draft-vocabulary ids ``i32[...]`` -> target ids (the identity without a reduced
    vocabulary). The map is sorted, so the order of ids (and argmax / top-k ties) is
    the same in both vocabularies."""
    if self.cfg.kind == "eagle" or self.cfg.draft_vocab_size is None:
      return draft_ids
    return self.d2t[...][draft_ids]

  # -- drafting
  def draft(self, target, tokens, feats, num_valid, positions, num_steps: int, pick: DraftFn):
    """Drafts ``num_steps`` tokens per row by feeding the head's output back.

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
    _, width = tokens.shape
    total = width + num_steps - 1  # real slots + fed-back draft slots
    pos = _window_positions(positions + num_steps - 1, total)
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
    return _stack(toks, probs)

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

  def draft_ids(self, target_ids):
    """Target ids -> draft-vocabulary ids (-1 where absent)."""
    if self.cfg.kind == "eagle" or self.cfg.draft_vocab_size is None:
      return target_ids
    t2d = jnp.full((self.cfg.vocab_size,), -1, jnp.int32)
    t2d = t2d.at[self.d2t[...]].set(jnp.arange(self.cfg.draft_vocab_size, dtype=jnp.int32))
    return t2d[jnp.maximum(target_ids, 0)]

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


class _MTPModule(nnx.Module):
  def __init__(self, cfg: HeadConfig, rng: np.random.Generator):
    d = cfg.hidden_size
    self.cfg = cfg
    self.hidden_norm = _ones((d,))
    self.embed_norm = _ones((d,))
    self.proj = _normal(rng, (2 * d, d), (2 * d) ** -0.5)
    self.attn_norm = _ones((d,))
    self.layer = HeadLayer(cfg, d, rng)
    self.out_norm = _ones((d,))

  def __call__(self, target, tokens, hidden, pos, valid):
    """``tokens i32[B, S]`` (x_{i+j}), ``hidden [B, S, D]`` (h^{j-1}) -> ``h^j [B, S, D]``."""
    eps = self.cfg.rms_norm_eps
    emb = target.embed_tokens(tokens).astype(jnp.float32)
    x = project("BSE,ED->BSD", jnp.concatenate(
        [_norm(hidden, self.hidden_norm, eps), _norm(emb, self.embed_norm, eps)], -1),
        self.proj[...])
    x_attn = _norm(x, self.attn_norm, eps)
    k, v = self.layer.kv(x_attn, pos)
    return self.layer(x_attn, x, pos, k, v, band_mask(pos, pos, valid, self.cfg.window))

  def logits(self, target, h):
    return target.lm_logits(_norm(h, self.out_norm, self.cfg.rms_norm_eps))


class MTPHead(nnx.Module):
  """DeepSeek-V3 multi-token prediction: ``num_modules`` sequential modules."""

  def __init__(self, cfg: HeadConfig, rng: np.random.Generator):
    if cfg.kind != "mtp":
      raise ValueError(f"kind={cfg.kind!r} must be 'mtp' for MTPHead")
    self.cfg = cfg
    self.modules = nnx.List([_MTPModule(cfg, rng) for _ in range(cfg.num_modules)])

  def draft(self, target, tokens, feats, num_valid, positions, num_steps: int, pick: DraftFn):
    """Module j (1-based) runs over the window and drafts ``d_j`` from its last slot.

    Args and returns as ``EagleHead.draft``; ``num_steps <= num_modules``. Module j at
    slot s (position i) reads token ``x_{i+j}``: ``ext[s + j - 1]`` where ``ext`` is
    the token window followed by the drafts so far (``ext[W - 1 + t] = d_t``).
    """
    if num_steps > self.cfg.num_modules:
      raise ValueError(f"{num_steps=} must be <= num_modules={self.cfg.num_modules}")
    _, width = tokens.shape
    pos = _window_positions(positions, width)
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
    return _stack(out_tokens, out_probs)

  def train_logits(self, target, h, depth: int):
    return self.modules[depth].logits(target, h)

  @property
  def max_depth(self) -> int | None:
    """Most chain depths it drafts: one module each."""
    return self.cfg.num_modules

  def label_offset(self, depth: int) -> tuple[int, int]:
    """Module ``depth + 1`` at position i predicts the greedy token after ``i + depth + 1``."""
    return depth + 1, 0

  def draft_ids(self, target_ids):
    return target_ids

  def to_target_logits(self, logits):
    return logits

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


class _ResBlock(nnx.Module):
  def __init__(self, d: int, rng: np.random.Generator):
    self.w = _normal(rng, (d, d), d**-0.5)
    self.b = nnx.Param(jnp.zeros((d,), jnp.float32))

  def __call__(self, h):
    return h + jax.nn.silu(project("...D,DE->...E", h, self.w[...]) + self.b[...])


class MedusaHead(nnx.Module):
  """Medusa-1: ``num_modules`` residual heads on the target's last hidden state."""

  def __init__(self, cfg: HeadConfig, rng: np.random.Generator):
    if cfg.kind != "medusa":
      raise ValueError(f"kind={cfg.kind!r} must be 'medusa' for MedusaHead")
    self.cfg = cfg
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
    return _stack(out_tokens, out_probs)

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

  @property
  def max_depth(self) -> int | None:
    """Most chain depths it drafts: one head each."""
    return self.cfg.num_modules

  def label_offset(self, depth: int) -> tuple[int, int]:
    """Head ``depth + 1`` at position i predicts the greedy token after ``i + depth + 1``."""
    return depth + 1, 0

  def draft_ids(self, target_ids):
    return target_ids

  def to_target_logits(self, logits):
    return logits

  def unrolled(self, target, tokens, feats, lengths, depth: int):
    """Head u+1 at position i predicts ``x_{i+u+2}``."""
    return [self.blocks[u](feats) for u in range(depth)]


class EarlyExitHead(nnx.Module):
  """LayerSkip exit adapter (``kind="early_exit"``; see the module docstring).

  ``adapt(h [..., D]) -> g f32[..., D]``; ``exit_logits(target, h) -> f32[..., V]``, the
  target's final norm and LM head on ``g``. It drafts inside ``methods.layerskip`` (which
  runs the target's layers ``[0, E)``); the trainer uses the common head interface
  (``unrolled``, ``train_logits``, ``label_offset``) with depth 1.
  """

  def __init__(self, cfg: HeadConfig, rng: np.random.Generator):
    del rng  # deterministic init: the identity map
    if cfg.kind != "early_exit":
      raise ValueError(f"kind={cfg.kind!r} must be 'early_exit' for EarlyExitHead")
    self.cfg = cfg
    self.scale = _ones((cfg.hidden_size,))
    self.proj = nnx.Param(jnp.eye(cfg.hidden_size, dtype=jnp.float32))

  @property
  def exit_layer(self) -> int:
    return self.cfg.feature_layers[0]

  def adapt(self, h):
    return project("...D,DE->...E", _norm(h.astype(jnp.float32), self.scale,
                                          self.cfg.rms_norm_eps), self.proj[...])

  def train_logits(self, target, g, depth: int):
    tc = target.cfg
    return target.lm_logits(rms_norm(g, target.final_norm[...], tc.rms_norm_eps,
                                     tc.norm_plus_one))

  def exit_logits(self, target, h):
    return self.train_logits(target, self.adapt(h), 0)

  @property
  def max_depth(self) -> int | None:
    """Most chain depths it is trained for (the exit predicts the next token)."""
    return 1

  def label_offset(self, depth: int) -> tuple[int, int]:
    """The exit at position i predicts the target's greedy token after i."""
    return 0, 0

  def draft_ids(self, target_ids):
    return target_ids

  def to_target_logits(self, logits):
    return logits

  def unrolled(self, target, tokens, feats, lengths, depth: int):
    if depth != 1:
      raise ValueError(f"{depth=} must be 1 for an early_exit head")
    return [self.adapt(feats)]


# ------------------------------------------------------------------ build / save / load
def make_head(cfg: HeadConfig, seed: int = 0, draft_to_target=None) -> nnx.Module:
  """A randomly initialised head (numpy init: nothing is compiled).

  Raises:
    ValueError: a reduced-vocabulary EAGLE-3 head without a valid ``draft_to_target``.
  """
  rng = np.random.default_rng(seed)
  if cfg.kind in ("eagle", "eagle3"):
    return EagleHead(cfg, rng, draft_to_target)
  if cfg.kind == "mtp":
    return MTPHead(cfg, rng)
  if cfg.kind == "early_exit":
    return EarlyExitHead(cfg, rng)
  return MedusaHead(cfg, rng)


_CONFIG_FILE, _MAP_FILE, _PARAMS_DIR = "head_config.json", "vocab_map.npy", "params"


def save_head(path: str, head: nnx.Module) -> None:
  """Writes ``head_config.json``, ``params/`` (orbax) and, for a reduced-vocabulary
  EAGLE-3 head, ``vocab_map.npy`` (``i32[V_draft]`` draft -> target ids)."""
  import orbax.checkpoint as ocp  # noqa: PLC0415

  path = os.path.abspath(path)
  os.makedirs(path, exist_ok=True)
  cfg = head.cfg
  with open(os.path.join(path, _CONFIG_FILE), "w") as f:
    f.write(cfg.to_json())
  params = nnx.to_pure_dict(nnx.state(head, nnx.Param))
  with ocp.StandardCheckpointer() as ckpt:
    ckpt.save(os.path.join(path, _PARAMS_DIR), params, force=True)
  if cfg.draft_vocab_size is not None:
    np.save(os.path.join(path, _MAP_FILE), np.asarray(head.d2t[...]))


def load_head(path: str, target: ModelConfig | None = None) -> nnx.Module:
  """Reads a head written by ``save_head``.

  Args:
    path: the head directory.
    target: if given, the head must fit it (``HeadConfig.check_target``).

  Raises:
    ValueError: no config; a reduced-vocabulary EAGLE-3 head whose ``vocab_map.npy``
      is missing or inconsistent; a head that does not fit ``target``.
  """
  import orbax.checkpoint as ocp  # noqa: PLC0415

  path = os.path.abspath(path)
  cfg_file = os.path.join(path, _CONFIG_FILE)
  if not os.path.exists(cfg_file):
    raise ValueError(f"{path=} must contain {_CONFIG_FILE}")
  with open(cfg_file) as f:
    cfg = HeadConfig.from_json(f.read())
  if target is not None:
    cfg.check_target(target)
  d2t = None
  if cfg.draft_vocab_size is not None:
    map_file = os.path.join(path, _MAP_FILE)
    if not os.path.exists(map_file):
      raise ValueError(f"head at {path=} has draft_vocab_size={cfg.draft_vocab_size} but no "
                       f"draft -> target map ({_MAP_FILE})")
    d2t = validate_vocab_map(np.load(map_file), cfg.draft_vocab_size, cfg.vocab_size)
  head = make_head(cfg, 0, d2t)
  abstract = nnx.to_pure_dict(nnx.state(head, nnx.Param))
  with ocp.StandardCheckpointer() as ckpt:
    params = ckpt.restore(os.path.join(path, _PARAMS_DIR), abstract)
  state = nnx.state(head, nnx.Param)
  nnx.replace_by_pure_dict(state, params)
  nnx.update(head, state)
  return head


def restrict_draft_vocab(head: EagleHead, lm_weight, draft_to_target) -> EagleHead:
  """An EAGLE-3 head that drafts from a subset of the target vocabulary, made without
  training: FR-Spec (Zhao et al. 2025, "FR-Spec: Accelerating Large-Vocabulary Language
  Models via Frequency-Ranked Speculative Sampling") keeps the target LM head's rows of
  the most frequent tokens, so each draft step's LM head reads ``V'`` of ``V`` rows.
  Tokens outside the subset are never drafted; verification is unchanged (lossless).

  Args:
    head: an ``EagleHead`` of kind "eagle3" that uses the target's LM head
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
  if cfg.kind != "eagle3" or cfg.draft_vocab_size is not None:
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
  out = make_head(new_cfg, 0, ids)
  state = nnx.state(out, nnx.Param)
  params = nnx.to_pure_dict(nnx.state(head, nnx.Param))
  params["lm_head"] = jnp.asarray(lm_weight[:, ids])
  nnx.replace_by_pure_dict(state, params)
  nnx.update(out, state)
  return out


def num_params(head: nnx.Module) -> int:
  """Trainable parameter count."""
  return sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(head, nnx.Param)))
