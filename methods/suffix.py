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

* path: follow the most frequent child while the running probability ``p *=
  count(child) / count(node)`` stays >= ``min_token_prob``;
* tree (``tree=True``): best-first on p over all children (pruned below
  ``min_token_prob``), verified with the engine's tree mask (``Draft.parents``).

A draft's score is the sum of its tokens' p (its expected accepted length under the
counts); the best score over m wins (ties: the longer match), then the better of the
local and the global tree (ties: local). Drafts are deterministic (no ``Draft.probs``),
so stochastic verification with a one-hot q keeps the target distribution.

Worked example (one sequence ``a b a b c``, depth 24): ``count(a) = 2``, ``count(a b) = 2``,
``count(b) = 2``, ``count(b a) = 1``, ``count(b c) = 1``. Context ``.. a b``: m = 1 (node
``b``) drafts ``a`` with p = 1/2 (``a`` and ``c`` tie; the first inserted child wins),
budget 1; m = 2 (node ``a b``) drafts ``a`` (p 1/2) then ``b`` (p 1/2), score 1.0.

Host-side Python. The edges are not compressed (Arctic's are): memory is O(tokens x
depth) trie nodes in the worst case (flat int lists, ~100 B per node), matching is
O(depth^2) dict look-ups per row and tree. The global tree lives in ``RuntimeInfo.method_cache`` and so persists across
``generate`` calls of one engine; a request id submitted again is a new response
sequence (it does not evict its earlier response, unlike Arctic's ``start_request``).
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import math

import numpy as np

from specjax.method import Capabilities, Draft, Method, ProposeContext, VerifyResult

__all__ = ["GlobalCache", "SuffixDecoding", "SuffixDraft", "SuffixState", "SuffixTree"]


@dataclasses.dataclass
class SuffixDraft:
  """One row's suffix draft (host lists).

  Attributes:
    tokens: draft token ids (tree: best-first order, parents before children).
    parents: parent index per token (-1 = the pending token; a path is ``[-1, 0, 1, ..]``).
    probs: the estimated probability of each token (the running product of count ratios).
    score: ``sum(probs)``, the expected accepted length under the tree's counts.
    match_len: length of the matched context suffix (0: no draft).
    source: "local", "global" or "" (no draft).
  """

  tokens: list = dataclasses.field(default_factory=list)
  parents: list = dataclasses.field(default_factory=list)
  probs: list = dataclasses.field(default_factory=list)
  score: float = 0.0
  match_len: int = 0
  source: str = ""


class SuffixTree:
  """Depth-bounded suffix trie over several sequences (by integer id).

  Node ``s`` (a token string, ``|s| <= max_depth``) counts the occurrences of ``s`` in
  the indexed sequences. Appending token t to a sequence extends the (at most
  ``max_depth - 1``) suffixes still shorter than the depth, plus a new one-token suffix.

  Nodes are integer ids into flat lists (count, token, first child, last child, next
  sibling; children in insertion order) and one dict ``(node << 32) | token -> child``:
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
      self._count[c], self._token[c], self._first[c], self._last[c], self._next[c] = (
          0, token, -1, -1, -1)
    else:
      c = len(self._count)
      self._count.append(0)
      self._token.append(token)
      self._first.append(-1)
      self._last.append(-1)
      self._next.append(-1)
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
    self._seqs.setdefault(seq_id, []).append(token)
    grown = []
    child_of, count = self._child, self._count
    for node in [*self._active.get(seq_id, ()), self.ROOT]:
      c = child_of.get((node << 32) | token)
      if c is None:
        c = self._new_child(node, token)
      count[c] += 1
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
    have passed (the count includes them), so no later walk meets a removed node.

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
      if draft.score >= best.score:
        best = draft
        best.match_len = m
    if not best.tokens:
      best.match_len = 0
    return best

  def _speculate_path(self, node: int, budget: int, min_prob: float) -> SuffixDraft:
    out = SuffixDraft()
    prob = 1.0
    count = self._count
    while len(out.tokens) < budget and self._first[node] >= 0:
      token, child = max(self.children(node), key=lambda tc: count[tc[1]])  # first max
      prob *= count[child] / count[node]
      if prob < min_prob:
        break
      out.parents.append(len(out.tokens) - 1)
      out.tokens.append(token)
      out.probs.append(prob)
      out.score += prob
      node = child
    return out

  def _speculate_tree(self, node: int, budget: int, min_prob: float) -> SuffixDraft:
    out = SuffixDraft()
    heap: list = []
    tie = 0  # equal probabilities pop first-pushed first (deterministic)
    count = self._count

    def push(parent, parent_prob, parent_index):
      nonlocal tie
      for token, child in sorted(self.children(parent), key=lambda tc: -count[tc[1]]):
        p = parent_prob * count[child] / count[parent]
        if p < min_prob:
          break
        heapq.heappush(heap, (-p, tie, token, child, parent_index))
        tie += 1

    push(node, 1.0, -1)
    while heap and len(out.tokens) < budget:
      neg_p, _, token, child, parent = heapq.heappop(heap)
      out.tokens.append(token)
      out.parents.append(parent)
      out.probs.append(-neg_p)
      out.score += -neg_p
      push(child, -neg_p, len(out.tokens) - 1)
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
  """

  name = "suffix"
  k: int = 4
  max_tree_depth: int = 24
  max_cached_requests: int = 10000
  max_spec_factor: float = 1.0
  max_spec_offset: float = 0.0
  min_token_prob: float = 0.1
  tree: bool = False

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

  @property
  def num_speculative_tokens(self) -> int:
    return self.k

  def capabilities(self) -> Capabilities:
    return Capabilities(runs_on="host", tree=self.tree)

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
          if other.score > best.score:
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
