"""Suffix decoding (Oliaro et al. 2024, arXiv 2411.04975; Arctic Inference's SuffixDecoding).

Each running request has a *local* suffix tree over its prompt and committed output;
one *global* tree indexes the responses of earlier and running requests (FIFO eviction
beyond ``max_cached_requests``; 0 disables it, -1 means no limit). A tree indexes every
substring of length <= ``max_tree_depth`` of its sequences, with ``count`` = number of
occurrences, so a child's share of its parent's count estimates the next token's
probability.

Per row and step (Arctic ``SuffixTree::speculate``): for each match length m = 1, 2, ..
(up to ``len(context) - 1`` of the last ``max_tree_depth`` tokens; stops at the first m
that does not match) the node of the context's last m tokens drafts at most
``min(budget, floor(m * max_spec_factor + max_spec_offset))`` tokens:

* path: follow the most frequent child while its probability ``p = count(child) /
  count(start)`` (the running product of the count ratios ``count(child) /
  count(node)``, telescoped) stays >= ``min_token_prob``; children of equal count: the
  one whose latest occurrence is latest (largest ``(sequence id, end position)``);
* tree (``tree=True``): best-first on p over all children (pruned below
  ``min_token_prob``), verified with the engine's tree mask (``Draft.parents``).

A draft's score is the sum of its tokens' p (its expected accepted length under the
counts), kept as the exact fraction ``sum(count) / count(start)``; the best score over
m wins (ties: the longer match), then the better of the local and the global tree
(ties: local). Drafts are deterministic (no ``Draft.probs``), so stochastic
verification with a one-hot q keeps the target distribution. These rules are the ones
the device version (``methods.suffix_device``, the default) computes without a tree;
this host version is its test oracle and the tree mode.

Worked example (one sequence ``a b a b c``, depth 24): ``count(a) = 2``, ``count(a b) = 2``,
``count(b) = 2``, ``count(b a) = 1``, ``count(b c) = 1``. Context ``.. a b``: m = 1 (node
``b``) drafts ``c`` with p = 1/2 (``a`` and ``c`` tie; ``b c``'s occurrence, ending at
position 4, is later than ``b a``'s at 2), budget 1; m = 2 (node ``a b``) drafts ``c``
(p 1/2; ``a b c`` has no children), score 1/2, which ties and so wins (the longer match).

Host-side Python (``device=False`` or ``tree=True``). The edges are not compressed
(Arctic's are): memory is O(tokens x depth) trie nodes in the worst case (flat int
lists, ~100 B per node), matching is O(depth^2) dict look-ups per row and tree. The global tree lives in ``RuntimeInfo.method_cache`` and so persists across
``generate`` calls of one engine; a request id submitted again is a new response
sequence (it does not evict its earlier response, unlike Arctic's ``start_request``).
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import math

import jax
import numpy as np

from methods.suffix_device import (
    SuffixDeviceParams,
    global_corpus,
    init_suffix_state,
    release_slots,
    reset_slots,
    spec_caps,
    suffix_draft_device,
)
from specjax.method import Capabilities, DeviceDraft, Draft, Method, ProposeContext, VerifyResult

__all__ = ["GlobalCache", "SuffixDecoding", "SuffixDraft", "SuffixState", "SuffixTree"]


def _f32_at_least(count: int, start: int, min_prob: float) -> bool:
  """``count / start >= min_prob`` as the device tests it: an IEEE f32 division and compare
  (so a ``min_prob`` within an f32 rounding step of a count ratio decides alike)."""
  return bool(np.float32(count) / np.float32(start) >= np.float32(min_prob))


@dataclasses.dataclass
class SuffixDraft:
  """One row's suffix draft (host lists).

  Attributes:
    tokens: draft token ids (tree: best-first order, parents before children).
    parents: parent index per token (-1 = the pending token; a path is ``[-1, 0, 1, ..]``).
    probs: the estimated probability of each token (``count(node) / count(start)``).
    score: ``sum(probs)``, the expected accepted length under the tree's counts, which
      is exactly ``score_num / score_den`` (compare drafts with ``better_or_equal``).
    score_num, score_den: the sum of the drafted nodes' counts and the start node's count.
    match_len: length of the matched context suffix (0: no draft).
    source: "local", "global" or "" (no draft).
  """

  tokens: list = dataclasses.field(default_factory=list)
  parents: list = dataclasses.field(default_factory=list)
  probs: list = dataclasses.field(default_factory=list)
  score: float = 0.0
  match_len: int = 0
  source: str = ""
  score_num: int = 0
  score_den: int = 1

  def better_or_equal(self, other: SuffixDraft) -> bool:
    """``self.score >= other.score``, exactly (integer cross-multiplication)."""
    return self.score_num * other.score_den >= other.score_num * self.score_den


class SuffixTree:
  """Depth-bounded suffix trie over several sequences (by integer id).

  Node ``s`` (a token string, ``|s| <= max_depth``) counts the occurrences of ``s`` in
  the indexed sequences. Appending token t to a sequence extends the (at most
  ``max_depth - 1``) suffixes still shorter than the depth, plus a new one-token suffix.

  Nodes are integer ids into flat lists (count, token, first child, last child, next
  sibling, children in insertion order; ``recent``: the ``(sequence id, end position)``
  of the node's latest occurrence, packed in one int, which breaks count ties) and one dict ``(node << 32) | token -> child``:
  no Python object per node, so the garbage collector does not rescan millions of them
  (a trie of ``_Node`` objects built 5x slower with the collector on).

  Raises:
    ValueError: ``max_depth < 1``.
  """

  ROOT = 0

  def __init__(self, max_depth: int):
    if max_depth < 1:
      raise ValueError(f"{max_depth=} must be >= 1")
    self.max_depth = max_depth
    self._child: dict[int, int] = {}
    self._count = [0]
    self._token = [-1]
    self._first = [-1]
    self._last = [-1]
    self._next = [-1]
    self._recent = [-1]
    self._free: list[int] = []
    self._seqs: dict[int, list[int]] = {}
    self._active: dict[int, list[int]] = {}  # per sequence, deepest suffix first

  def __contains__(self, seq_id: int) -> bool:
    return seq_id in self._seqs

  @property
  def num_sequences(self) -> int:
    return len(self._seqs)

  @property
  def num_nodes(self) -> int:
    """Live nodes, the root included."""
    return len(self._count) - len(self._free)

  def _new_child(self, node: int, token: int) -> int:
    if self._free:
      c = self._free.pop()
      (self._count[c], self._token[c], self._first[c], self._last[c], self._next[c],
       self._recent[c]) = (0, token, -1, -1, -1, -1)
    else:
      c = len(self._count)
      self._count.append(0)
      self._token.append(token)
      self._first.append(-1)
      self._last.append(-1)
      self._next.append(-1)
      self._recent.append(-1)
    if self._last[node] < 0:
      self._first[node] = c
    else:
      self._next[self._last[node]] = c
    self._last[node] = c
    self._child[(node << 32) | token] = c
    return c

  def _unlink(self, node: int, child: int) -> None:
    prev, cur = -1, self._first[node]
    while cur != child:
      prev, cur = cur, self._next[cur]
    nxt = self._next[child]
    if prev < 0:
      self._first[node] = nxt
    else:
      self._next[prev] = nxt
    if self._last[node] == child:
      self._last[node] = prev
    del self._child[(node << 32) | self._token[child]]
    self._free.append(child)

  def children(self, node: int) -> list[tuple[int, int]]:
    """``[(token, child), ..]`` of ``node`` in insertion order."""
    out, c = [], self._first[node]
    while c >= 0:
      out.append((self._token[c], c))
      c = self._next[c]
    return out

  def append(self, seq_id: int, token: int) -> None:
    """Appends one token to sequence ``seq_id`` (created on first use)."""
    token = int(token)
    if not 0 <= token < 1 << 31:
      raise ValueError(f"{token=} must be in [0, 2**31)")
    seq = self._seqs.setdefault(seq_id, [])
    seq.append(token)
    key = (seq_id << 40) | (len(seq) - 1)  # (sequence, end position); ids grow
    grown = []
    child_of, count, recent = self._child, self._count, self._recent
    for node in [*self._active.get(seq_id, ()), self.ROOT]:
      c = child_of.get((node << 32) | token)
      if c is None:
        c = self._new_child(node, token)
      count[c] += 1
      if key > recent[c]:
        recent[c] = key
      grown.append(c)
    count[self.ROOT] += 1
    # grown[j] sits at depth len(grown) - j; keep those that can still grow.
    self._active[seq_id] = grown[max(0, len(grown) - self.max_depth + 1):]

  def extend(self, seq_id: int, tokens) -> None:
    for t in tokens:
      self.append(seq_id, t)

  def remove(self, seq_id: int) -> None:
    """Removes every suffix of sequence ``seq_id``; nodes whose count reaches 0 go.

    A node's count reaches 0 only once the walks of all its occurrences in this sequence
    have passed (the count includes them), so no later walk meets a removed node. The
    surviving nodes keep their ``recent`` key, which is exact when the removed sequence
    is the oldest (the global cache's FIFO): a surviving node's latest occurrence is
    then in a newer sequence.

    Raises:
      KeyError: an unknown ``seq_id``.
    """
    seq = self._seqs.pop(seq_id)
    self._active.pop(seq_id, None)
    for start in range(len(seq)):
      node = self.ROOT
      for token in seq[start: start + self.max_depth]:
        child = self._child[(node << 32) | token]
        self._count[child] -= 1
        if self._count[child] == 0:
          self._unlink(node, child)
        node = child
    self._count[self.ROOT] -= len(seq)

  def count(self, tokens) -> int:
    """Occurrences of the token string ``tokens`` (0 if absent or longer than the depth;
    the empty string counts every indexed position)."""
    node = self._match(tokens)
    return 0 if node is None else self._count[node]

  def _match(self, tokens) -> int | None:
    node = self.ROOT
    for t in tokens:
      node = self._child.get((node << 32) | int(t))
      if node is None:
        return None
    return node

  def speculate(self, context, max_spec_tokens: int, max_spec_factor: float,
                max_spec_offset: float, min_token_prob: float, tree: bool) -> SuffixDraft:
    """The best draft over match lengths (module docstring); empty if nothing matches."""
    context = [int(t) for t in context[-self.max_depth:]]
    best = SuffixDraft()
    for m in range(1, len(context)):
      node = self._match(context[len(context) - m:])
      if node is None or self._first[node] < 0:
        # No longer suffix matches (or, without children, continues): their counts
        # are at most this one's, so every later draft would be empty.
        break
      budget = max(0, min(max_spec_tokens, math.floor(m * max_spec_factor + max_spec_offset
                                                      + 1e-6)))
      if tree:
        draft = self._speculate_tree(node, budget, min_token_prob)
      else:
        draft = self._speculate_path(node, budget, min_token_prob)
      if draft.better_or_equal(best):
        best = draft
        best.match_len = m
    if not best.tokens:
      best.match_len = 0
    return best

  def _by_count(self, node: int) -> list[tuple[int, int]]:
    """``[(token, child), ..]`` of ``node``, most frequent first; equal counts: the
    latest occurrence first."""
    count, recent = self._count, self._recent
    return sorted(self.children(node), key=lambda tc: (-count[tc[1]], -recent[tc[1]]))

  def _speculate_path(self, node: int, budget: int, min_prob: float) -> SuffixDraft:
    out = SuffixDraft()
    start = self._count[node]
    out.score_den = start
    while len(out.tokens) < budget and self._first[node] >= 0:
      token, child = max(self.children(node),
                         key=lambda tc: (self._count[tc[1]], self._recent[tc[1]]))
      prob = self._count[child] / start
      if not _f32_at_least(self._count[child], start, min_prob):
        break
      out.parents.append(len(out.tokens) - 1)
      out.tokens.append(token)
      out.probs.append(prob)
      out.score_num += self._count[child]
      node = child
    out.score = out.score_num / start
    return out

  def _speculate_tree(self, node: int, budget: int, min_prob: float) -> SuffixDraft:
    out = SuffixDraft()
    heap: list = []
    tie = 0  # equal probabilities pop first-pushed first (deterministic)
    start = self._count[node]
    out.score_den = start

    def push(parent, parent_index):
      nonlocal tie
      for token, child in self._by_count(parent):
        p = self._count[child] / start
        if not _f32_at_least(self._count[child], start, min_prob):
          break
        heapq.heappush(heap, (-p, tie, token, child, parent_index))
        tie += 1

    push(node, -1)
    while heap and len(out.tokens) < budget:
      neg_p, _, token, child, parent = heapq.heappop(heap)
      out.tokens.append(token)
      out.parents.append(parent)
      out.probs.append(-neg_p)
      out.score_num += self._count[child]
      push(child, len(out.tokens) - 1)
    out.score = out.score_num / start
    return out


@dataclasses.dataclass
class GlobalCache:
  """The global tree of responses and its FIFO of sequence ids (one per engine)."""

  tree: SuffixTree
  max_cached_requests: int
  order: collections.OrderedDict = dataclasses.field(default_factory=collections.OrderedDict)
  next_seq_id: int = 0

  def new_sequence(self) -> int | None:
    """Allocates a response sequence (None when the cache is off), evicting the oldest
    ones beyond ``max_cached_requests``."""
    if self.max_cached_requests == 0:
      return None
    seq_id = self.next_seq_id
    self.next_seq_id += 1
    self.order[seq_id] = None
    while 0 < self.max_cached_requests < len(self.order):
      old, _ = self.order.popitem(last=False)
      if old in self.tree:
        self.tree.remove(old)
    return seq_id

  def append(self, seq_id: int | None, tokens) -> None:
    if seq_id is not None and seq_id in self.order:
      self.tree.extend(seq_id, tokens)


@dataclasses.dataclass
class _Request:
  local: SuffixTree
  seq_id: int | None  # the response's id in the global tree
  num_tokens: int  # tokens indexed by ``local`` (= prompt + committed output)


@dataclasses.dataclass
class SuffixState:
  """Per-``generate`` state; ``cache`` is the engine's global cache (by reference).

  Attributes:
    cache: ``GlobalCache`` kept in ``RuntimeInfo.method_cache``.
    requests: request id -> local tree and global sequence (dropped when it finishes).
    signals: request id -> ``SuffixDraft`` of the latest ``propose`` (pre-token signals:
      ``match_len``, ``score``, ``source``), for orchestrators and reports.
  """

  cache: GlobalCache
  requests: dict = dataclasses.field(default_factory=dict)
  signals: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SuffixDecoding(Method):
  """Suffix-tree drafting; defaults are vLLM's suffix decoding config.

  Attributes:
    k: the most draft tokens (tree nodes) per row and step.
    max_tree_depth: depth of the trees (bounds match + draft length); vLLM 24.
    max_cached_requests: responses kept in the global tree (FIFO); 0 off, -1 no limit;
      vLLM 10000.
    max_spec_factor, max_spec_offset: a match of length m drafts at most
      ``floor(m * factor + offset)`` tokens; vLLM 1.0 and 0.0 (Arctic's default; vLLM
      does not expose it).
    min_token_prob: drafting stops below this estimated probability; vLLM 0.1.
    tree: best-first token trees instead of paths (Arctic ``use_tree_spec``).
    device: True: path drafts on the device, fused into the engine step
      (``methods.suffix_device``: asynchronous iterations, no host work per step; the
      same drafts as the host trees); False, or ``tree=True``: drafts on the host. None
      (default): on the device unless JAX's default backend is the CPU, where the
      dense device drafter costs more than the host trie (SmolLM2 on this project's
      2-core box: c 3.8 fused vs 1.6 host, one run each). ``describe()`` records the
      resolved ``runs_on``.
    device_cache_tokens: the device global cache's archive of finished responses, in
      tokens (G); running responses are read from the engine's slots. None (default):
      ``min(8192, 8 * max_model_len)``; the drafter's work per step grows linearly with
      G (on the H200 at SmolLM2 size ~0.27 ms per iteration at batch 1 with G = 16384). Once the
      archive wraps, the oldest responses are overwritten (the host tree keeps
      ``max_cached_requests`` responses whatever their length), so device and host
      drafts are the same while the cached responses fit in G tokens. Three more
      differences: tokens a request commits in flight after a stop string (which only
      the host applies) stay in the device cache until its slot is released; a
      preempted request's response continues as a new response on the device (one on
      the host); and requests that join a running batch evict the
      oldest responses (``max_cached_requests``) before the step on the device, row by
      row during it on the host (only a FIFO smaller than the batch can tell).

  Raises:
    ValueError: an option out of range (named in the message).
  """

  name = "suffix"
  k: int = 4
  max_tree_depth: int = 24
  max_cached_requests: int = 10000
  max_spec_factor: float = 1.0
  max_spec_offset: float = 0.0
  min_token_prob: float = 0.1
  tree: bool = False
  device: bool | None = None
  device_cache_tokens: int | None = None

  def __post_init__(self):
    if not isinstance(self.k, int) or self.k < 1:
      raise ValueError(f"num_speculative_tokens k={self.k!r} must be an int >= 1")
    if not isinstance(self.max_tree_depth, int) or self.max_tree_depth < 2:
      raise ValueError(f"max_tree_depth={self.max_tree_depth!r} must be an int >= 2 "
                       "(a match of >= 1 token plus >= 1 draft token)")
    if not isinstance(self.max_cached_requests, int) or self.max_cached_requests < -1:
      raise ValueError(f"max_cached_requests={self.max_cached_requests!r} must be an int "
                       ">= -1 (-1: no limit, 0: no global tree)")
    if not (isinstance(self.max_spec_factor, (int, float)) and math.isfinite(self.max_spec_factor)
            and self.max_spec_factor >= 0):
      raise ValueError(f"max_spec_factor={self.max_spec_factor!r} must be a finite number >= 0")
    if not (isinstance(self.max_spec_offset, (int, float))
            and math.isfinite(self.max_spec_offset)):
      raise ValueError(f"max_spec_offset={self.max_spec_offset!r} must be a finite number")
    if not (isinstance(self.min_token_prob, (int, float)) and 0 <= self.min_token_prob <= 1):
      raise ValueError(f"min_token_prob={self.min_token_prob!r} must be in [0, 1]")
    if not isinstance(self.tree, bool):
      raise ValueError(f"tree={self.tree!r} must be True or False")
    if self.device is not None and not isinstance(self.device, bool):
      raise ValueError(f"device={self.device!r} must be True (fused, on the device), False "
                       "(host) or None (the device unless JAX's backend is the CPU)")
    if self.device_cache_tokens is not None and (not isinstance(self.device_cache_tokens, int)
                                                 or self.device_cache_tokens < 2):
      raise ValueError(f"device_cache_tokens={self.device_cache_tokens!r} must be None or an "
                       "int >= 2")

  @property
  def num_speculative_tokens(self) -> int:
    return self.k

  def capabilities(self) -> Capabilities:
    device = self.device if self.device is not None else jax.default_backend() != "cpu"
    return Capabilities(runs_on="fused" if device and not self.tree else "host",
                        tree=self.tree)

  # ------------------------------------------------------------------ fused path
  def describe(self) -> dict:
    return {**super().describe(), "runs_on": self.capabilities().runs_on}

  def archive_tokens(self, max_model_len: int) -> int:
    """G, the device archive's size for an engine of this ``max_model_len``."""
    if self.device_cache_tokens is not None:
      return self.device_cache_tokens
    return min(8192, 8 * max_model_len)

  def _device_key(self):
    return ("device", self)  # the host tree of the same config lives under ``self``

  def init_device(self, runtime):
    """The device cache kept by the last ``generate`` of this engine (``end_device``),
    or an empty one."""
    state = runtime.method_cache.pop(self._device_key(), None)
    if state is None or state.slot_seq.shape[0] != runtime.max_num_seqs:
      state = init_suffix_state(runtime.max_num_seqs, self.archive_tokens(runtime.max_model_len))
    return SuffixDeviceParams(runtime.target.config.vocab_size), state

  def reset_device(self, params, state, slots, num_tokens):
    """New requests start their responses (the host's first sight)."""
    return _reset(state, slots, num_tokens, max_cached_requests=self.max_cached_requests)

  def release_device(self, params, state, slot_tokens, slots, num_tokens):
    """Finished (or preempted) requests' responses move to the archive."""
    return _release(state, slot_tokens, slots, num_tokens)

  def end_device(self, runtime, params, state) -> None:
    runtime.method_cache[self._device_key()] = state

  def propose_device(self, params: SuffixDeviceParams, state, rows, *, all_greedy):
    corpus = None
    if self.max_cached_requests != 0:
      corpus = global_corpus(state, rows.slot_tokens, rows.slot_num_tokens,
                             self.max_cached_requests)
    tokens, num = suffix_draft_device(
        rows.tokens, rows.num_tokens, rows.budgets, corpus, k=self.k,
        depth=self.max_tree_depth,
        caps=spec_caps(self.max_tree_depth, self.max_spec_factor, self.max_spec_offset),
        min_token_prob=self.min_token_prob, vocab_size=params.vocab_size)
    return state, DeviceDraft(tokens, num)

  def init_state(self, runtime) -> SuffixState:
    cache = runtime.method_cache.get(self)
    if cache is None:
      cache = runtime.method_cache[self] = GlobalCache(SuffixTree(self.max_tree_depth),
                                                      self.max_cached_requests)
    return SuffixState(cache)

  def speculate(self, state: SuffixState, ctx: ProposeContext) -> tuple[SuffixState, list]:
    """Per row, the better of the local and global trees' drafts (``SuffixDraft``, within
    ``min(k, budget)`` tokens); also stored in ``state.signals``."""
    drafts = []
    for rid, seq, budget in zip(ctx.request_ids, ctx.token_ids, ctx.budgets):
      req = state.requests.get(rid)
      if req is None:  # first sight: the context is the prompt
        local = SuffixTree(self.max_tree_depth)
        local.extend(0, seq)
        req = state.requests[rid] = _Request(local, state.cache.new_sequence(), len(seq))
      assert req.num_tokens == len(seq), (rid, req.num_tokens, len(seq))
      budget = min(self.k, int(budget))
      if budget <= 0:
        best = SuffixDraft()
      else:
        args = (budget, self.max_spec_factor, self.max_spec_offset, self.min_token_prob,
                self.tree)
        best = req.local.speculate(seq, *args)
        best.source = "local" if best.tokens else ""
        if self.max_cached_requests != 0:
          other = state.cache.tree.speculate(seq, *args)
          if not best.better_or_equal(other):  # strictly better: ties stay local
            best, best.source = other, "global"
      state.signals[rid] = best
      drafts.append(best)
    return state, drafts

  def scored_propose(self, state: SuffixState, ctx: ProposeContext):
    """``(state, Draft, scores f32[rows])``: the draft and each row's expected accepted
    length (its score), known before verification (for ``methods.adaptive``)."""
    state, drafts = self.speculate(state, ctx)
    rows = len(drafts)
    tokens = np.full((rows, self.k), -1, np.int32)
    parents = np.full((rows, self.k), -1, np.int32)
    num = np.zeros(rows, np.int32)
    for i, d in enumerate(drafts):
      n = len(d.tokens)
      tokens[i, :n], parents[i, :n], num[i] = d.tokens, d.parents, n
    scores = np.asarray([d.score for d in drafts], np.float32)
    return state, Draft(tokens, num, parents=parents if self.tree else None), scores

  def propose(self, state, context):
    state, draft, _ = self.scored_propose(state, context)
    return state, draft

  def observe(self, state: SuffixState, result: VerifyResult) -> SuffixState:
    """Appends the committed tokens to the local tree and the global response; drops a
    finished request's local tree (its response stays in the global tree)."""
    for rid, emitted in zip(result.request_ids, result.emitted):
      req = state.requests.get(rid)
      if req is None:
        continue
      req.local.extend(0, emitted)
      req.num_tokens += len(emitted)
      state.cache.append(req.seq_id, emitted)
    for rid in result.finished:
      state.requests.pop(rid, None)
      state.signals.pop(rid, None)
    return state


_reset = jax.jit(reset_slots, static_argnames=("max_cached_requests",), donate_argnames=("state",))
_release = jax.jit(release_slots, donate_argnames=("state",))
