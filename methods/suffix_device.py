"""Suffix decoding on the device: pure jnp drafts over token arrays, and the device
global cache of responses (``SuffixDeviceState``).

Gives exactly the path drafts of the host oracle ``methods.suffix.SuffixTree.speculate``
(``tree=False``) for a batch of rows, without building a tree: a suffix tree's counts
are occurrence counts of token strings, which are computed here by comparing the
context with every position of a token array.

Formulation (per row; ``D`` = ``max_tree_depth``, ``ctx`` the last ``D`` tokens).
Index an occurrence of a string by the corpus position ``e`` of its LAST token. The
match length ``mlen[e]`` is the largest ``m <= len(ctx) - 1`` with ``corpus[e - t] ==
ctx[-1 - t]`` for all ``t < m`` (a running AND over ``t``, as in ``methods.ngram_device``).
For every match length m at once (axis ``T = D - 1``):

* the node of the context's last m tokens has count ``c0 = #{e: mlen[e] >= m}``; it has
  children iff some such e continues (``corpus[e + 1] >= 0``); the host stops at the
  first m without children, and so do these (the sets shrink as m grows).
* path step j: the occurrences still on the path (``alive``) vote with their next token
  ``corpus[e + 1 + j]``; ``count(child) = `` its votes (a per-row histogram over the
  vocabulary); the child with the most votes wins, ties going to the child whose latest
  occurrence is latest (largest ``(sequence, position)`` key, the host's rule); the path
  continues while ``count(child) / c0 >= min_token_prob`` (the probability telescopes),
  for at most ``min(budget, floor(m * factor + offset), D - m)`` tokens.
* the draft of m scores ``sum(count) / c0``; the best score wins (ties: the longer
  match), compared exactly as fractions: whole parts first, then the remainders
  cross-multiplied in u32 (exact while every count is below 65,536).
* the probability test ``count / c0 >= min_token_prob`` is an IEEE f32 division and
  compare, as the host does it (``_f32_at_least``).

The local corpus of a row is its own history; the global corpus is the responses of the
device cache (finished ones in an archive ring, running ones read from the engine's
slots), shared by all rows. The better of the two wins (ties: local), as on the host.

Cost per row and iteration: ``O(D * N)`` compares to match and ``O(k * D * (N + V))``
to vote, for ``N`` corpus positions (``M`` local; archive size + slots x ``M`` global)
and vocabulary size ``V``: linear in the corpus, where the host's trie walks
``O(D^2)`` nodes. Fine at the batch sizes measured (1-16 rows, a few 10k cached
tokens); a device index (hashing, as vLLM's proposal #51788 does) would be the next step
for large caches and batches.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["SuffixDeviceParams", "SuffixDeviceState", "fraction_at_least", "global_corpus", "init_suffix_state",
           "release_slots", "reset_slots", "spec_caps", "suffix_draft_device",
           "suffix_paths_device"]


def spec_caps(depth: int, max_spec_factor: float, max_spec_offset: float) -> np.ndarray:
  """``i32[depth - 1]``: for m = 1 .. depth - 1, the most tokens a match of length m
  drafts, ``max(0, floor(m * factor + offset))`` (computed as the host does, in f64)."""
  return np.asarray([max(0, math.floor(m * max_spec_factor + max_spec_offset + 1e-6))
                     for m in range(1, depth)], np.int32)


def _shift(x: jax.Array, s: int) -> jax.Array:
  """``y[..., e] = x[..., e - s]`` (s > 0: right, s < 0: left), -1 where out of range."""
  n = x.shape[-1]
  if abs(s) >= n:
    return jnp.full_like(x, -1)
  pad = [(0, 0)] * (x.ndim - 1)
  if s >= 0:
    return jnp.pad(x[..., : n - s], pad + [(s, 0)], constant_values=-1)
  return jnp.pad(x[..., -s:], pad + [(0, -s)], constant_values=-1)


def fraction_at_least(a: jax.Array, b: jax.Array, c: jax.Array, d: jax.Array) -> jax.Array:
  """``a / b >= c / d`` exactly for non-negative ints with ``1 <= b, d < 65536``: whole
  parts compared, then the remainders cross-multiplied (``< 2^32`` in u32)."""
  b, d = jnp.maximum(b, 1), jnp.maximum(d, 1)
  qa, ra = a // b, a % b
  qc, rc = c // d, c % d
  u = lambda x: x.astype(jnp.uint32)
  return (qa > qc) | ((qa == qc) & (u(ra) * u(d) >= u(rc) * u(b)))


def _context(tokens: jax.Array, num_tokens: jax.Array, depth: int):
  """``(ctx i32[B, D], ctx_len i32[B])``: each row's last ``D`` tokens, right-aligned,
  -1 padded on the left."""
  cols = num_tokens[:, None] - depth + jnp.arange(depth, dtype=jnp.int32)[None]  # [B, D]
  ctx = jnp.take_along_axis(tokens, jnp.clip(cols, 0, tokens.shape[1] - 1), axis=1)
  return jnp.where(cols >= 0, ctx, -1), jnp.minimum(num_tokens, depth)


def suffix_paths_device(corpus: jax.Array, key_hi: jax.Array, key_lo: jax.Array,
                        ctx: jax.Array, ctx_len: jax.Array, budgets: jax.Array, *, k: int,
                        caps: np.ndarray, min_token_prob: float, vocab_size: int):
  """The best path draft of each row against one corpus (module docstring).

  Args:
    corpus: ``i32[B or 1, N]`` token strings separated by -1 (-1 never matches); row b
      of ``ctx`` is matched against ``corpus[b]`` (or the one shared row).
    key_hi, key_lo: ``i32[B or 1, N]``, the tie-break key ``(sequence, position)`` of each
      corpus position (increasing along a string).
    ctx: ``i32[B, D]`` the rows' last D tokens (right-aligned, -1 padded);
      ``ctx_len i32[B]`` how many are real.
    budgets: ``i32[B]`` the most drafts per row (``<= k``; ``<= 0``: none).
    k: static draft width. caps: ``spec_caps(D, ..)``. min_token_prob: static.
    vocab_size: static, V (every corpus token is in ``[0, V)`` or -1).

  Returns:
    ``(tokens i32[B, k] (-1 padded), num i32[B], score_num i32[B], score_den i32[B])``:
    the draft's score is ``score_num / score_den`` (``0 / 1`` when nothing matched).
  """
  rows, depth = ctx.shape
  t_max = depth - 1  # match lengths 1 .. D - 1
  n = corpus.shape[-1]
  # Match lengths (running AND over t, as methods.ngram_device).
  run = jnp.ones((rows, n), bool)
  mlen = jnp.zeros((rows, n), jnp.int32)
  for t in range(t_max):
    sh = _shift(corpus, t)
    ok = (ctx[:, depth - 1 - t][:, None] == sh) & (sh >= 0) & (t < ctx_len - 1)[:, None]
    run = run & ok
    mlen = mlen + run
  ms = jnp.arange(1, t_max + 1, dtype=jnp.int32)  # [T]
  alive = mlen[:, None, :] >= ms[None, :, None]  # [B, T, N]
  c0 = jnp.sum(alive, axis=-1, dtype=jnp.int32)  # [B, T] count of the m-suffix's node
  nxt = _shift(corpus, -1)
  has_child = jnp.any(alive & (nxt >= 0)[:, None, :], axis=-1)  # [B, T]
  caps = jnp.asarray(caps, jnp.int32)
  cap = jnp.minimum(jnp.minimum(jnp.clip(budgets, 0, k)[:, None], caps[None]),
                    depth - ms[None])  # [B, T] most path tokens
  going = has_child & (cap > 0)
  total = jnp.zeros((rows, t_max), jnp.int32)
  num = jnp.zeros((rows, t_max), jnp.int32)
  paths = []
  low = jnp.iinfo(jnp.int32).min
  count_tokens = jax.vmap(jax.vmap(lambda t, w: jnp.bincount(t, w, length=vocab_size),
                                   in_axes=(None, 0)), in_axes=(0, 0))
  hi = jnp.broadcast_to(key_hi, (rows, n))[:, None, :]
  lo = jnp.broadcast_to(key_lo, (rows, n))[:, None, :]
  for j in range(k):
    cont = jnp.broadcast_to(_shift(corpus, -(j + 1)), (rows, n))  # next token of each e
    cand = alive & (cont >= 0)[:, None, :] & going[..., None]  # [B, T, N]
    bins = count_tokens(jnp.maximum(cont, 0), cand.astype(jnp.int32))  # [B, T, V]
    votes = jnp.take_along_axis(bins, jnp.broadcast_to(jnp.maximum(cont, 0)[:, None, :],
                                                       cand.shape), axis=-1)
    votes = jnp.where(cand, votes, -1)
    best = jnp.max(votes, axis=-1)  # [B, T] count of the chosen child
    tie = votes == best[..., None]
    top_hi = jnp.max(jnp.where(tie, hi, low), axis=-1)
    tie = tie & (hi == top_hi[..., None])
    top_lo = jnp.max(jnp.where(tie, lo, low), axis=-1)
    tie = tie & (lo == top_lo[..., None])
    token = jnp.max(jnp.where(tie, cont[:, None, :], -1), axis=-1)  # one position left
    prob = best.astype(jnp.float32) / jnp.maximum(c0, 1).astype(jnp.float32)
    ok = going & (best > 0) & (prob >= np.float32(min_token_prob))
    paths.append(jnp.where(ok, token, -1))
    total = total + jnp.where(ok, best, 0)
    num = num + ok
    alive = alive & (cont[:, None, :] == token[..., None])
    going = ok & (j + 1 < cap)
  paths = jnp.stack(paths, axis=-1)  # [B, T, k]
  # Best over m (host: ascending m, ``score >= best`` replaces, stop at no children).
  b_num = jnp.zeros(rows, jnp.int32)
  b_den = jnp.ones(rows, jnp.int32)
  b_m = jnp.full(rows, -1, jnp.int32)
  for mi in range(t_max):
    take = has_child[:, mi] & fraction_at_least(total[:, mi], c0[:, mi], b_num, b_den)
    b_num = jnp.where(take, total[:, mi], b_num)
    b_den = jnp.where(take, c0[:, mi], b_den)
    b_m = jnp.where(take, mi, b_m)
  pick = jnp.maximum(b_m, 0)
  tokens = jnp.take_along_axis(paths, pick[:, None, None], axis=1)[:, 0]
  count = jnp.where(b_m >= 0, jnp.take_along_axis(num, pick[:, None], axis=1)[:, 0], 0)
  tokens = jnp.where(jnp.arange(k)[None] < count[:, None], tokens, -1)
  b_num = jnp.where(count > 0, b_num, 0)
  b_den = jnp.where(count > 0, b_den, 1)
  return tokens.astype(jnp.int32), count.astype(jnp.int32), b_num, b_den


# ---------------------------------------------------------------- the device cache
@functools.partial(jax.tree_util.register_dataclass, data_fields=[],
                   meta_fields=["vocab_size"])
@dataclasses.dataclass(frozen=True)
class SuffixDeviceParams:
  """Static parameters of the fused suffix proposer: the target's vocabulary size V."""

  vocab_size: int


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SuffixDeviceState:
  """The device global cache (G archive tokens, S decode slots).

  Attributes:
    archive_tokens: ``i32[G]`` finished responses, each followed by -1 (-1: empty).
    archive_seq, archive_pos: ``i32[G]`` each token's response id and position in it.
    write: ``i32[]`` where the next response is written.
    slot_seq: ``i32[S]`` the response id of the request in each slot (-1: none).
    slot_first: ``i32[S]`` where that response starts in the slot's tokens (the
      request's length when it got the slot: prompt and first token are not response).
    next_seq: ``i32[]`` the next response id (ids grow in the order the host's
      ``GlobalCache.new_sequence`` hands them out).
  """

  archive_tokens: jax.Array
  archive_seq: jax.Array
  archive_pos: jax.Array
  write: jax.Array
  slot_seq: jax.Array
  slot_first: jax.Array
  next_seq: jax.Array


def init_suffix_state(num_slots: int, archive_tokens: int) -> SuffixDeviceState:
  """An empty cache of ``archive_tokens`` archive positions and ``num_slots`` slots."""
  g = archive_tokens
  return SuffixDeviceState(
      archive_tokens=jnp.full(g, -1, jnp.int32), archive_seq=jnp.full(g, -1, jnp.int32),
      archive_pos=jnp.zeros(g, jnp.int32), write=jnp.zeros((), jnp.int32),
      slot_seq=jnp.full(num_slots, -1, jnp.int32),
      slot_first=jnp.zeros(num_slots, jnp.int32), next_seq=jnp.zeros((), jnp.int32))


def _kept(seq: jax.Array, next_seq: jax.Array, max_cached_requests: int) -> jax.Array:
  """Responses the host's FIFO keeps: the newest ``max_cached_requests`` (-1: all)."""
  if max_cached_requests < 0:
    return seq >= 0
  return (seq >= 0) & (seq >= next_seq - max_cached_requests)


def global_corpus(state: SuffixDeviceState, slot_tokens: jax.Array, slot_num_tokens: jax.Array,
                  max_cached_requests: int):
  """``(tokens, seq, pos)``, each ``i32[G + S * M]``: the archive, then every slot's
  running response (``slot_tokens[s, slot_first[s]:slot_num_tokens[s]]``), -1 elsewhere
  and for responses the FIFO dropped."""
  s, m = slot_tokens.shape
  p = jnp.arange(m, dtype=jnp.int32)[None]
  seq = jnp.broadcast_to(state.slot_seq[:, None], (s, m))
  live = ((p >= state.slot_first[:, None]) & (p < slot_num_tokens[:, None])
          & _kept(seq, state.next_seq, max_cached_requests))
  run_tok = jnp.where(live, slot_tokens, -1).reshape(-1)
  run_pos = jnp.broadcast_to(p - state.slot_first[:, None], (s, m)).reshape(-1)
  arch_ok = _kept(state.archive_seq, state.next_seq, max_cached_requests)
  tokens = jnp.concatenate([jnp.where(arch_ok, state.archive_tokens, -1), run_tok])
  return tokens, jnp.concatenate([state.archive_seq, seq.reshape(-1)]), jnp.concatenate(
      [state.archive_pos, run_pos])


def reset_slots(state: SuffixDeviceState, slots: jax.Array, num_tokens: jax.Array,
                max_cached_requests: int) -> SuffixDeviceState:
  """New requests in ``slots i32[n]`` (-1: padding) of ``num_tokens i32[n]`` tokens: each
  starts an empty response, ids in row order (none when the cache is off)."""
  real = slots >= 0
  if max_cached_requests == 0:
    ids = jnp.full_like(slots, -1)
    nxt = state.next_seq
  else:
    ids = state.next_seq + jnp.cumsum(real.astype(jnp.int32)) - 1
    nxt = state.next_seq + jnp.sum(real, dtype=jnp.int32)
  idx = jnp.where(real, slots, state.slot_seq.shape[0])
  return dataclasses.replace(
      state, slot_seq=state.slot_seq.at[idx].set(ids, mode="drop"),
      slot_first=state.slot_first.at[idx].set(num_tokens, mode="drop"), next_seq=nxt)


def release_slots(state: SuffixDeviceState, slot_tokens: jax.Array, slots: jax.Array,
                  num_tokens: jax.Array) -> SuffixDeviceState:
  """Moves the responses of released ``slots i32[n]`` (-1: padding; their final committed
  lengths ``num_tokens i32[n]``, as the host has them) into the archive, one after the
  other, each followed by -1. A response that does not fit before the archive's end
  starts again at 0 (overwriting the oldest); one longer than the archive keeps its
  first ``G - 1`` tokens."""
  g = state.archive_tokens.shape[0]
  s, m = slot_tokens.shape
  p = jnp.arange(m, dtype=jnp.int32)
  for i in range(slots.shape[0]):
    slot = jnp.maximum(slots[i], 0)
    seq = jnp.where(slots[i] >= 0, state.slot_seq[slot], -1)
    first = state.slot_first[slot]
    length = jnp.where(seq >= 0, jnp.clip(num_tokens[i] - first, 0, g - 1), 0)
    start = jnp.where(state.write + length + 1 > g, 0, state.write)
    src = jnp.take(slot_tokens[slot], jnp.clip(first + p, 0, m - 1))
    dst = jnp.where((p < length) & (seq >= 0), start + p, g)  # g: dropped
    sep = jnp.where(seq >= 0, start + length, g)
    state = dataclasses.replace(
        state,
        archive_tokens=state.archive_tokens.at[dst].set(src, mode="drop")
        .at[sep].set(-1, mode="drop"),
        archive_seq=state.archive_seq.at[dst].set(seq, mode="drop").at[sep].set(-1, mode="drop"),
        archive_pos=state.archive_pos.at[dst].set(p, mode="drop"),
        write=jnp.where(seq >= 0, start + length + 1, state.write),
        slot_seq=state.slot_seq.at[jnp.where(slots[i] >= 0, slot, s)].set(-1, mode="drop"))
  return state


def suffix_draft_device(tokens: jax.Array, num_tokens: jax.Array, budgets: jax.Array,
                        corpus=None, *, k: int, depth: int, caps: np.ndarray,
                        min_token_prob: float, vocab_size: int):
  """Suffix drafts of a batch of rows: the better of the local and the global corpus.

  Args:
    tokens: ``i32[B, M]`` each row's history (its first ``num_tokens[b]`` entries).
    num_tokens: ``i32[B]`` (0: inactive row). budgets: ``i32[B]``.
    corpus: None (no global cache) or ``global_corpus(..)``'s ``(tokens, seq, pos)``.
    k, depth, caps, min_token_prob, vocab_size: static (``suffix_paths_device``).

  Returns:
    ``(drafts i32[B, k], num i32[B])``: equal to the host ``SuffixDecoding.speculate``'s
    path drafts of the same local and global trees.
  """
  m = tokens.shape[1]
  pos = jnp.arange(m, dtype=jnp.int32)[None]
  local = jnp.where(pos < num_tokens[:, None], tokens, -1)
  ctx, ctx_len = _context(tokens, num_tokens, depth)
  args = dict(k=k, caps=caps, min_token_prob=min_token_prob, vocab_size=vocab_size)
  draft, num, s_num, s_den = suffix_paths_device(local, jnp.zeros_like(pos), pos, ctx, ctx_len,
                                                 budgets, **args)
  if corpus is not None:
    g_tok, g_seq, g_pos = corpus
    g_draft, g_num, g_s, g_d = suffix_paths_device(g_tok[None], g_seq[None], g_pos[None], ctx,
                                                   ctx_len, budgets, **args)
    better = ~fraction_at_least(s_num, s_den, g_s, g_d)  # strictly: ties stay local
    draft = jnp.where(better[:, None], g_draft, draft)
    num = jnp.where(better, g_num, num)
  return draft, num
