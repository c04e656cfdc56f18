"""Building blocks shared by the head kinds: initialisers, banded dense attention, the
decoder layer, and the window/step helpers of drafting.

Attention context (the documented choice): the decoder layers of EAGLE and MTP attend
over a dense *sliding window* of the last ``window`` positions, recomputed from the
stored target features at every draft call (no head KV cache to keep in sync with
rollback). Training uses the same banded causal mask, so the head sees the same context
in training and in drafting. Within one draft call the window's K/V are projected once
and each draft step appends one K/V slot (a dense, call-local cache).

Glossary: B batch, T query positions, S key slots, N/K/H attention heads / KV heads /
head dim, A attention input width, D model dim, F ffn dim.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.layers import apply_rope, project, rms_norm, rope_inv_freq

if TYPE_CHECKING:
  from models.heads.config import HeadConfig

__all__ = ["HeadLayer", "band_mask", "dense_attention", "normal_param", "ones_param",
           "param_norm", "stack_steps", "window_positions"]

_NEG = -1e30  # finite mask value: a fully masked (padding) row stays finite


def normal_param(rng: np.random.Generator, shape, std: float) -> nnx.Param:
  """``f32[shape]`` drawn from ``N(0, std**2)`` by numpy (nothing is compiled)."""
  return nnx.Param(jnp.asarray(std * rng.standard_normal(shape, dtype=np.float32)))


def ones_param(shape) -> nnx.Param:
  """``f32[shape]`` of ones (an RMSNorm weight)."""
  return nnx.Param(jnp.ones(shape, jnp.float32))


def param_norm(x, w, eps):
  """RMSNorm of ``x [..., D]`` by the weight ``w`` (an ``nnx.Param`` ``f32[D]``)."""
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
    self.q = normal_param(rng, (attn_dim, n, h), attn_dim**-0.5)
    self.k = normal_param(rng, (attn_dim, kh, h), attn_dim**-0.5)
    self.v = normal_param(rng, (attn_dim, kh, h), attn_dim**-0.5)
    self.o = normal_param(rng, (n, h, d), (n * h) ** -0.5)
    self.ffn_norm = ones_param((d,))
    self.gate = normal_param(rng, (d, f), d**-0.5)
    self.up = normal_param(rng, (d, f), d**-0.5)
    self.down = normal_param(rng, (f, d), f**-0.5)

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
    h = param_norm(x, self.ffn_norm, cfg.rms_norm_eps)
    gate = jax.nn.silu(project("BTD,DF->BTF", h, self.gate[...]))
    up = project("BTD,DF->BTF", h, self.up[...])
    return x + project("BTF,FD->BTD", gate * up, self.down[...])


def stack_steps(tokens: list, probs: list):
  """Per-step tokens and ``pick`` outputs (any pytree, e.g. None) stacked on axis 1."""
  return jnp.stack(tokens, 1), jax.tree.map(lambda *p: jnp.stack(p, 1), *probs)


def window_positions(positions, width: int):
  """Slot positions ``i32[B, width]``: slot ``width - 1`` is at ``positions[b]``.

  Example: positions [7], width 4 -> [[4, 5, 6, 7]].
  """
  return positions[:, None] - (width - 1) + jnp.arange(width, dtype=jnp.int32)[None]
