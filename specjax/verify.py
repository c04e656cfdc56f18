"""The shared lossless rejection sampler (chain and tree drafts).

Greedy: accept the longest draft prefix equal to the target argmax, then emit the
target argmax (recovered token at the first mismatch, bonus token if all match).
Stochastic (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding"; Chen et al. 2023, "Accelerating LLM Decoding with Speculative Sampling"):
accept draft d_j with probability min(1, p_j(d_j) / q_j(d_j)), where p and q are the
target and draft distributions after the same temperature/top-k/top-p; q(d) = 0
rejects. At the first rejection sample the recovered token from
normalize(max(0, p_j - q_j)); if every draft is accepted sample the bonus token from
p_L. Rows with ``temperature < SAMPLING_EPS`` are greedy rows
(``specjax.sampling.is_greedy``).

Drafts without probabilities (q one-hot: n-gram, suffix, top-k trees) use the *coupled*
rule instead: the target's token t_j at each position is drawn from p_j alone (the
Gumbel-max race below, at that position's key), the draft d_j is accepted iff d_j = t_j,
and the first t_j not drafted is emitted. P(accept d) = p(d), as the rule above gives a
one-hot q, and on a rejection t has the residual's law (p without d), so it is lossless
with the same acceptance; and since t_j depends only on the row's prefix and key, a
seeded request emits exactly the tokens its seeded AR run would, whatever was drafted
(drafts that depend on batch partners, a shared suffix tree, preemption: ARCHITECTURE
§8). Not from a paper: it is the plain decode's own sampling (the Gumbel-max trick,
Gumbel 1954; Maddison et al. 2014, "A* Sampling") with the draft checked against it.
Drafts with q keep the optimal rule above by default: a coupled rule for them lowers
acceptance. Their drafters' ``coupled_sampling`` option (``draft_model``, ``layerskip``,
``hsddw``, the learned heads' chains; wrappers pass it on, e.g. ``drafter_options``)
trades that acceptance for the coupled rule's reproducibility: the drafter draws d_j =
argmax(log q_j + g_j) with the very noise g_j the race below uses for t_j = argmax(log
p_j + g_j) (``specjax.sampling.draft_sample``), and hands the draft over without q, so
it is verified as above (accepted iff d_j = t_j). Acceptance is then P(argmax(log q + g)
= argmax(log p + g)) <= sum_v min(p_v, q_v) (the optimal rule's, the most any coupling of
q and p reaches) and >= a / (2 - a) for a = sum_v min(p_v, q_v) (Daliri et al. 2024,
"Coupling without Communication and Drafter-Invariant Speculative Decoding", the Gumbel
protocol), and a seeded request emits its seeded AR tokens whatever its partners.

Every sampler here draws the recovered / bonus token the same way: a Gumbel-max race
``argmax_v log w_v + g_v`` (``specjax.sampling.race_sample``) over its unnormalized
weights w (the residual, or p) with the hash noise of ``pallas_kernels.verify`` seeded
by ``bits(fold_in(fold_in(request_key, position), STREAM_SAMPLE))`` at the token's
position. The chain (``rejection_sample``), fused chain (``fused_rejection_sample``)
and tree (``tree_rejection_sample``) samplers therefore give a seeded row the same token whenever they agree on its distribution (a
row with no draft, a chain-shaped tree), whichever one a step's batch partners route
it through (G3).

Tree drafts (``tree_rejection_sample``) follow SpecInfer's multi-candidate recursive
rejection sampling (Miao et al. 2024, "SpecInfer: Accelerating Large Language Model
Serving with Tree-based Speculative Inference and Verification", Alg. 2); the trees
themselves come from drafters such as EAGLE-2's dynamic trees (Li et al. 2024) or
Sequoia (Chen et al. 2024). A chain is the one-branch tree and gets exactly the chain
sampler's tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.verify import verify_rows
from specjax.sampling import (
    STREAM_ACCEPT,
    is_greedy,
    position_keys,
    processed_probs,
    race_sample,
    sample_seeds,
)

__all__ = ["fused_rejection_sample", "greedy_tree_verify", "greedy_verify", "rejection_sample",
           "tree_rejection_sample"]


def _leading_run(ok: jax.Array) -> jax.Array:
  """Length of the leading run of True along the last axis: ``bool[B, L] -> i32[B]``."""
  return jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)


def _accept_uniforms(keys, positions, length: int):
  """``f32[B, L]`` acceptance uniforms of chain position j of row b (stream ACCEPT at
  absolute position ``positions[b] + j``), shared by both chain samplers."""
  pos = positions[:, None] + jnp.arange(length)[None]  # [B, L]
  u_keys = jax.vmap(lambda k, ps: position_keys(jnp.broadcast_to(k, (length, 2)), ps,
                                                STREAM_ACCEPT))(keys, pos)
  return jax.vmap(jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32)))(u_keys)


def _target_tokens(p, keys, positions):
  """``i32[B, T]``: the target's token at each of ``positions i32[B, T]``, the race over
  ``p f32[B, T, V]`` (``specjax.sampling.race_sample``; the token a plain decode of the row draws there)."""
  return jnp.stack([race_sample(p[:, i], keys, positions[:, i]) for i in range(p.shape[1])],
                   axis=1)


def _assemble(draft_tokens, num_accepted, last_token):
  """``output[j] = draft[j]`` for j < a, ``output[a] = last_token``, then -1."""
  batch, length = draft_tokens.shape
  j = jnp.arange(length + 1)[None, :]
  padded = jnp.concatenate([draft_tokens, jnp.full((batch, 1), -1, jnp.int32)], axis=1)
  out = jnp.where(j < num_accepted[:, None], padded, -1)
  return jnp.where(j == num_accepted[:, None], last_token[:, None], out).astype(jnp.int32)


def greedy_verify(target_logits, draft_tokens, num_draft):
  """Greedy chain verification.

  Args:
    target_logits: ``f32[B, L+1, V]``; row j predicts the token after draft j-1.
    draft_tokens: ``i32[B, L]`` (-1 padded).
    num_draft: ``i32[B]`` real drafts per row (0 = plain decode).

  Returns:
    ``(output_tokens i32[B, L+1] -1 padded, num_accepted i32[B])``.
  """
  length = draft_tokens.shape[1]
  argmax = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)
  ok = (draft_tokens == argmax[:, :length]) & (jnp.arange(length)[None] < num_draft[:, None])
  accepted = _leading_run(ok)
  last = jnp.take_along_axis(argmax, accepted[:, None], axis=1)[:, 0]
  return _assemble(draft_tokens, accepted, last), accepted


def rejection_sample(
    target_logits: jax.Array,
    draft_tokens: jax.Array,
    num_draft: jax.Array,
    draft_probs: jax.Array | None,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    keys: jax.Array,
    positions: jax.Array,
    *,
    all_greedy: bool,
):
  """Lossless verification of chain drafts.

  Args:
    target_logits: ``f32[B, L+1, V]``.
    draft_tokens: ``i32[B, L]``, -1 padded.
    num_draft: ``i32[B]``.
    draft_probs: ``f32[B, L, V]`` draft distributions q (after the same sampling
      processing as the target), or None (q = one-hot of the draft token).
    temperature, top_k, top_p: ``[B]`` per-request sampling parameters.
    keys: ``u32[B, 2]`` request keys.
    positions: ``i32[B]`` absolute sequence position of the token predicted by
      ``target_logits[:, 0]`` (positions advance by one per row j).
    all_greedy: static; True skips the stochastic path entirely.

  Returns:
    ``(output_tokens i32[B, L+1] -1 padded, num_accepted i32[B])``; the emitted tokens of
    row b are ``output_tokens[b, :num_accepted[b] + 1]``.
  """
  greedy_out, greedy_acc = greedy_verify(target_logits, draft_tokens, num_draft)
  if all_greedy:
    return greedy_out, greedy_acc
  batch, length = draft_tokens.shape
  vocab = target_logits.shape[-1]
  p = processed_probs(target_logits, temperature, top_k, top_p)  # [B, L+1, V]
  greedy_row = is_greedy(temperature)[:, None]
  if draft_probs is None:  # the coupled rule (module docstring)
    t = _target_tokens(p, keys, positions[:, None] + jnp.arange(length + 1)[None])
    ok = (draft_tokens == t[:, :length]) & (jnp.arange(length)[None] < num_draft[:, None])
    accepted = _leading_run(ok)
    last = jnp.take_along_axis(t, accepted[:, None], axis=1)[:, 0]
    out = _assemble(draft_tokens, accepted, last)
    return (jnp.where(greedy_row, greedy_out, out),
            jnp.where(greedy_row[:, 0], greedy_acc, accepted))
  safe_draft = jnp.maximum(draft_tokens, 0)
  q = draft_probs.astype(jnp.float32)
  p_d = jnp.take_along_axis(p[:, :length], safe_draft[..., None], axis=-1)[..., 0]
  q_d = jnp.take_along_axis(q, safe_draft[..., None], axis=-1)[..., 0]
  u = _accept_uniforms(keys, positions, length)
  ok = (q_d > 0) & (u * q_d < p_d) & (jnp.arange(length)[None] < num_draft[:, None])
  accepted = _leading_run(ok)
  p_a = jnp.take_along_axis(p, accepted[:, None, None], axis=1)[:, 0]  # [B, V]
  q_pad = jnp.concatenate([q, jnp.zeros((batch, 1, vocab), q.dtype)], axis=1)
  q_a = jnp.take_along_axis(q_pad, accepted[:, None, None], axis=1)[:, 0]
  rejected = accepted < num_draft
  residual = jnp.maximum(p_a - jnp.where(rejected[:, None], q_a, 0.0), 0.0)
  has_mass = jnp.any(residual > 0, axis=-1, keepdims=True)
  last = race_sample(jnp.where(has_mass, residual, p_a), keys, positions + accepted)
  out = _assemble(draft_tokens, accepted, last)
  out = jnp.where(greedy_row, greedy_out, out)
  accepted = jnp.where(greedy_row[:, 0], greedy_acc, accepted)
  return out, accepted


def fused_rejection_sample(
    target_logits: jax.Array,
    draft_tokens: jax.Array,
    num_draft: jax.Array,
    draft_probs: jax.Array | None,
    temperature: jax.Array,
    keys: jax.Array,
    positions: jax.Array,
    *,
    implementation: str | tuple[str, ...] = "reference",
    interpret: bool = False,
):
  """Lossless chain verification through ``pallas_kernels.verify`` (temperature only).

  Same acceptance rule as :func:`rejection_sample` (accept draft j with probability
  min(1, p_j(d_j) / q_j(d_j)), same uniforms; the coupled rule without
  ``draft_probs``) and the same Gumbel-max draw of the
  recovered / bonus token (same seeds), but p, q(d) and the draw come from one sweep
  over V per position (``verify_rows``): no [B, L+1, V] probability or residual array is
  built. A seeded temperature-only request thus gets the same tokens as from
  :func:`rejection_sample` (up to float rounding of p). No top-k / top-p: callers use
  :func:`rejection_sample` for requests that set them.

  Args:
    target_logits: ``f32/bf16[B, L+1, V]``.
    draft_tokens: ``i32[B, L]``, -1 padded; num_draft ``i32[B]``.
    draft_probs: ``f32[B, L, V]`` draft distributions after the same temperature, or
      None (q = one-hot of the draft token).
    temperature: ``f32[B]`` (below ``SAMPLING_EPS`` = greedy row).
    keys: ``u32[B, 2]`` request keys; positions ``i32[B]`` as in :func:`rejection_sample`.
    implementation: ``pallas_kernels.verify`` implementation(s), tried in order.
    interpret: run Pallas backends in interpret mode (CPU tests).

  Returns:
    ``(output_tokens i32[B, L+1] -1 padded, num_accepted i32[B])``.
  """
  batch, length = draft_tokens.shape
  j = jnp.arange(length + 1)[None]
  padded = jnp.concatenate([draft_tokens, jnp.full((batch, 1), -1, jnp.int32)], axis=1)
  tokens = jnp.where(j < num_draft[:, None], padded, -1)
  seeds = jnp.stack([sample_seeds(keys, positions + i) for i in range(length + 1)],
                    axis=1)  # [B, L+1]
  greedy = is_greedy(temperature)
  coupled = draft_probs is None or not length  # the coupled rule (module docstring)
  # Greedy rows read only the argmax; temperature 0 keeps their p finite and unused.
  # Coupled rows pass no draft token: each row's sample is then the race over p.
  stats = verify_rows(target_logits, jnp.where(greedy, 0.0, temperature),
                      jnp.full_like(tokens, -1) if coupled else tokens, seeds,
                      None if coupled else draft_probs,
                      implementation=implementation, interpret=interpret)
  valid = j[:, :length] < num_draft[:, None]
  greedy_acc = _leading_run((draft_tokens == stats.argmax[:, :length]) & valid)
  greedy_last = jnp.take_along_axis(stats.argmax, greedy_acc[:, None], axis=1)[:, 0]
  if coupled:
    accepted = _leading_run((draft_tokens == stats.sample[:, :length]) & valid)
  else:
    u = _accept_uniforms(keys, positions, length)
    p_d, q_d = stats.p_token[:, :length], stats.q_token[:, :length]
    accepted = _leading_run((q_d > 0) & (u * q_d < p_d) & valid)
  last = jnp.take_along_axis(stats.sample, accepted[:, None], axis=1)[:, 0]
  accepted = jnp.where(greedy, greedy_acc, accepted)
  return _assemble(draft_tokens, accepted, jnp.where(greedy, greedy_last, last)), accepted


# ------------------------------------------------------------------ trees
def _depths_and_ranks(parents, valid):
  """``(depth i32[B, L], rank i32[B, L])``: depth 1 for children of the root; rank =
  how many earlier real nodes share the parent (0 = first child)."""
  batch, length = parents.shape

  def body(j, depth):
    par = parents[:, j]
    above = jnp.take_along_axis(depth, jnp.maximum(par, 0)[:, None], axis=1)[:, 0]
    return depth.at[:, j].set(jnp.where(par < 0, 1, above + 1))

  depth = jax.lax.fori_loop(0, length, body, jnp.zeros((batch, length), jnp.int32))
  same = (parents[:, :, None] == parents[:, None, :]) & valid[:, None, :]  # [B, j, i]
  earlier = jnp.arange(length)[None, :] < jnp.arange(length)[:, None]  # i < j
  return depth, jnp.sum(same & earlier[None], axis=-1).astype(jnp.int32)


def _record(path, num, accept, j):
  """Writes node ``j`` at ``path[b, num[b]]`` where ``accept[b]``."""
  at = jnp.arange(path.shape[1])[None] == num[:, None]
  return jnp.where(accept[:, None] & at, j, path)


def _coupled_tree(p, draft_tokens, parents, valid, depth, keys, positions):
  """The coupled rule on a tree (``tree_rejection_sample`` without ``draft_probs``):
  ``(output_tokens, num_accepted, accepted_nodes)`` as ``greedy_tree_verify``, with the
  target's race sample at each node (root at ``positions``, node j at ``positions +
  depth[j]``) in place of its argmax."""
  node_pos = positions[:, None] + jnp.concatenate(
      [jnp.zeros_like(depth[:, :1]), depth], axis=1)  # [B, L+1]
  return _tree_walk(_target_tokens(p, keys, node_pos), draft_tokens, parents, valid)


def _tree_walk(want, draft_tokens, parents, valid):
  """From the root, repeatedly accept the first child whose token is ``want i32[B, L+1]``
  at its parent (row 0 the root, row j + 1 node j); returns ``(output_tokens,
  num_accepted, accepted_nodes)`` with ``want`` at the last accepted node emitted."""
  batch, length = draft_tokens.shape

  # One pass in node order suffices: the children of the current node all come after
  # it, and once a child is accepted its later siblings are no longer children of the
  # current node.
  def step(carry, xs):
    cur, num, path = carry
    j, tok, par, ok = xs
    here = jnp.take_along_axis(want, cur[:, None], axis=1)[:, 0]
    accept = ok & (par + 1 == cur) & (tok == here)
    path = _record(path, num, accept, j)
    return (jnp.where(accept, j + 1, cur), num + accept, path), None

  init = (jnp.zeros(batch, jnp.int32), jnp.zeros(batch, jnp.int32),
          jnp.full((batch, length), -1, jnp.int32))
  xs = (jnp.arange(length, dtype=jnp.int32), draft_tokens.T, parents.T, valid.T)
  (cur, num, path), _ = jax.lax.scan(step, init, xs)
  last = jnp.take_along_axis(want, cur[:, None], axis=1)[:, 0]
  return _path_output(draft_tokens, path, num, last), num, path


def _path_output(draft_tokens, path, num_accepted, last_token):
  """``output_tokens i32[B, L+1]``: the path's tokens, then ``last_token``, then -1."""
  path_tokens = jnp.take_along_axis(draft_tokens, jnp.maximum(path, 0), axis=1)
  return _assemble(path_tokens, num_accepted, last_token)


def greedy_tree_verify(target_logits, draft_tokens, parents, num_draft):
  """Greedy tree verification: from the root, repeatedly accept the first child whose
  token equals the target argmax at its parent.

  Args:
    target_logits: ``f32[B, L+1, V]``; row 0 is the root, row ``j + 1`` node j.
    draft_tokens: ``i32[B, L]`` node tokens (-1 padded).
    parents: ``i32[B, L]`` (-1 = child of the root; parents before children).
    num_draft: ``i32[B]`` real nodes per row.

  Returns:
    ``(output_tokens i32[B, L+1], num_accepted i32[B], accepted_nodes i32[B, L])``:
    the accepted path's tokens then the target argmax after it (-1 padded), its length,
    and its node indices by depth (-1 padded).
  """
  length = draft_tokens.shape[1]
  argmax = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [B, L+1]
  valid = jnp.arange(length)[None] < num_draft[:, None]
  return _tree_walk(argmax, draft_tokens, parents, valid)


def tree_rejection_sample(
    target_logits: jax.Array,
    draft_tokens: jax.Array,
    parents: jax.Array,
    num_draft: jax.Array,
    draft_probs: jax.Array | None,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    keys: jax.Array,
    positions: jax.Array,
    *,
    all_greedy: bool,
):
  """Lossless verification of tree drafts (SpecInfer's recursive rejection sampling).

  At the current node with target distribution r (initially p at the node), its
  children c_1, c_2, .. are tried in node order: child c with token x and draft
  distribution q_c is accepted with probability min(1, r(x) / q_c(x)) (q_c(x) = 0
  rejects); acceptance moves to c with r = p at c. A rejection replaces r by
  normalize(max(0, r - q_c)) and tries the next child. When no child is left, the
  recovered (after a rejection) or bonus token is sampled from r. Each stage is one
  speculative-sampling step whose fallback is the next stage, so the emitted tokens
  follow p exactly whenever each child's token was drawn from its q_c given the
  earlier siblings, e.g. i.i.d. from the parent's draft distribution, or chosen
  deterministically (top-k trees: pass no probabilities, q_c = one-hot of x, and the
  residual just removes x). Greedy rows (temperature below ``SAMPLING_EPS``) use
  ``greedy_tree_verify``.

  Without ``draft_probs`` (top-k trees) the coupled rule of the module docstring: the
  target's token t at the current node is the race over p there, the first child whose
  token is t is accepted, and t is emitted where no child has it; the tokens are then
  exactly a plain decode's (and a one-branch tree's are the chain samplers').

  Randomness: the uniform of a node at depth d and sibling rank r uses
  ``fold_in(request_key, positions + d - 1)`` on the accept stream, folded once more
  with r when r > 0; the final token is the chain samplers' Gumbel-max race at
  ``positions + num_accepted`` over the same unnormalized weights (p at the node, or
  the last rejection's residual max(r - q, 0)). So a one-branch tree, and a row with no
  nodes, gets exactly :func:`rejection_sample`'s tokens, and the fused sampler's up to
  float rounding of p.

  Args:
    target_logits: ``f32[B, L+1, V]``; row 0 is the root, row ``j + 1`` node j.
    draft_tokens: ``i32[B, L]``, -1 padded.
    parents: ``i32[B, L]`` parent node (-1 = the root), parents before children.
    num_draft: ``i32[B]`` real nodes per row.
    draft_probs: ``f32[B, L, V]``: the distribution node j's token was drawn from
      (after the same sampling processing as the target), or None (one-hot).
    temperature, top_k, top_p: ``[B]`` per-request sampling parameters.
    keys: ``u32[B, 2]`` request keys.
    positions: ``i32[B]`` absolute position of the token predicted by
      ``target_logits[:, 0]`` (a node at depth d predicts position ``positions + d``).
    all_greedy: static; True skips the stochastic path entirely.

  Returns:
    ``(output_tokens i32[B, L+1], num_accepted i32[B], accepted_nodes i32[B, L])`` as
    ``greedy_tree_verify``; row b emits ``output_tokens[b, :num_accepted[b] + 1]``.
  """
  greedy = greedy_tree_verify(target_logits, draft_tokens, parents, num_draft)
  if all_greedy:
    return greedy
  batch, length = draft_tokens.shape
  vocab = target_logits.shape[-1]
  p = processed_probs(target_logits, temperature, top_k, top_p)  # [B, L+1, V]
  valid = jnp.arange(length)[None] < num_draft[:, None]
  depth, rank = _depths_and_ranks(parents, valid)
  greedy_row = is_greedy(temperature)
  if draft_probs is None:
    out, num, path = _coupled_tree(p, draft_tokens, parents, valid, depth, keys, positions)
    return (jnp.where(greedy_row[:, None], greedy[0], out),
            jnp.where(greedy_row, greedy[1], num),
            jnp.where(greedy_row[:, None], greedy[2], path))

  def uniform(key, pos, r):
    k = jax.random.fold_in(jax.random.fold_in(key, pos), STREAM_ACCEPT)
    k = jnp.where(r > 0, jax.random.fold_in(k, r), k)
    return jax.random.uniform(k, (), jnp.float32)

  u = jax.vmap(jax.vmap(uniform, (None, 0, 0)))(keys, positions[:, None] + depth - 1, rank)
  safe = jnp.maximum(draft_tokens, 0)

  def step(carry, xs):
    cur, num, path, r, w = carry  # w: unnormalized weights of the final draw
    j, tok, par, ok, u_j, q_j = xs
    q = jax.nn.one_hot(tok, vocab, dtype=jnp.float32) if q_j is None else q_j
    r_x = jnp.take_along_axis(r, tok[:, None], axis=1)[:, 0]
    q_x = jnp.take_along_axis(q, tok[:, None], axis=1)[:, 0]
    is_child = ok & (par + 1 == cur)
    accept = is_child & (q_x > 0) & (u_j * q_x < r_x)
    reject = is_child & ~accept
    residual = jnp.maximum(r - q, 0.0)
    mass = jnp.sum(residual, axis=-1, keepdims=True)
    r_rejected = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), r)
    w_rejected = jnp.where(mass > 0, residual, r)
    p_child = jax.lax.dynamic_index_in_dim(p, j + 1, axis=1, keepdims=False)
    r = jnp.where(accept[:, None], p_child, jnp.where(reject[:, None], r_rejected, r))
    w = jnp.where(accept[:, None], p_child, jnp.where(reject[:, None], w_rejected, w))
    path = _record(path, num, accept, j)
    return (jnp.where(accept, j + 1, cur), num + accept, path, r, w), None

  q_xs = None if draft_probs is None else jnp.moveaxis(draft_probs.astype(jnp.float32), 1, 0)
  init = (jnp.zeros(batch, jnp.int32), jnp.zeros(batch, jnp.int32),
          jnp.full((batch, length), -1, jnp.int32), p[:, 0], p[:, 0])
  xs = (jnp.arange(length, dtype=jnp.int32), safe.T, parents.T, valid.T, u.T, q_xs)
  (_, num, path, _, w), _ = jax.lax.scan(step, init, xs)
  last = race_sample(w, keys, positions + num)
  out = _path_output(draft_tokens, path, num, last)
  return (jnp.where(greedy_row[:, None], greedy[0], out), jnp.where(greedy_row, greedy[1], num),
          jnp.where(greedy_row[:, None], greedy[2], path))
