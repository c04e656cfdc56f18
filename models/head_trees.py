"""Tree drafting with learned heads: EAGLE-2 dynamic trees and Medusa candidate trees.

Sources:
  * EAGLE-2: Li et al. 2024, "EAGLE-2: Faster Inference of Language Models with Dynamic
    Draft Trees". A node's score is its cumulative draft log-probability (the sum over
    its path). Depth 1 holds the root's top-``branching`` tokens; each further depth
    expands the ``branching`` best nodes of the previous depth, each with its own
    top-``branching`` children; finally all candidates are reranked and the best
    ``num_nodes`` kept. Tree attention inside the head: an expanded node sees the real
    window and its own ancestors (as ``EagleHead.draft``'s chain does).
  * Medusa: Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with
    Multiple Decoding Heads". Head j's top-``branching`` tokens are the candidates at
    depth j + 1 whatever the parent; the tree is their cartesian product pruned to the
    ``num_nodes`` best prefixes by summed log-probability. (Medusa ships a calibrated
    fixed tree; this prunes by each step's own head probabilities.) Because a child's
    log-probability does not depend on its parent, a beam of ``num_nodes`` per depth
    holds every prefix of the best set, so the pruning is exact.

Node order of the result: rank order (best score first, ties to the earlier-created
candidate). A child's score is its parent's plus a log-probability <= 0 and it is
created after its parent, so this order lists parents first (``specjax.tree``) and the
first n nodes are the best n-node tree: a budget can prune by prefix.

Glossary: B batch, W window slots, C candidates, V vocab, D model dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["eagle2_capacity", "eagle2_tree", "medusa_capacity", "medusa_tree",
           "select_top_nodes", "top_children"]


def eagle2_capacity(depth: int, branching: int) -> int:
  """Candidates an EAGLE-2 tree chooses from: ``b + (depth - 1) * b**2`` (b=2, depth 3: 10)."""
  return branching + (depth - 1) * branching * branching


def medusa_capacity(depth: int, branching: int, num_nodes: int) -> int:
  """Candidates of a Medusa tree with a beam of ``num_nodes`` per depth (b=2, depth 3,
  n=3: 2 + 2*2 + 3*2 = 12)."""
  total, beam = 0, 1
  for _ in range(depth):
    total += beam * branching
    beam = min(num_nodes, beam * branching)
  return total


def top_children(logits: jax.Array, branching: int):
  """``logits f32[..., V]`` -> ``(tokens i32[..., b], log_probs f32[..., b])``, best first
  (ties to the lower token id, like ``argmax``); log-probabilities are clipped to <= 0."""
  _, tokens = jax.lax.top_k(logits, branching)
  log_probs = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), tokens, axis=-1)
  return tokens.astype(jnp.int32), jnp.minimum(log_probs, 0.0)


def _rank(scores: jax.Array, count: int) -> jax.Array:
  """Indices ``i32[B, count]`` of the best scores, ties to the lower index."""
  return jnp.argsort(-scores, axis=-1, stable=True)[:, :count].astype(jnp.int32)


def select_top_nodes(tokens, scores, parents, num_nodes: int):
  """Keeps the ``num_nodes`` best candidates, in rank order.

  Args:
    tokens: ``i32[B, C]`` candidate tokens.
    scores: ``f32[B, C]`` cumulative log-probabilities.
    parents: ``i32[B, C]`` parent candidate (-1 = the root); each parent is created
      before its children (lower index) and scores at least as high.
    num_nodes: static n <= C.

  Returns:
    ``(tokens i32[B, n], parents i32[B, n])`` with parents as indices into the kept
    nodes (-1 = the root); parents come first.
  """
  batch, num_candidates = scores.shape
  order = _rank(scores, num_nodes)
  rank_of = jnp.full((batch, num_candidates), -1, jnp.int32)
  rank_of = rank_of.at[jnp.arange(batch)[:, None], order].set(
      jnp.arange(num_nodes, dtype=jnp.int32)[None])
  kept_parents = jnp.take_along_axis(parents, order, axis=1)
  new_parents = jnp.take_along_axis(rank_of, jnp.maximum(kept_parents, 0), axis=1)
  return (jnp.take_along_axis(tokens, order, axis=1),
          jnp.where(kept_parents < 0, -1, new_parents).astype(jnp.int32))


def eagle2_tree(head, target, tokens, feats, num_valid, positions, depth: int,
                branching: int, num_nodes: int):
  """EAGLE-2 dynamic tree from an ``EagleHead`` (EAGLE-1 or EAGLE-3).

  Args:
    head: a ``models.heads.EagleHead``.
    target: the target ``Transformer`` (embedding and LM head).
    tokens, feats, num_valid, positions: the window, as ``EagleHead.draft``.
    depth: most levels (static, >= 1).
    branching: children per expanded node and expanded nodes per depth (static).
    num_nodes: nodes kept (static, <= ``eagle2_capacity(depth, branching)``).

  Returns:
    ``(tokens i32[B, num_nodes], parents i32[B, num_nodes])`` in rank order.

  With ``branching`` 1 the tree is the chain ``EagleHead.draft`` drafts greedily: the
  same slots, positions and masks (expanded nodes of depth d use slots
  ``W + (d - 1) * b ..``, at position ``positions + d``).
  """
  batch, width = tokens.shape
  b = branching
  extra = (depth - 1) * b
  slot_pos = positions[:, None] - (width - 1) + jnp.arange(width, dtype=jnp.int32)[None]
  real = jnp.arange(width)[None] >= width - num_valid[:, None]  # [B, W]
  x_attn, resid = head.layer_inputs(target, tokens, head.real_hidden(feats))
  k, v = head.layer.kv(x_attn, slot_pos)
  pad = ((0, 0), (0, extra), (0, 0), (0, 0))
  k, v = jnp.pad(k, pad), jnp.pad(v, pad)

  def children(g):  # top-b over the head's own (draft) vocabulary, as target ids
    tok, lp = top_children(head.draft_logits(target, g), b)
    return head.to_target_ids(tok), lp

  root_mask = jnp.concatenate([real, jnp.zeros((batch, extra), bool)], 1)[:, None]
  g = head.layer(x_attn[:, -1:], resid[:, -1:], positions[:, None], k, v, root_mask)
  tok, score = children(g[:, 0])  # [B, b]
  cand_tok, cand_score, cand_par = [tok], [score], [jnp.full((batch, b), -1, jnp.int32)]
  front_idx = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32), (batch, b))
  front_g = jnp.broadcast_to(g, (batch, b, g.shape[-1]))
  front_vis = jnp.zeros((batch, b, extra), bool)  # expanded ancestors' slots
  created = b
  for d in range(1, depth):
    lo = (d - 1) * b  # this depth's slots: width + lo ..
    q_attn, q_resid = head.layer_inputs(target, tok, front_g)
    q_pos = jnp.broadcast_to(positions[:, None] + d, (batch, b))
    kd, vd = head.layer.kv(q_attn, q_pos)
    k = k.at[:, width + lo: width + lo + b].set(kd)
    v = v.at[:, width + lo: width + lo + b].set(vd)
    own = jnp.arange(extra)[None, :] == lo + jnp.arange(b)[:, None]  # [b, extra]
    vis = front_vis | own[None]
    mask = jnp.concatenate([jnp.broadcast_to(real[:, None], (batch, b, width)), vis], 2)
    g = head.layer(q_attn, q_resid, q_pos, k, v, mask)  # [B, b, D]
    child_tok, child_lp = children(g)  # [B, b, b]
    child_score = (score[:, :, None] + child_lp).reshape(batch, b * b)
    child_tok = child_tok.reshape(batch, b * b)
    cand_tok.append(child_tok)
    cand_score.append(child_score)
    cand_par.append(jnp.repeat(front_idx, b, axis=1))
    if d < depth - 1:
      sel = _rank(child_score, b)  # the next depth's expanded nodes
      src = sel // b  # which expanded node each comes from
      front_idx = created + sel
      tok = jnp.take_along_axis(child_tok, sel, axis=1)
      score = jnp.take_along_axis(child_score, sel, axis=1)
      front_g = jnp.take_along_axis(g, src[:, :, None], axis=1)
      front_vis = jnp.take_along_axis(vis, src[:, :, None], axis=1)
    created += b * b
  return select_top_nodes(jnp.concatenate(cand_tok, 1), jnp.concatenate(cand_score, 1),
                          jnp.concatenate(cand_par, 1), num_nodes)


def medusa_tree(head, target, feats, depth: int, branching: int, num_nodes: int):
  """Medusa candidate tree from a ``models.heads.MedusaHead``.

  Args:
    head: the Medusa head (``depth <= num_modules``).
    target: the target ``Transformer`` (LM head).
    feats: ``[B, W, F]`` window; the last slot holds ``f_{m-2}`` (see ``MedusaHead.draft``).
    depth, branching, num_nodes: static; ``num_nodes <= medusa_capacity(..)``.

  Returns:
    ``(tokens i32[B, num_nodes], parents i32[B, num_nodes])`` in rank order.
  """
  h = feats[:, -1]
  batch = h.shape[0]
  cand_tok, cand_score, cand_par = [], [], []
  beam_idx = jnp.full((batch, 1), -1, jnp.int32)
  beam_score = jnp.zeros((batch, 1), jnp.float32)
  created = 0
  for d in range(depth):
    tok, lp = top_children(target.lm_logits(head.blocks[d](h)), branching)  # [B, b]
    m = beam_idx.shape[1]
    score = (beam_score[:, :, None] + lp[:, None, :]).reshape(batch, m * branching)
    cand_tok.append(jnp.tile(tok, (1, m)))
    cand_score.append(score)
    cand_par.append(jnp.repeat(beam_idx, branching, axis=1))
    sel = _rank(score, min(num_nodes, m * branching))
    beam_idx = created + sel
    beam_score = jnp.take_along_axis(score, sel, axis=1)
    created += m * branching
  return select_top_nodes(jnp.concatenate(cand_tok, 1), jnp.concatenate(cand_score, 1),
                          jnp.concatenate(cand_par, 1), num_nodes)
