"""Shared machinery of the learned-head methods (EAGLE, EAGLE-3, MTP, Medusa).

The method keeps, per request, the target features of the last ``window`` committed
positions on the host (numpy). Feature ``f_p`` is the target hidden state at position
``p`` (computed with token ``x_p`` as input), so after prefill of ``x_0 .. x_{m-2}`` the
pending token ``x_{m-1}`` has no feature yet. A decode step runs the target over
``[x_{m-1}, d_1 .. d_L]`` at positions ``m-1 .. m-1+L``; when ``e`` tokens are
committed, the features of the first ``e`` of those rows become valid:

  before: tokens x_0..x_4 (m = 5), features f_0..f_3, pending x_4
  verify [x_4, d_1, d_2, d_3], 2 drafts accepted + bonus b -> e = 3 tokens committed
  after:  tokens x_0..x_4 d_1 d_2 b, features f_0..f_3 + hidden rows 0..2 (= f_4..f_6)

Each ``propose`` sends the window (right-aligned: slot ``W - 1`` is ``f_{m-2}`` paired
with the pending token) to one jitted call that runs the head's ``draft`` (a chain of
k tokens) or, with ``tree_nodes > 0``, its ``draft_tree`` (a tree of that many nodes
and depth <= k, ``models.head_trees``). Tree steps hand back the accepted path's hidden
rows in commit order (``VerifyResult.target_hidden``), so the feature bookkeeping above
is the same for both.

Drafting respects the rows' budgets (``ProposeContext.budgets``): a chain step runs
``max(budgets)`` head steps, a tree step builds a tree of at most ``max(budgets)`` nodes
and depth ``min(k, max(budgets))`` (its best nodes, so the same first nodes as the full
tree), and a step where every budget is 0 runs no head at all.

Chains and trees (without ``stop_entropy``) run fused by default
(``Capabilities.runs_on`` "fused"): the features live on the device in a paged pool
beside the target's KV (``FeaturePool``: position p of a row at the row's KV page
``p // page_size``, offset ``p % page_size``), written from the target's hidden states
of every prefill chunk (``prefill_device``) and of every engine iteration
(``observe_device``: all L + 1 rows, as the KV; a rejected draft's row is rewritten
before its position is committed), and ``propose_device`` gathers each row's window from
the page table and runs ``head.draft`` (or ``draft_tree``: a tree step's features are
written after verification, from the accepted path's rows in commit order) inside the
engine's one device call, so these heads iterate asynchronously like AR. ``fused=False``,
SVIP's ``stop_entropy`` and a composite caller (``methods.adaptive``) take the host-called
path (``Capabilities.runs_on`` "device"), one synchronous engine step each. Its windows
stay on the device too, per request rather than paged (``PrefillResult`` and
``VerifyResult`` carry no page tables): a ``[C, window, F]`` slot pool in the target's
dtype, right-aligned as ``head.draft`` takes it, one slot per request (a host map,
capacity doubled when full), updated by one jitted shift-append per prefill chunk or
verify step (``append_windows``: new window = the last ``window`` rows of the old one
followed by the row's new hidden rows) and gathered by slot for the head's call
(``gather_windows``). Only token ids and small int arrays cross to and from the host.
The target's hidden states are in its dtype, so keeping them in it is lossless: the head
gets the same f32 window as when the window was an f32 numpy copy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from methods.draft_model import entropy_nats
from models.heads import HeadConfig, head_class, load_head, make_head
from specjax.config import MATMUL_PRECISIONS
from specjax.method import (
    Capabilities,
    DeviceDraft,
    Draft,
    Method,
    PrefillResult,
    VerifyResult,
)
from specjax.sampling import draft_sample, is_greedy, processed_probs

__all__ = ["FeaturePool", "HeadParams", "LearnedHeadMethod", "append_windows",
           "feature_window", "gather_windows", "head_draft_step", "head_tree_step",
           "write_features"]


@functools.partial(
    jax.jit, static_argnames=("head_graphdef", "target_graphdef", "num_steps", "all_greedy",
                              "stop_entropy", "coupled"))
def head_draft_step(head_graphdef, head_state, target_graphdef, target_params, tokens, feats,
                    num_valid, positions, temperature, top_k, top_p, keys, draft_positions, *,
                    num_steps, all_greedy, stop_entropy=None, coupled=False):
  """Runs ``head.draft`` for the padded batch.

  Args:
    tokens: ``i32[B, W]`` token window (slot s: ``x_{p+1}`` for feature slot s).
    feats: ``f32[B, W, F]`` feature window, right-aligned.
    num_valid: ``i32[B]`` real slots per row (>= 1; padding rows use 1).
    positions: ``i32[B]`` position of the last feature slot.
    temperature, top_k, top_p, keys: the batch's sampling arrays.
    draft_positions: ``i32[B]`` absolute position of the first draft token (keys).
    num_steps: draft length (static).
    all_greedy: static; True skips draft probabilities.
    stop_entropy: static; None, or (SVIP) a row keeps drafts up to and including the
      first whose untempered head distribution has entropy above this many nats (all
      ``num_steps`` head steps still run; only the count is cut).
    coupled: static; sampled rows draft by the verifier's Gumbel race over q at the
      draft's position (``specjax.sampling.draft_sample``) and no probs are returned.

  Returns:
    ``(tokens i32[B, num_steps], probs f32[B, num_steps, V] or None (all greedy, or
    coupled), num_tokens i32[B])`` (``num_tokens`` = num_steps for every row without
    ``stop_entropy``).
  """
  return _head_draft(head_graphdef, head_state, target_graphdef, target_params, tokens, feats,
                     num_valid, positions, temperature, top_k, top_p, keys, draft_positions,
                     num_steps=num_steps, all_greedy=all_greedy, stop_entropy=stop_entropy,
                     coupled=coupled)


def _head_draft(head_graphdef, head_state, target_graphdef, target_params, tokens, feats,
                num_valid, positions, temperature, top_k, top_p, keys, draft_positions, *,
                num_steps, all_greedy, stop_entropy=None, coupled=False):
  """``head_draft_step``'s body (pure; traced by it and by the fused proposer)."""
  head = nnx.merge(head_graphdef, head_state)
  target = nnx.merge(target_graphdef, target_params)

  def pick(logits, j):
    stop = (jnp.zeros(logits.shape[:1], bool) if stop_entropy is None  # no entropy kernels
            else entropy_nats(logits) > stop_entropy)
    if all_greedy:
      return jnp.argmax(logits, axis=-1).astype(jnp.int32), (None, stop)
    probs = processed_probs(logits[:, None], temperature, top_k, top_p)[:, 0]
    tok = draft_sample(probs, keys, draft_positions + j, coupled=coupled)
    return tok, (None if coupled else probs, stop)

  out, (probs, stops) = head.draft(target, tokens, feats, num_valid, positions, num_steps, pick)
  # Example: stops [F, T, T] (num_steps 3) -> 2 tokens (the first uncertain draft is kept).
  num = jnp.where(jnp.any(stops, axis=1), jnp.argmax(stops, axis=1) + 1, num_steps)
  return out, probs, num.astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("head_graphdef", "target_graphdef", "depth",
                                             "branching", "num_nodes"))
def head_tree_step(head_graphdef, head_state, target_graphdef, target_params, tokens, feats,
                   num_valid, positions, *, depth, branching, num_nodes):
  """Runs ``head.draft_tree`` for the padded batch (inputs as ``head_draft_step``).

  Returns:
    ``(tokens i32[B, num_nodes], parents i32[B, num_nodes])``, parents first. Tree
    tokens are chosen deterministically (top-k), so no draft probabilities: the
    verifier's q is one-hot, which keeps stochastic verification lossless.
  """
  head = nnx.merge(head_graphdef, head_state)
  target = nnx.merge(target_graphdef, target_params)
  return head.draft_tree(target, tokens, feats, num_valid, positions, depth, branching,
                         num_nodes)


@dataclasses.dataclass(frozen=True)
class HeadParams:
  """A fused head's params: the head's and the target's arrays plus their static
  graphdefs (pytree metadata)."""

  head_state: object
  target_params: object
  head_graphdef: object
  target_graphdef: object
  window: int


jax.tree_util.register_dataclass(HeadParams, data_fields=["head_state", "target_params"],
                                 meta_fields=["head_graphdef", "target_graphdef", "window"])


@dataclasses.dataclass(frozen=True)
class FeaturePool:
  """Target features on the device, paged like the target's KV: ``feats [num_pages *
  page_size, F]`` (the target's dtype), position p of a row at
  ``page_indices[p // page_size] * page_size + p % page_size``; ``page_size`` static."""

  feats: jax.Array
  page_size: int


jax.tree_util.register_dataclass(FeaturePool, data_fields=["feats"], meta_fields=["page_size"])


def _feature_rows(hidden: tuple) -> jax.Array:
  """Tuple of ``[B, T, D]`` -> ``[B, T, F]`` (concatenated in layer order)."""
  return jnp.concatenate(hidden, axis=-1) if len(hidden) > 1 else hidden[0]


def _flat_index(page_indices, positions, page_size: int, size: int):
  """``i32[B, T]`` pool rows of ``positions i32[B, T]`` under the rows' page tables;
  ``size`` (out of range) where the position is < 0 or its page is missing."""
  pages = jnp.take_along_axis(page_indices, jnp.maximum(positions, 0) // page_size, axis=1,
                              mode="fill", fill_value=-1)
  ok = (positions >= 0) & (pages >= 0)
  return jnp.where(ok, pages * page_size + positions % page_size, size)


def write_features(feats: jax.Array, page_indices, kv_lens, q_lens, hidden: tuple, *,
                   page_size: int) -> jax.Array:
  """Writes the target features of a forward into a ``FeaturePool.feats`` array.

  Args:
    feats: ``[num_pages * page_size, F]``.
    page_indices: ``i32[B, W]`` the rows' page tables (-1: no page; dropped).
    kv_lens, q_lens: ``i32[B]``: row b's ``hidden`` row t is position
      ``kv_lens[b] - q_lens[b] + t``, for ``t < q_lens[b]`` (later rows dropped).
    hidden: tuple of ``[B, T, D]`` (concatenated into F in layer order).
    page_size: tokens per page (static).

  Returns:
    The updated ``feats`` (the rows' positions overwritten).
  """
  rows = _feature_rows(hidden)
  t = jnp.arange(rows.shape[1], dtype=jnp.int32)[None]
  positions = (kv_lens - q_lens)[:, None] + t
  positions = jnp.where(t < q_lens[:, None], positions, -1)
  idx = _flat_index(page_indices, positions, page_size, feats.shape[0])
  return feats.at[idx.reshape(-1)].set(rows.reshape(-1, rows.shape[-1]).astype(feats.dtype),
                                       mode="drop")


_write_features_step = jax.jit(write_features, static_argnames=("page_size",),
                               donate_argnames=("feats",))


def feature_window(feats: jax.Array, page_indices, tokens, num_tokens, window: int, *,
                   page_size: int):
  """Each row's head window, right-aligned as ``head.draft`` takes it (the host path's
  layout): slot s pairs feature ``f_p`` with token ``x_{p+1}``, p = m - 1 - window + s
  for m = ``num_tokens[b]`` (slot ``window - 1``: ``f_{m-2}`` with the pending token).

  Args:
    feats: ``[num_pages * page_size, F]``; page_indices ``i32[B, W]``; tokens
      ``i32[B, M]`` (position p at column p); num_tokens ``i32[B]``.

  Returns:
    ``(tokens i32[B, window], feats f32[B, window, F], num_valid i32[B] (>= 1),
    positions i32[B] = m - 2)``; slots before the first real one hold zeros.
  """
  m = num_tokens
  p = (m - 1 - window)[:, None] + jnp.arange(window, dtype=jnp.int32)[None]
  real = p >= 0
  idx = _flat_index(page_indices, jnp.where(real, p, -1), page_size, feats.shape[0])
  f = jnp.take(feats, idx, axis=0, mode="fill", fill_value=0).astype(jnp.float32)
  toks = jnp.take_along_axis(tokens, jnp.clip(p + 1, 0, tokens.shape[1] - 1), axis=1)
  toks = jnp.where(real, toks, 0)
  num_valid = jnp.clip(m - 1, 1, window).astype(jnp.int32)
  return toks, f, num_valid, (m - 2).astype(jnp.int32)


def _slot_index(slots, capacity: int):
  """``i32[B]`` slots with -1 (no slot) mapped to ``capacity`` (out of range: a gather
  fills, a scatter drops; a negative index would wrap)."""
  return jnp.where(slots < 0, capacity, slots)


@functools.partial(jax.jit, donate_argnames=("windows",))
def append_windows(windows: jax.Array, slots, hidden: tuple, num_new, reset) -> jax.Array:
  """Shift-appends each row's new feature rows into its slot's window (the host-called
  path's per-request windows).

  Args:
    windows: ``[C, W, F]`` (the target's dtype), slot c's window right-aligned: row
      ``W - 1`` the newest feature, rows before the first real one zeros. Donated.
    slots: ``i32[B]`` each row's slot (-1: padding, nothing written).
    hidden: tuple of ``[B, T, D]`` target hidden states (concatenated into F in layer
      order; cast to ``windows.dtype``).
    num_new: ``i32[B]`` new rows per row, ``0 <= num_new[b] <= T``: row b's are
      ``hidden[..][b, :num_new[b]]``, in position order.
    reset: ``bool[B]`` start row b's window from zeros (a new or restarted request).

  Returns:
    ``windows`` with slot ``slots[b]`` = the last W rows of (its old window, or zeros
    where ``reset``) followed by row b's ``num_new[b]`` new rows; other slots unchanged.
  """
  capacity, width = windows.shape[:2]
  idx = _slot_index(slots, capacity)
  old = jnp.take(windows, idx, axis=0, mode="fill", fill_value=0)
  old = jnp.where(reset[:, None, None], jnp.zeros((), windows.dtype), old)
  rows = _feature_rows(tuple(hidden)).astype(windows.dtype)
  both = jnp.concatenate([old, rows], axis=1)  # [B, W + T, F]
  # Example: W = 3, old [a, b, c], new [d, e, -] (num_new 2) -> rows 2 .. 4: [c, d, e].
  new = jax.vmap(lambda x, n: jax.lax.dynamic_slice_in_dim(x, n, width, axis=0))(both, num_new)
  return windows.at[idx].set(new, mode="drop")


@jax.jit
def gather_windows(windows: jax.Array, slots) -> jax.Array:
  """``f32[B, W, F]`` the windows of ``slots i32[B]`` (``windows [C, W, F]``; -1: zeros),
  as ``head.draft`` takes them."""
  idx = _slot_index(slots, windows.shape[0])
  return jnp.take(windows, idx, axis=0, mode="fill", fill_value=0).astype(jnp.float32)


@dataclasses.dataclass
class _State:
  """The host-called path's state.

  ``windows`` is allocated when the first request takes a slot (None before:
  ``init_state`` also runs for fused runs, which never use it) with ``capacity`` slots of
  ``[window, feature_dim]`` in ``dtype``, and doubled when a request finds no free slot.
  A request keeps its slot until it finishes (a preempted one restarts it from zeros at
  its recompute's first prefill chunk); a freed slot is reset when taken again.
  """

  target: object  # SplitModel
  head_graphdef: object
  head_state: object
  window: int
  feature_dim: int
  dtype: object  # the target's dtype (the device path's FeaturePool dtype)
  capacity: int  # slots of the first allocation (the engine's max_num_seqs)
  windows: jax.Array | None = None  # [C, window, F] per-request windows (append_windows)
  slots: dict = dataclasses.field(default_factory=dict)  # request id -> slot
  free: list = dataclasses.field(default_factory=list)  # unused slots
  # request id -> positions with features (= committed tokens - 1)
  num_feats: dict = dataclasses.field(default_factory=dict)

  def take_slot(self, rid) -> int:
    """A slot for ``rid`` (its own if it has one); grows ``windows`` when none is free.
    A newly taken slot must be written with ``reset`` (it holds a finished request's
    window)."""
    if rid in self.slots:
      return self.slots[rid]
    if not self.free:
      old = 0 if self.windows is None else self.windows.shape[0]
      new = max(self.capacity, 2 * old, 1)
      zeros = jnp.zeros((new - old, self.window, self.feature_dim), self.dtype)
      self.windows = zeros if self.windows is None else jnp.concatenate([self.windows, zeros])
      self.free = list(range(new - 1, old - 1, -1))  # pops the lowest first
    self.slots[rid] = slot = self.free.pop()
    return slot

  def drop(self, rid) -> None:
    """Forgets ``rid`` (a finished request): its slot becomes free."""
    slot = self.slots.pop(rid, None)
    if slot is not None:
      self.free.append(slot)
    self.num_feats.pop(rid, None)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LearnedHeadMethod(Method):
  """Chain or tree drafting with a learned head (subclasses set ``kind``).

  Attributes:
    k: draft length, or a tree's most depth (MTP and Medusa: at most the head's
      ``num_modules``).
    head_path: a head directory written by ``models.heads.save_head`` (or by
      ``methods.training``), or a name in ``models.zoo.HEADS`` (trained into the cache). None builds a randomly initialised head (tests, smoke runs).
    feature_layers: target ``hidden_states`` indices of a random head; None = the
      kind's default for the target (EAGLE-3: low/mid/high, others: the final state).
      Must match the head's when ``head_path`` is given.
    window: positions the head attends to while drafting; None: the head's own
      (``HeadConfig.window``, the one it was trained with; 64 for a random head). Another
      value for a trained head drafts with a context it was not trained on (a cost
      experiment: the window is recomputed at every draft call).
    seed: initialisation seed of a random head.
    draft_vocab_size: a random EAGLE-3 head's reduced draft vocabulary (its LM head then
      covers target ids 0 .. draft_vocab_size - 1, as a trained head's covers its most
      frequent ones: the drafting cost of e.g. the 32,000-token head of Llama-3.1-8B);
      None: the full vocabulary. Only without ``head_path`` (a trained head has its own).
    tree_nodes: 0 drafts a chain of k tokens; n > 0 drafts a tree of n nodes and depth
      <= k (kinds whose ``max_tree_nodes`` is > 0: EAGLE-2 trees for EAGLE/EAGLE-3,
      candidate trees for Medusa). The verify step then holds n + 1 tokens.
    tree_branching: children per expanded tree node (top-k of the head).
    stop_entropy: None, or (chains only; SVIP, ``methods.svip``) a row stops after the
      first draft whose untempered head distribution has entropy above this many nats.
    matmul_precision: None drafts at the run's ``jax.default_matmul_precision``; else one
      of ``MATMUL_PRECISIONS`` for the head's own matmuls (the target's verify keeps
      the run's). Drafts only decide what is accepted, never what is committed, so a
      lower precision keeps every method lossless (vLLM and SGLang run drafters in the
      model's dtype).
    fused: chains without ``stop_entropy`` draft inside the engine's device step from
      device features (the module docstring); False: the host-called path (one
      synchronous step each; the test oracle of the fused path).
    coupled_sampling: chains only (trees draft without q and are verified by the coupled
      rule anyway): False (default) verifies sampled drafts with their q by min(1, p/q);
      True draws each draft by the verifier's Gumbel race over q at its position and
      verifies it by the coupled rule (``specjax.verify``; as
      ``methods.draft_model.DraftModel.coupled_sampling``): seeded requests emit their
      seeded AR tokens whatever their partners, at a lower acceptance.
  """

  kind: ClassVar[str]
  k: int = 4
  head_path: str | None = None
  feature_layers: tuple[int, ...] | None = None
  window: int | None = None
  seed: int = 0
  draft_vocab_size: int | None = None
  tree_nodes: int = 0
  tree_branching: int = 4
  stop_entropy: float | None = None
  matmul_precision: str | None = None
  fused: bool = True
  coupled_sampling: bool = False

  def __post_init__(self):
    if not isinstance(self.fused, bool):
      raise ValueError(f"fused={self.fused!r} must be True (chains draft in the engine's "
                       "device step) or False (host-called)")
    if not isinstance(self.coupled_sampling, bool):
      raise ValueError(f"coupled_sampling={self.coupled_sampling!r} must be True (drafts "
                       "verified by the coupled rule) or False (by min(1, p/q))")
    if self.stop_entropy is not None and (self.tree_nodes or not self.stop_entropy >= 0):
      raise ValueError(f"stop_entropy={self.stop_entropy} must be None, or >= 0 (nats) with "
                       f"chain drafting (tree_nodes={self.tree_nodes} must be 0)")
    if self.k < 1:
      raise ValueError(f"num_speculative_tokens k={self.k} must be >= 1")
    if self.window is not None and (not isinstance(self.window, int) or self.window < 1):
      raise ValueError(f"window={self.window!r} must be None (the head's) or an int >= 1")
    if self.matmul_precision is not None and self.matmul_precision not in MATMUL_PRECISIONS:
      raise ValueError(f"matmul_precision={self.matmul_precision!r} must be None (the run's) "
                       f"or one of {MATMUL_PRECISIONS}")
    if self.tree_nodes < 0:
      raise ValueError(f"tree_nodes={self.tree_nodes} must be >= 0 (0 drafts a chain)")
    if self.tree_branching < 1:
      raise ValueError(f"tree_branching={self.tree_branching} must be >= 1")
    if self.tree_nodes:
      capacity = self.max_tree_nodes()
      if capacity == 0:
        raise ValueError(f"method {self.name!r} drafts chains only: tree_nodes="
                         f"{self.tree_nodes} must be 0")
      if self.tree_nodes > capacity:
        raise ValueError(f"tree_nodes={self.tree_nodes} must be <= {capacity}, the "
                         f"candidates of a depth k={self.k}, tree_branching="
                         f"{self.tree_branching} tree")
    if self.feature_layers is not None:
      object.__setattr__(self, "feature_layers", tuple(int(i) for i in self.feature_layers))
    if self.draft_vocab_size is not None and self.head_path is not None:
      raise ValueError(f"draft_vocab_size={self.draft_vocab_size} is for a random head; "
                       f"head_path={self.head_path!r} has its own vocabulary")
    if self.head_path is not None:
      from models.zoo import resolve_head_path  # noqa: PLC0415

      object.__setattr__(self, "head_path", resolve_head_path(self.head_path))
      cfg = self._saved_config()
      if cfg.kind != self.kind:
        raise ValueError(f"head at head_path={self.head_path!r} has kind={cfg.kind!r}, "
                         f"method {self.name!r} needs {self.kind!r}")
      if self.feature_layers is not None and self.feature_layers != cfg.feature_layers:
        raise ValueError(f"feature_layers={self.feature_layers} must equal the head's "
                         f"{cfg.feature_layers}")
    elif self.feature_layers is None:
      raise ValueError(f"method {self.name!r} needs head_path (a trained head) or "
                       "feature_layers (a random head) to know which target layers to read")

  def _saved_config(self) -> HeadConfig:
    with open(os.path.join(self.head_path, "head_config.json")) as f:
      return HeadConfig.from_json(f.read())

  def max_tree_nodes(self) -> int:
    """Most tree nodes this kind can draft with ``k`` and ``tree_branching`` (0: chains
    only). Subclasses with a head ``draft_tree`` override it."""
    return 0

  @property
  def num_speculative_tokens(self) -> int:
    return self.tree_nodes or self.k

  @property
  def drafting_window(self) -> int:
    """Positions the head attends to while drafting: ``window``, else the head's own."""
    if self.window is not None:
      return self.window
    return self._saved_config().window if self.head_path is not None else 64

  def capabilities(self) -> Capabilities:
    layers = (self._saved_config().feature_layers if self.head_path is not None
              else self.feature_layers)
    tree = self.tree_nodes > 0
    fused = self.fused and self.stop_entropy is None
    return Capabilities(runs_on="fused" if fused else "device",
                        emits_draft_probs=not (tree or self.coupled_sampling),
                        target_hidden_layers=layers, tree=tree)

  def host_capabilities(self) -> Capabilities:
    """Its ``propose`` (called by a composite method) is the host-called device path."""
    return dataclasses.replace(self.capabilities(), runs_on="device")

  def head_config(self, target_config) -> HeadConfig:
    """Config of the random head built when ``head_path`` is None."""
    extra = {"num_modules": self.k} if head_class(self.kind).has_modules else {}
    if self.draft_vocab_size is not None:
      extra["draft_vocab_size"] = self.draft_vocab_size
    return HeadConfig.for_target(self.kind, target_config, feature_layers=self.feature_layers,
                                 window=self.drafting_window, **extra)

  def build_head(self, runtime) -> nnx.Module:
    """The head module (loaded, or random). Tests override this to plug in oracles.

    Raises:
      ValueError: the head does not fit the target, or ``k`` exceeds its modules.
    """
    if self.head_path is not None:
      head = load_head(self.head_path, runtime.target.config)
    else:
      head = _random_head(self.head_config(runtime.target.config), self.seed)
    if type(head).has_modules and self.k > head.cfg.num_modules:
      raise ValueError(f"k={self.k} must be <= the head's num_modules={head.cfg.num_modules}")
    return head

  def init_state(self, runtime) -> _State:
    head = self.build_head(runtime)
    graphdef, state = nnx.split(head)
    return _State(runtime.target, graphdef, state, self.window or head.cfg.window,
                  head.cfg.feature_dim, jnp.dtype(runtime.target.config.dtype),
                  max(1, runtime.max_num_seqs))

  # ---------------------------------------------------------------- fused path
  def init_device(self, runtime) -> tuple[HeadParams, FeaturePool]:
    """The head and target arrays, and an empty feature pool in the target's dtype."""
    head = self.build_head(runtime)
    graphdef, state = nnx.split(head)
    target = runtime.target
    params = HeadParams(state, target.params, graphdef, target.graphdef,
                        self.window or head.cfg.window)
    feats = jnp.zeros((runtime.num_pages * runtime.page_size, head.cfg.feature_dim),
                      jnp.dtype(target.config.dtype))
    return params, FeaturePool(feats, runtime.page_size)

  def prefill_device(self, params, state: FeaturePool, tokens, meta, hidden=()):
    """Writes the prefill chunk's features (its hidden rows) into the pool."""
    return FeaturePool(_write_features_step(state.feats, meta.page_indices, meta.kv_lens,
                                            meta.q_lens, tuple(hidden),
                                            page_size=state.page_size), state.page_size)

  def observe_device(self, params, state: FeaturePool, rows, hidden, meta):
    """Writes the iteration's L + 1 hidden rows into the pool (positions of its KV)."""
    return FeaturePool(write_features(state.feats, meta.page_indices, meta.kv_lens,
                                      meta.q_lens, tuple(hidden), page_size=state.page_size),
                       state.page_size)

  def _precision(self):
    """A context for the head's matmuls (``matmul_precision``; None: the run's)."""
    if self.matmul_precision is None:
      return contextlib.nullcontext()
    return jax.default_matmul_precision(self.matmul_precision)

  def propose_device(self, params: HeadParams, state: FeaturePool, rows, *, all_greedy):
    with self._precision():
      return self._propose_device(params, state, rows, all_greedy=all_greedy)

  def _propose_device(self, params: HeadParams, state: FeaturePool, rows, *, all_greedy):
    """k head steps for every row from its device window (``feature_window``), as the
    host path's ``head_draft_step`` (``tree_nodes > 0``: its ``head_tree_step`` tree of
    depth k, with ``parents``); rows with one committed token (no feature yet) draft
    nothing."""
    toks, feats, num_valid, positions = feature_window(
        state.feats, rows.page_indices, rows.tokens, rows.num_tokens, params.window,
        page_size=state.page_size)
    if self.tree_nodes:  # the whole tree; the engine keeps each row's first budget nodes
      out, parents = head_tree_step(
          params.head_graphdef, params.head_state, params.target_graphdef,
          params.target_params, toks, feats, num_valid, positions, depth=self.k,
          branching=self.tree_branching, num_nodes=self.tree_nodes)
      num = jnp.where(rows.num_tokens >= 2, rows.budgets, 0).astype(jnp.int32)
      keep = jnp.arange(self.tree_nodes)[None] < num[:, None]
      return state, DeviceDraft(jnp.where(keep, out, -1), num,
                                parents=jnp.where(keep, parents, -1))
    out, probs, _ = _head_draft(
        params.head_graphdef, params.head_state, params.target_graphdef, params.target_params,
        toks, feats, num_valid, positions, rows.temperature, rows.top_k, rows.top_p, rows.keys,
        rows.num_tokens, num_steps=self.k, all_greedy=all_greedy,
        coupled=self.coupled_sampling)
    num = jnp.where(rows.num_tokens >= 2, rows.budgets, 0).astype(jnp.int32)
    out = jnp.where(jnp.arange(self.k)[None] < num[:, None], out, -1)
    return state, DeviceDraft(out, num, probs)

  # ---------------------------------------------------------------- features
  @staticmethod
  def _append(state: _State, rids: list, hidden: tuple, num_new, reset) -> None:
    """One ``append_windows`` call over the padded batch of ``hidden`` (tuple of ``[B, T,
    D]`` device arrays): row b < len(rids) adds ``num_new[b]`` rows to ``rids[b]``'s slot
    (None: a row that writes nothing), restarting it where ``reset[b]``."""
    batch = hidden[0].shape[0]
    slots = np.full(batch, -1, np.int32)
    nums = np.zeros(batch, np.int32)
    resets = np.zeros(batch, bool)
    for b, rid in enumerate(rids):
      if rid is None or (not num_new[b] and not reset[b]):
        continue
      slots[b], nums[b], resets[b] = state.slots[rid], num_new[b], reset[b]
      state.num_feats[rid] = state.num_feats.get(rid, 0) + int(num_new[b])
    if (slots >= 0).any():
      state.windows = append_windows(state.windows, slots, tuple(hidden), nums, resets)

  def observe_prefill(self, state: _State, result: PrefillResult) -> _State:
    rids, reset = list(result.request_ids), np.zeros(len(result.request_ids), bool)
    for b, rid in enumerate(rids):
      start = int(result.starts[b])
      if start == 0:  # new or recomputed after preemption: the window restarts from zeros
        state.num_feats[rid] = 0
      reset[b] = start == 0 or rid not in state.slots
      assert state.num_feats.get(rid, 0) == start, (rid, state.num_feats.get(rid), start)
      state.take_slot(rid)
    self._append(state, rids, result.target_hidden, np.asarray(result.num_tokens), reset)
    return state

  def observe(self, state: _State, result: VerifyResult) -> _State:
    rids, reset = [], np.zeros(len(result.request_ids), bool)
    for b, rid in enumerate(result.request_ids):
      if rid in result.finished:
        state.drop(rid)
        rids.append(None)
        continue
      if rid not in state.slots:  # no prefill (a one-token prompt): a fresh slot
        state.take_slot(rid)
        reset[b] = True
      rids.append(rid)
    self._append(state, rids, result.target_hidden,
                 np.asarray([len(e) for e in result.emitted], np.int32), reset)
    return state

  # ---------------------------------------------------------------- drafting
  def propose(self, state: _State, ctx):
    with self._precision():
      return self._propose(state, ctx)

  def _propose(self, state: _State, ctx):
    rows = len(ctx.request_ids)
    batch = ctx.page_indices.shape[0]
    width = state.window
    tokens = np.zeros((batch, width), np.int32)
    slots = np.full(batch, -1, np.int32)
    num_valid = np.ones(batch, np.int32)
    positions = np.zeros(batch, np.int32)
    draft_positions = np.zeros(batch, np.int32)
    budgets = np.asarray(ctx.budgets, np.int32).copy()
    for i, (rid, seq) in enumerate(zip(ctx.request_ids, ctx.token_ids)):
      m = len(seq)
      have = state.num_feats.get(rid, 0)
      assert have == m - 1, (rid, have, m)
      if have == 0:  # a one-token prompt: no feature yet, decode one token plainly
        budgets[i] = 0
        continue
      n = min(have, width)
      # Slot s pairs feature position p = m - 1 - n + s' with token x_{p+1} (the window in
      # ``state.windows``: features of positions m - 1 - n .. m - 2, right-aligned).
      tokens[i, width - n:] = seq[m - n:]
      slots[i] = state.slots[rid]
      num_valid[i], positions[i], draft_positions[i] = n, m - 2, m
    target = state.target
    width = self.tree_nodes or self.k
    num = np.clip(budgets[:rows], 0, width).astype(np.int32)
    most = int(num.max(initial=0))
    if most == 0:  # nobody drafts: no head step at all
      return state, Draft(np.full((rows, width), -1, np.int32), num)
    keep = np.arange(width)[None] < num[:, None]
    feats = gather_windows(state.windows, slots)  # f32[B, window, F], on the device
    if self.tree_nodes:
      # An n-node tree is at most n deep, and the best ``most`` nodes of the shallower
      # tree are the full tree's first ``most`` nodes (rank order lists parents first).
      out, parents = head_tree_step(
          state.head_graphdef, state.head_state, target.graphdef, target.params, tokens, feats,
          num_valid, positions, depth=min(self.k, most), branching=self.tree_branching,
          num_nodes=most)
      out, parents = _pad_to(np.array(out)[:rows], width), _pad_to(np.array(parents)[:rows], width)
      return state, Draft(np.where(keep, out, -1), num, parents=np.where(keep, parents, -1))
    all_greedy = bool(np.all(is_greedy(ctx.temperature[:rows])))
    out, probs, stopped = head_draft_step(
        state.head_graphdef, state.head_state, target.graphdef, target.params, tokens, feats,
        num_valid, positions, ctx.temperature, ctx.top_k, ctx.top_p, ctx.keys,
        draft_positions, num_steps=most, all_greedy=all_greedy,
        stop_entropy=self.stop_entropy, coupled=self.coupled_sampling)
    if self.stop_entropy is not None:
      num = np.minimum(num, np.asarray(stopped)[:rows]).astype(np.int32)
      keep = np.arange(width)[None] < num[:, None]
    out = _pad_to(np.array(out)[:rows], width)
    if probs is not None and most < width:
      probs = jnp.pad(probs, ((0, 0), (0, width - most), (0, 0)))
    return state, Draft(np.where(keep, out, -1), num, probs=probs)


@functools.lru_cache(maxsize=2)
def _random_head(cfg: HeadConfig, seed: int):
  """``make_head(cfg, seed)`` (ids 0 .. V' - 1 for a reduced draft vocabulary), built
  once per (config, seed): its numpy init of an 8B-shape EAGLE-3 head takes ~10 s on a
  CPU core, and every ``Engine.generate`` calls ``build_head`` twice (``init_state`` and
  ``init_device``). The module is only split, never updated, so sharing it is safe."""
  d2t = None if cfg.draft_vocab_size is None else np.arange(cfg.draft_vocab_size)
  return make_head(cfg, seed, d2t)


def _pad_to(a: np.ndarray, width: int) -> np.ndarray:
  """``i32[rows, n]`` -> ``i32[rows, width]`` padded with -1 (n <= width)."""
  return np.pad(a, ((0, 0), (0, width - a.shape[1])), constant_values=-1)
