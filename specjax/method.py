"""The method plugin interface: ``propose(state, context)`` and ``observe(state, result)``.

A method is a frozen, keyword-only dataclass (hashable, usable as a static jit
argument). Its mutable per-run state is a separate object returned by ``init_state``.
Verification is shared (``specjax.verify``) and knows no method.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, ClassVar

import jax
import numpy as np

__all__ = ["Capabilities", "DeviceDraft", "DeviceRows", "Draft", "InnerMethodOption", "Method",
           "PrefillResult", "ProposeContext", "ReadResult", "RuntimeInfo", "VerifyPlan",
           "VerifyResult"]


@dataclasses.dataclass(frozen=True)
class Capabilities:
  """What a method needs and emits.

  Attributes:
    runs_on: "host" (numpy ``propose``), "device" (``propose`` calls its own jitted
      functions; the engine waits for each step before the next ``propose``), or "fused"
      (``propose_device`` is a pure function the engine traces into its one jitted call
      per iteration, so iterations run asynchronously: ``Method.propose_device``).
    emits_draft_probs: True if ``Draft.probs`` carries q (needed for stochastic
      verification against a real draft distribution).
    target_hidden_layers: HF ``hidden_states`` indices of the target the method reads.
    tree: True if the method drafts trees (``Draft.parents``). Host-called drafts are
      trees exactly when they carry ``parents``; a fused proposer's steps are all tree
      steps when this is True (its ``DeviceDraft`` must carry ``parents``) and chain
      steps otherwise.
    needs_draft_model: True if the method needs ``--draft``.
    drafts_in_target_kv: True if the method drafts with the target's own layers into
      the target's KV pool: ``propose`` gets the pool as ``ProposeContext.kv_caches``
      (donated: the engine drops its reference) and must hand it back, updated, as
      ``Draft.kv_caches``. It may write only positions the verify step then overwrites
      (``[len(tokens) - 1, len(tokens) - 1 + num_tokens)`` of each row; LayerSkip).
    plans_verify: a "fused" method whose host side caps the drafts each row may verify
      in every dispatch (``Method.plan_verify``) from the results the engine has read so
      far (``Method.observe_read``); the engine verifies at the bucket of the largest
      cap instead of k. Iterations still run asynchronously, so a dispatch's caps are
      decided from the calls before the one in flight.
  """

  runs_on: str = "host"
  emits_draft_probs: bool = False
  target_hidden_layers: tuple[int, ...] = ()
  tree: bool = False
  needs_draft_model: bool = False
  drafts_in_target_kv: bool = False
  plans_verify: bool = False


@dataclasses.dataclass
class Draft:
  """Draft tokens for the step's rows.

  Attributes:
    tokens: ``i32[B, L]``, -1 padded.
    num_tokens: ``i32[B]`` real draft tokens (tree nodes) per row; the engine keeps at
      most the row's budget (the first nodes of a tree).
    probs: optional ``f32[B, L, V]`` draft distributions q (device array): for a tree,
      the distribution node j's token was drawn from (None when tokens are chosen
      deterministically, e.g. top-k trees).
    parents: optional ``i32[B, L]`` tree parent indices (-1 = child of the pending
      token), parents before children (``specjax.tree``); None for chains.
    kv_caches: the target KV pool handed back by a ``drafts_in_target_kv`` method
      (None otherwise).
    replay_source: optional ``i32[rows]``, measurement only: under acceptance replay
      with several sources (``EngineConfig.replay_sources``), the recorded trace each
      row's step replays (the drafter that drafted it); None: source 0.
  """

  tokens: np.ndarray
  num_tokens: np.ndarray
  probs: Any = None
  parents: np.ndarray | None = None
  kv_caches: Any = None
  replay_source: np.ndarray | None = None


@dataclasses.dataclass
class RuntimeInfo:
  """What ``init_state`` may use: the loaded target (and draft) and the KV pool geometry.

  ``method_cache`` is one per engine and outlives ``generate`` calls (``init_state`` runs
  once per call): a method keeps state there that must persist across calls, e.g. suffix
  decoding's global tree of earlier responses, under a key of its own (its config).
  """

  target: Any  # models.zoo.LoadedModel-like: .config, .graphdef, .params
  draft: Any
  num_pages: int
  page_size: int
  max_model_len: int
  attention_implementation: Any
  method_cache: dict = dataclasses.field(default_factory=dict)
  max_num_seqs: int = 1  # decode slots of the device state (``specjax.slots``)


@dataclasses.dataclass
class ProposeContext:
  """The step's rows, as the scheduler sees them (host numpy).

  Attributes:
    request_ids: one per real row.
    token_ids: per row, prompt + committed output tokens (the last one is pending:
      its KV is not yet written).
    budgets: ``i32[num_rows]`` the most draft tokens each row may get.
    page_indices: ``i32[B, pages_per_seq]`` page table of the padded batch (B >= rows).
    temperature, top_k, top_p: ``[B]`` sampling arrays of the padded batch.
    keys: ``u32[B, 2]`` request keys.
    new_requests: request ids seen for the first time (or after preemption).
    kv_caches: the target's KV pool, only for ``Capabilities.drafts_in_target_kv``
      methods (None otherwise); every committed position but the pending token's holds
      the target's KV in every layer.
  """

  request_ids: list
  token_ids: list[np.ndarray]
  budgets: np.ndarray
  page_indices: np.ndarray
  temperature: np.ndarray
  top_k: np.ndarray
  top_p: np.ndarray
  keys: np.ndarray
  new_requests: frozenset = frozenset()
  kv_caches: Any = None


@dataclasses.dataclass
class VerifyResult:
  """What the shared verifier decided for each row of the step.

  Attributes:
    request_ids: one per real row.
    num_accepted: ``i32[rows]`` leading accepted drafts (tree: accepted path length).
    emitted: per row, the tokens actually committed (after stop truncation).
    finished: request ids that ended this step (their state may be dropped).
    target_hidden: optional tuple of ``[B, T, D]`` hidden states the method asked for,
      rows in commit order (trees: row 0 the pending token, row i the accepted node at
      depth i), so row i belongs to the i-th emitted token's input.
    replay_acceptance: measurement only, under acceptance replay
      (``EngineConfig.acceptance_replay``, host path): ``i32[rows, N]`` the drafts each
      of the N replay sources' recorded traces accepts at the row's output position
      (``replay_acc_len[i] - 1``, before capping at the row's draft count), so a method
      that chose one source per row also learns what the others would have accepted;
      None otherwise.
  """

  request_ids: list
  num_accepted: np.ndarray
  emitted: list[list[int]]
  finished: frozenset
  target_hidden: tuple = ()
  replay_acceptance: np.ndarray | None = None


@dataclasses.dataclass
class VerifyPlan:
  """A ``plans_verify`` method's choice for one fused dispatch (host numpy).

  Attributes:
    caps: ``i32[rows]`` the most drafts each row may verify in every iteration of the
      dispatch, in ``[0, k]`` (the proposer sees ``min(budget, cap)`` as
      ``DeviceRows.budgets``); the step's verify length is the engine bucket (1, 2, 4,
      .., k) of the largest cap (at least 1).
    info: anything the method wants back with each read of this dispatch
      (``ReadResult.plan_info``), e.g. the stale decision the caps came from.
  """

  caps: np.ndarray
  info: Any = None


@dataclasses.dataclass
class ReadResult:
  """One iteration of a fused dispatch as the host reads it, for a ``plans_verify``
  method (``Method.observe_read``); rows that ended before (or were padding) are left
  out.

  Attributes:
    request_ids: one per committed row.
    num_accepted: ``i32[rows]`` leading accepted drafts.
    num_verified: ``i32[rows]`` drafts verified (``min(drafted, budget, cap)``).
    budgets: ``i32[rows]`` each row's budget in this iteration (``min(k, room before
      max_model_len, max_tokens - outputs - 1)``, before the cap).
    caps: ``i32[rows]`` the dispatch's ``VerifyPlan.caps`` of these rows.
    plan_info: the dispatch's ``VerifyPlan.info``.
    finished: request ids that ended in this iteration.
  """

  request_ids: list
  num_accepted: np.ndarray
  num_verified: np.ndarray
  budgets: np.ndarray
  caps: np.ndarray
  plan_info: Any
  finished: frozenset


@dataclasses.dataclass
class PrefillResult:
  """What a prefill step computed, for methods that read target hidden states.

  Only sent when ``Capabilities.target_hidden_layers`` is non-empty.

  Attributes:
    request_ids: one per real row.
    starts: ``i32[rows]`` absolute position of each row's first prefilled token.
    num_tokens: ``i32[rows]`` prefilled tokens per row (row b's hidden states are
      ``hidden[i][b, :num_tokens[b]]`` for positions ``starts[b] ..``).
    target_hidden: tuple of ``[B, T, D]`` hidden states, one per requested layer.
  """

  request_ids: list
  starts: np.ndarray
  num_tokens: np.ndarray
  target_hidden: tuple = ()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DeviceRows:
  """The rows of one fused step as a ``propose_device`` sees them (device arrays over
  the padded batch B; M = max_model_len).

  Attributes:
    slots: ``i32[B]`` decode slot of each row (-1: padding).
    active: ``bool[B]`` a real row the device has not finished.
    tokens: ``i32[B, M]`` prompt + committed tokens (position p at column p); the last,
      ``tokens[b, num_tokens[b] - 1]``, is pending (its KV is not yet written).
    num_tokens: ``i32[B]`` committed tokens.
    budgets: ``i32[B]`` the most draft tokens the row may get (0 for inactive rows).
    page_indices: ``i32[B, W]`` the target's page table of the step.
    temperature, top_p: ``f32[B]``; top_k: ``i32[B]``; keys: ``u32[B, 2]``.
    slot_tokens: ``i32[S, M]`` every decode slot's tokens (``specjax.slots.SlotState``),
      rows of this step or not, e.g. for a cache over all running requests.
    slot_num_tokens: ``i32[S]`` their committed lengths.
  """

  slots: jax.Array
  active: jax.Array
  tokens: jax.Array
  num_tokens: jax.Array
  budgets: jax.Array
  page_indices: jax.Array
  temperature: jax.Array
  top_k: jax.Array
  top_p: jax.Array
  keys: jax.Array
  slot_tokens: jax.Array
  slot_num_tokens: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DeviceDraft:
  """A fused proposer's draft: ``tokens i32[B, k]`` (-1 padded), ``num_tokens i32[B]``
  (the engine keeps at most each row's budget and the step's width: a tree's first
  nodes), optional ``probs f32[B, k, V]`` (q; None: one-hot drafts), optional
  ``parents i32[B, k]`` (a tree, as ``Draft.parents``: -1 = child of the pending token,
  parents before children; the method's ``Capabilities.tree`` must be True)."""

  tokens: jax.Array
  num_tokens: jax.Array
  probs: Any = None
  parents: Any = None


@dataclasses.dataclass(frozen=True)
class InnerMethodOption:
  """An option of a composite method that holds its inner methods (``Method.inner_methods``).

  Users name inner methods by registry name (e.g. ``verify_skip.drafter=ngram``);
  ``methods.registry.make_method`` builds them with the composite's k and passes the
  composite the constructed ``Method`` objects, so no method module needs the registry.

  Attributes:
    option: the composite's dataclass field, e.g. "drafter".
    default: the registry name built when the option is not given ("ngram"), or a tuple
      of names (("suffix", "ngram")) for an option holding a tuple of methods (names are
      then given as a sequence or one comma-separated string).
    options: the option (not a field: the registry consumes it) holding the named inner
      method's own options as a dict or pairs, e.g. "drafter_options"; None: none.
  """

  option: str
  default: str | tuple[str, ...]
  options: str | None = None

  @property
  def many(self) -> bool:
    """The option holds a tuple of methods."""
    return isinstance(self.default, tuple)


class Method(abc.ABC):
  """Base of all SD methods. Subclasses are frozen keyword-only dataclasses.

  Host and "device" methods implement ``propose`` (called by the host loop once per
  step, synchronously). A "fused" method (``Capabilities.runs_on == "fused"``)
  implements ``init_device`` and ``propose_device`` instead: a pure, jittable function
  of (its params, its device state, the step's ``DeviceRows``) that the engine traces
  into the one device call of each iteration; nothing of it runs on the host.
  """

  name: ClassVar[str]
  # The options naming inner methods of a composite (wrapper) method, built by the registry.
  inner_methods: ClassVar[tuple[InnerMethodOption, ...]] = ()

  @property
  @abc.abstractmethod
  def num_speculative_tokens(self) -> int:
    """k: the most draft tokens per row per step (0 for plain decoding)."""

  def capabilities(self) -> Capabilities:
    return Capabilities()

  def host_capabilities(self) -> Capabilities:
    """``capabilities()`` as seen by a composite method that calls this one's ``propose``
    from the host: a "fused" method is then a host method (its numpy ``propose``)."""
    caps = self.capabilities()
    return dataclasses.replace(caps, runs_on="host") if caps.runs_on == "fused" else caps

  def init_state(self, runtime: RuntimeInfo) -> Any:
    return None

  @abc.abstractmethod
  def propose(self, state: Any, context: ProposeContext) -> tuple[Any, Draft]:
    """Returns the new state and a ``Draft`` for the rows of ``context``."""

  def observe(self, state: Any, result: VerifyResult) -> Any:
    return state

  def observe_prefill(self, state: Any, result: PrefillResult) -> Any:
    """Sees the target hidden states of a prefill (only if it asked for hidden layers)."""
    return state

  def init_device(self, runtime: RuntimeInfo) -> tuple[Any, Any]:
    """``(params, state)`` pytrees of a fused proposer (device arrays; both may be ``()``).
    ``params`` are read-only; ``state`` is threaded through (and donated to) every step."""
    return (), ()

  def propose_device(self, params: Any, state: Any, rows: DeviceRows, *,
                     all_greedy: bool) -> tuple[Any, DeviceDraft]:
    """The fused proposer (traced inside the engine step; pure jnp, no host syncs).
    ``all_greedy`` (static): every row of the step is greedy, so no draft
    probabilities are needed.

    Raises:
      NotImplementedError: the method is not "fused".
    """
    raise NotImplementedError(f"method {self.name!r} has no fused device proposer")

  def prefill_device(self, params: Any, state: Any, tokens, meta, hidden: tuple = ()) -> Any:
    """Sees each prefill call of the target (host-called, synchronous), e.g. to fill a
    draft model's own KV with the same chunk: ``tokens i32[B, T]``, ``meta`` the
    chunk's ``AttentionMetadata`` (row b's tokens are positions ``kv_lens[b] - q_lens[b]
    ..``), ``hidden`` the target's ``[B, T, D]`` hidden states of
    ``Capabilities.target_hidden_layers`` (device arrays). Returns the new state;
    default: unchanged."""
    return state

  def observe_device(self, params: Any, state: Any, rows: DeviceRows, hidden: tuple,
                     meta) -> Any:
    """Sees the target forward of each fused iteration (traced inside the engine step,
    before verification): ``hidden`` the ``[B, L+1, D]`` hidden states of
    ``Capabilities.target_hidden_layers`` over ``[pending, d_1 .. d_L]``, whose row t is
    position ``meta.kv_lens[b] - meta.q_lens[b] + t`` for ``t < q_lens[b]`` (rows past
    the commit are rewritten by a later iteration before they are committed, as the
    KV is). Only called for methods with target hidden layers. Returns the new state;
    default: unchanged."""
    return state

  def reset_device(self, params: Any, state: Any, slots, num_tokens) -> Any:
    """Called when decode slots get new requests (``slots i32[n]``, their committed
    ``num_tokens i32[n]``; -1 slots are padding). Returns the new state; default:
    unchanged."""
    return state

  def release_device(self, params: Any, state: Any, slot_tokens, slots, num_tokens) -> Any:
    """Called when decode slots are given up (their requests finished or were
    preempted), before a slot is written again: ``slot_tokens i32[S, M]`` the slots'
    tokens, ``slots i32[n]`` (-1: padding), ``num_tokens i32[n]`` each request's final
    committed length as the host has it (stop strings applied). Returns the new state;
    default: unchanged."""
    return state

  def end_device(self, runtime: RuntimeInfo, params: Any, state: Any) -> None:
    """Called when ``generate`` (or ``precompile``) ends, with the fused state; e.g. to
    keep a cache for the next call in ``runtime.method_cache``. Default: nothing."""
    del runtime, params, state

  def plan_verify(self, state: Any, request_ids: list,
                  budgets: np.ndarray) -> tuple[Any, VerifyPlan]:
    """A ``plans_verify`` method's caps for the next fused dispatch, from the host:
    ``request_ids`` its rows, ``budgets i32[rows]`` their budgets as the host knows them
    (tokens of the calls still in flight not counted: an upper bound). Returns the new
    (host) state and the ``VerifyPlan``.

    Raises:
      NotImplementedError: the method does not plan its verify caps.
    """
    raise NotImplementedError(f"method {self.name!r} does not plan fused verify caps")

  def observe_read(self, state: Any, result: ReadResult) -> Any:
    """Sees each iteration of a fused dispatch once the host has read it (a
    ``plans_verify`` method only; calls in order). Returns the new host state; default:
    unchanged."""
    return state

  def describe(self) -> dict:
    """Flat dict of the config, recorded in result rows."""
    return {"method": self.name, **dataclasses.asdict(self)}


def empty_draft(num_rows: int, length: int) -> Draft:
  """A draft with no tokens (all rows decode one token)."""
  return Draft(np.full((num_rows, length), -1, np.int32), np.zeros(num_rows, np.int32))
