"""Offline agreement of a draft head with its target: what acceptance a head can reach
on given sequences, without running speculative decoding.

The target's greedy continuation of each sequence is known (``TokenDataset`` of target
responses, ``data.regenerate``), so the training-time unroll (``head.unrolled``, tokens
teacher-forced, the head's own hidden states fed back) gives, at every position, the
token the head would draft at depth u of a chain. A chain started at position c agrees
up to depth j when depths 1 .. j all hit the target's greedy token; the fraction of
response positions whose chain agrees up to depth j is the offline estimate of the
engine's per-position acceptance rate ``accept_rate_pos{j}`` (greedy; every position
is a chain start here, the engine only starts chains after a step's commits).

Comparing it on the evaluation's own prompts with the engine's measured acceptance
separates a head that does not generalise to the prompts (both low) from a drafting
path that feeds the head something else than training did (offline high, online low).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
from flax import nnx

from methods.training.data import TokenDataset
from methods.training.trainer import _loss, _pad_width

__all__ = ["Agreement", "chain_agreement", "head_agreement", "stepped_acceptance"]


@dataclasses.dataclass(frozen=True)
class Agreement:
  """Offline agreement over the drafted response tokens of a dataset.

  Attributes:
    top1: ``f64[U]``: depth u's top-1 agreement with the target's greedy token (the
      training log's ``held_out_response_top1_pos{u}``).
    chain: ``f64[U]``: fraction of response chain starts whose first j drafts all agree
      (offline ``accept_rate_pos{j}``).
    num_starts: ``i64[U]``: chain starts counted at each depth (the chain fits the row).
    stepped: ``f64[U]`` or None: the same rates over the chain starts greedy speculative
      decoding with k = U visits (``stepped_acceptance``): what the engine's
      ``accept_rate_pos{j}`` measures on these sequences.
    stepped_counts: ``(accepted, drafted)``, ``i64[U]`` each, behind ``stepped``.
  """

  top1: np.ndarray
  chain: np.ndarray
  num_starts: np.ndarray
  stepped: np.ndarray | None = None
  stepped_counts: tuple[np.ndarray, np.ndarray] | None = None

  @property
  def tau(self) -> float:
    """Tokens per step of a k = U chain with this agreement: 1 + sum of ``chain``."""
    return float(1.0 + np.sum(self.chain))


@functools.partial(jax.jit, static_argnames=("head_graphdef", "target_graphdef", "depth"))
def _hits(params, rest, head_graphdef, target_graphdef, target_params, tokens, lengths,
          prompt_lengths, *, depth):
  target = nnx.merge(target_graphdef, target_params)
  _, (hits, valid, resp) = _loss(params, rest, head_graphdef, target, tokens, lengths,
                                 prompt_lengths, depth, False)
  return hits, valid, resp


def _ahead(x: np.ndarray, lag: int) -> np.ndarray:
  """``out[:, c] = x[:, c + lag]`` (False past the end)."""
  out = np.zeros_like(x)
  out[:, : x.shape[1] - lag] = x[:, lag:]
  return out


def chain_agreement(hits: np.ndarray, response: np.ndarray, lags) -> Agreement:
  """Per-depth and chain agreement from the unroll's ``bool[U, B, T]`` masks (``hits``:
  depth u's top-1 agrees at output q; ``response``: that output's label is a token a
  row drafts, ``trainer._loss``).

  Depth u's output at ``q = c + lags[u]`` drafts token u + 1 of the chain started at c
  (``lags[u] = u + 1 - shift`` with the head's ``label_offset(u)``; EAGLE: u, MTP and
  Medusa: 0), so the chain from c agrees up to depth j when ``hits[u, :, c + lags[u]]``
  for every u < j. A start counts at depth j when the labels of depths 1 and j are
  drafted response tokens (the chain fits the row).

  Example: hits at the chain's outputs for depths 1, 2, 3 = T, F, T -> the chain agrees
  up to depth 1 (it counts for ``chain[0]`` only).
  """
  depth = hits.shape[0]
  top1 = np.asarray([(hits[u] & response[u]).sum() / max(response[u].sum(), 1)
                     for u in range(depth)], np.float64)
  first = _ahead(response[0], lags[0])
  run = np.ones(hits.shape[1:], bool)  # [B, T]: the chain from c agrees so far
  chain, starts = np.zeros(depth), np.zeros(depth, np.int64)
  for u in range(depth):
    run &= _ahead(hits[u], lags[u])
    counted = first & _ahead(response[u], lags[u])
    starts[u] = counted.sum()
    chain[u] = (run & counted).sum() / max(starts[u], 1)
  return Agreement(top1, chain, starts)


def stepped_acceptance(hits: np.ndarray, response: np.ndarray, lags, lengths) -> tuple[np.ndarray, np.ndarray]:
  """Per-position acceptance of greedy chain speculation with k = U drafts walking the
  rows as the engine does: a step at chain start c drafts the depths whose outputs lie
  in the row and leave one token of the row's budget (``lengths[b]`` tokens: the chain
  from c drafts token indices c + 2, c + 3, ..., at most ``lengths[b] - c - 3`` of
  them, as the engine's budget with ``max_tokens`` ending the row), accepts the leading
  agreeing run of a drafts plus the bonus token, and the next step starts at
  ``c + a + 1``. Returns ``(accepted, drafted)``, ``i64[U]`` each: steps accepting at
  least j drafts and steps drafting at least j (their ratio is the engine's
  ``accept_rate_pos{j}``).

  Example: one row whose chain starts 0, 1, 2, ... hit at depth 1 at starts 0 and 2
  only, k = 1: steps at 0 (accept, next 2), 2 (accept, next 4), 4 (miss, next 5), ...
  """
  depth, rows, width = hits.shape
  first = _ahead(response[0], lags[0])
  ahead_hits = np.stack([_ahead(hits[u], lags[u]) for u in range(depth)])
  ahead_ok = np.stack([_ahead(response[u], lags[u]) for u in range(depth)])
  drafted, accepted = np.zeros(depth, np.int64), np.zeros(depth, np.int64)
  for b in range(rows):
    starts = np.flatnonzero(first[b])
    if not len(starts):
      continue
    c, last = int(starts[0]), int(starts[-1])
    while c <= last:
      n = int(np.sum(np.cumprod(ahead_ok[:, b, c])))  # depths whose output is in the row
      n = max(0, min(n, int(lengths[b]) - c - 3))
      run = int(np.sum(np.cumprod(ahead_hits[:n, b, c])))
      drafted[:n] += 1
      accepted[:run] += 1
      c += run + 1
  return accepted, drafted


def head_agreement(head, target, data: TokenDataset, depth: int, batch_size: int = 16
                   ) -> Agreement:
  """Offline agreement of ``head`` with ``target`` on ``data`` (module docstring).

  Args:
    head: a draft head (``models.heads``; EAGLE, EAGLE-3, MTP, Medusa).
    target: the target ``SplitModel``.
    data: target responses (``TokenDataset``; ``prompt_lengths`` mark the responses).
    depth: U, chain depths evaluated (>= 1; MTP and Medusa heads: at most their
      ``num_modules``, as in drafting).
    batch_size: rows per jitted call (the last batch wraps around, counted once).

  Raises:
    ValueError: ``depth`` or ``batch_size`` < 1, or empty ``data``.
  """
  if depth < 1 or batch_size < 1:
    raise ValueError(f"depth={depth} and batch_size={batch_size} must be >= 1")
  if len(data) == 0:
    raise ValueError("data must hold at least one sequence")
  if head.max_depth is not None and depth > head.max_depth:
    raise ValueError(f"depth={depth} must be <= {head.max_depth}, the most this head drafts")
  data = _pad_width(data)
  graphdef, params, rest = nnx.split(head, nnx.Param, ...)
  parts = [[], [], []]
  lengths = []
  n = len(data)
  for s in range(0, n, batch_size):
    idx = np.arange(s, s + batch_size) % n
    b = data.take(idx)
    out = _hits(params, rest, graphdef, target.graphdef, target.params, b.tokens, b.lengths,
                b.prompt_lengths, depth=depth)
    keep = slice(0, min(batch_size, n - s))  # rows past n wrapped around
    lengths.append(np.asarray(b.lengths)[keep])
    for p, x in zip(parts, out):
      p.append(np.asarray(x)[:, keep])
  hits, _, resp = (np.concatenate(p, 1) for p in parts)
  lags = [u + 1 - head.label_offset(u)[0] for u in range(depth)]
  agree = chain_agreement(hits, resp, lags)
  accepted, drafted = stepped_acceptance(hits, resp, lags, np.concatenate(lengths))
  with np.errstate(invalid="ignore"):  # nan where no step drafts depth j
    rate = accepted / drafted
  return dataclasses.replace(agree, stepped=rate, stepped_counts=(accepted, drafted))
