"""Device-resident decode state: one slot per running sequence (ARCHITECTURE §6).

Between engine iterations each running request owns a slot ``s`` in ``[0,
max_num_seqs)`` of a ``SlotState`` that lives on the device: the token history that
drafters read and the device commit appends to, the committed length, the request's
budgets, stop ids, sampling parameters and key, and a finished flag. The fused step
(``specjax.steps.engine_step``) reads rows' slots, drafts, verifies, and commits on the
device, so the next iteration can be dispatched before the host has read this one. The
host mirror (``specjax.request.RequestState``) is brought up to date when a result is
read, one or more iterations late.

Slots are written by ``write_slots`` when a request becomes decode-ready (after its
prefill) and only while no step is in flight; a slot freed by a finished request is
rewritten whole before it is reused.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["SlotAllocator", "SlotState", "init_slots", "padded_rows", "slot_rows", "write_slots"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotState:
  """Per-slot decode state on the device (S slots, M = max_model_len, E stop ids).

  Attributes:
    tokens: ``i32[S, M]`` prompt + committed output; position p holds token p. The last
      committed token (``tokens[s, num_tokens[s] - 1]``) is pending: its KV is not written.
    num_tokens: ``i32[S]`` committed tokens (prompt included).
    num_prompt: ``i32[S]`` prompt tokens.
    max_tokens: ``i32[S]`` the request's ``max_tokens``.
    stop_ids: ``i32[S, E]`` token ids that end the request (EOS unless ``ignore_eos``,
      then ``stop_token_ids``), -1 padded.
    keys: ``u32[S, 2]`` request keys.
    temperature: ``f32[S]``; top_k: ``i32[S]``; top_p: ``f32[S]``.
    finished: ``bool[S]`` the device committed a stopping token (EOS / stop id /
      max_tokens / max_model_len); stop strings are the host's.
    replay_acc: ``i32[S, N, R]`` replayed acceptance by source and output position
      (source 0 ``Request.replay_acc_len``, source n ``Request.replay_sources[n - 1]``; 1
      past a trace's end; ``EngineConfig.acceptance_replay``), N =
      ``EngineConfig.replay_sources``, R = M; ``[S, 1, 1]`` (unused) otherwise.
  """

  tokens: jax.Array
  num_tokens: jax.Array
  num_prompt: jax.Array
  max_tokens: jax.Array
  stop_ids: jax.Array
  keys: jax.Array
  temperature: jax.Array
  top_k: jax.Array
  top_p: jax.Array
  finished: jax.Array
  replay_acc: jax.Array

  @property
  def num_slots(self) -> int:
    return self.num_tokens.shape[0]

  @property
  def max_model_len(self) -> int:
    return self.tokens.shape[1]


def init_slots(num_slots: int, max_model_len: int, num_stop_ids: int,
               replay: bool = False, replay_sources: int = 1) -> SlotState:
  """An all-empty ``SlotState`` (every slot finished, no tokens); ``replay``: room for
  each slot's ``replay_sources`` replayed traces (``SlotState.replay_acc``)."""
  s = num_slots
  return SlotState(
      tokens=jnp.zeros((s, max_model_len), jnp.int32), num_tokens=jnp.zeros(s, jnp.int32),
      num_prompt=jnp.zeros(s, jnp.int32), max_tokens=jnp.zeros(s, jnp.int32),
      stop_ids=jnp.full((s, num_stop_ids), -1, jnp.int32), keys=jnp.zeros((s, 2), jnp.uint32),
      temperature=jnp.zeros(s, jnp.float32), top_k=jnp.zeros(s, jnp.int32),
      top_p=jnp.ones(s, jnp.float32), finished=jnp.ones(s, bool),
      replay_acc=jnp.ones((s, replay_sources, max_model_len) if replay else (s, 1, 1),
                          jnp.int32))


@functools.partial(jax.jit, donate_argnames=("state",))
def _write(state: SlotState, slots, tokens, ints, floats, stop_ids, keys,
           replay_acc) -> SlotState:
  """Scatters rows into ``slots`` (-1 rows dropped)."""
  idx = jnp.where(slots >= 0, slots, state.num_slots)  # out of range: dropped
  put = lambda a, v: a.at[idx].set(v.astype(a.dtype), mode="drop")
  return SlotState(
      tokens=put(state.tokens, tokens), num_tokens=put(state.num_tokens, ints[:, 0]),
      num_prompt=put(state.num_prompt, ints[:, 1]), max_tokens=put(state.max_tokens, ints[:, 2]),
      stop_ids=put(state.stop_ids, stop_ids), keys=put(state.keys, keys),
      temperature=put(state.temperature, floats[:, 0]), top_k=put(state.top_k, ints[:, 3]),
      top_p=put(state.top_p, floats[:, 1]),
      finished=put(state.finished, jnp.zeros(slots.shape, bool)),
      replay_acc=put(state.replay_acc, replay_acc))


def padded_rows(n: int) -> int:
  """The row count ``write_slots`` pads ``n`` rows to: the next power of two (3 -> 4)."""
  size = 1
  while size < n:
    size *= 2
  return size


def write_slots(state: SlotState, slots: list[int], rows: list, eos_ids: frozenset) -> SlotState:
  """Writes the decode state of host requests into their slots (one device call).

  Args:
    state: the current ``SlotState`` (donated).
    slots: slot index of each row.
    rows: ``specjax.request.RequestState`` of each row; ``tokens`` must fit in M.
    eos_ids: the engine's EOS ids (dropped for requests with ``ignore_eos``).

  Returns:
    The new ``SlotState``; the row count is padded to a power of two (rows of slot -1),
    so admissions of any size compile O(log S) times.

  Raises:
    ValueError: a request has more stop ids than the state's E, or more tokens than M.
  """
  n = padded_rows(len(rows))
  m, e = state.max_model_len, state.stop_ids.shape[1]
  idx = np.full(n, -1, np.int32)
  tokens = np.zeros((n, m), np.int32)
  ints = np.zeros((n, 4), np.int32)
  floats = np.zeros((n, 2), np.float32)
  stop = np.full((n, e), -1, np.int32)
  keys = np.zeros((n, 2), np.uint32)
  replay = np.ones((n, *state.replay_acc.shape[1:]), np.int32)
  for i, (slot, st) in enumerate(zip(slots, rows)):
    sp = st.request.sampling
    ids = sorted(set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(eos_ids)))
    if len(ids) > e:
      raise ValueError(f"request {st.request.request_id!r}: {len(ids)} stop ids (EOS + "
                       f"stop_token_ids) must be <= {e}, the engine's slot width")
    if len(st.tokens) > m:
      raise ValueError(f"request {st.request.request_id!r}: {len(st.tokens)} tokens must be "
                       f"<= max_model_len={m}")
    idx[i] = slot
    tokens[i, : len(st.tokens)] = st.tokens
    ints[i] = (len(st.tokens), st.num_prompt, sp.max_tokens, sp.top_k)
    floats[i] = (sp.temperature, sp.top_p)
    stop[i, : len(ids)] = ids
    keys[i] = st.key
    traces = (st.request.replay_acc_len, *st.request.replay_sources)
    if traces[0] is not None and replay.shape[2] > 1:
      for source, acc in enumerate(traces[: replay.shape[1]]):
        acc = np.asarray(acc[: replay.shape[2]], np.int32)
        replay[i, source, : len(acc)] = acc
  return _write(state, idx, tokens, ints, floats, stop, keys, replay)


def slot_rows(state: SlotState, slots: jax.Array) -> dict:
  """Gathers the step's rows (``slots i32[B]``, -1 = padding) from ``state`` inside a
  jitted step: a dict of ``[B, ...]`` arrays with the ``SlotState`` field names plus
  ``active bool[B]`` (a real, unfinished row)."""
  safe = jnp.maximum(slots, 0)
  rows = {f.name: getattr(state, f.name)[safe] for f in dataclasses.fields(state)}
  rows["active"] = (slots >= 0) & ~rows["finished"]
  return rows


class SlotAllocator:
  """Host free list of slot indices (lowest first)."""

  def __init__(self, num_slots: int):
    self._free = list(range(num_slots - 1, -1, -1))

  def allocate(self) -> int:
    if not self._free:
      raise RuntimeError("no free decode slot (more running requests than max_num_seqs)")
    return self._free.pop()

  def free(self, slot: int) -> None:
    self._free.append(slot)
    self._free.sort(reverse=True)
