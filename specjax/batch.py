"""Host step builder: the rows of one engine step -> one packed ``i32`` array (one
host-to-device copy), and its unpacking inside the jitted step.

Everything else a step needs about its rows (tokens, lengths, budgets, sampling
parameters, keys, stop ids) is already on the device in the ``specjax.slots.SlotState``,
so the host sends only what it owns: the page table and, for host drafters, the drafts.

Column layout of ``ints i32[B, W + 2 + L]`` for a page-table width ``W`` and host draft
width ``L`` (0 when the drafts are made on the device). Worked example: W = 4, L = 2, a
row in slot 3 with pages [7, 2] and one host draft 42 is ``[7, 2, -1, -1, 3, 1, 42, -1]``;
a padding row is ``[-1, -1, -1, -1, -1, 0, -1, -1]``:

  ``[0, W)``      page_indices (-1 padded)
  ``W + 0``       slot of the row in the ``SlotState`` (-1: padding row)
  ``W + 1``       number of host drafts; in a fused proposer's step with verify caps
                  (``StepPlan.verify_caps``), the most drafts the row may verify
  ``W + 2 ..``    L host draft tokens (-1 padded)
  ``W + 2 + L``   only with ``replay_source``: the row's replayed-acceptance source

``AttentionMetadata`` lives next to the kernel it describes
(``pallas_kernels.paged_attention.metadata``) and is re-exported here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from pallas_kernels.paged_attention.metadata import AttentionMetadata

__all__ = ["AttentionMetadata", "DeviceBatch", "StepBatch", "bucket", "build_batch",
           "unpack_batch"]


def bucket(n: int, cap: int, minimum: int = 1, growth: int = 2) -> int:
  """Smallest ``minimum * growth**i`` >= n, capped at ``cap`` (e.g. 5 -> 8; growth 4,
  minimum 4: 5 -> 16)."""
  b = minimum
  while b < n:
    b *= growth
  return max(n, min(b, cap))

_FIXED = 2  # columns after the page table, before the drafts


@dataclasses.dataclass
class StepBatch:
  """The numpy array of one step (host side): ``ints i32[B, W + 2 + L]``."""

  ints: np.ndarray
  width: int
  length: int


def build_batch(*, batch: int, width: int, length: int, page_tables: Sequence,
                slots, num_draft=None, drafts=None, replay_source=None,
                verify_caps=None) -> StepBatch:
  """Packs ``len(page_tables)`` real rows into a ``StepBatch`` of ``batch`` rows.

  Args:
    page_tables: per row, its page ids (at most ``width``; a list or an ``i32`` array such as
      ``RequestState.page_array()``).
    slots: per row, its decode slot.
    num_draft, drafts: per row, host draft counts and ``i32[rows, length]`` tokens (None:
      no host drafts).
    replay_source: None (no column), or per row the source of its replayed acceptance
      (``EngineConfig.replay_sources``; padding rows 0).
    verify_caps: None, or per row the most drafts a fused proposer's step may verify
      (``specjax.method.VerifyPlan.caps``; padding rows 0); not with ``num_draft``.

  Raises:
    ValueError: a row has more pages than ``width`` or more drafts than ``length``, a
      negative verify cap, or both ``num_draft`` and ``verify_caps``.
  """
  rows = len(page_tables)
  if rows > batch:
    raise ValueError(f"{rows=} real rows must be <= batch={batch}")
  extra = replay_source is not None
  ints = np.full((batch, width + _FIXED + length + extra), -1, np.int32)
  ints[:, width + 1] = 0
  if extra:
    ints[:, -1] = 0
    ints[:rows, -1] = replay_source
  for i, pages in enumerate(page_tables):
    if len(pages) > width:
      raise ValueError(f"row {i} has {len(pages)} pages; the step's table holds {width=}")
    ints[i, : len(pages)] = pages
  ints[:rows, width] = slots
  if num_draft is not None:
    nd = np.asarray(num_draft, np.int32)
    if rows and nd.max(initial=0) > length:
      raise ValueError(f"num_draft={nd.tolist()} must be <= the step's draft width {length}")
    ints[:rows, width + 1] = nd
  if verify_caps is not None:
    caps = np.asarray(verify_caps, np.int32)
    if num_draft is not None or caps.shape != (rows,) or (caps < 0).any():
      raise ValueError(f"verify_caps={caps.tolist()} must hold one cap >= 0 per row ({rows} "
                       "rows), without num_draft")
    ints[:rows, width + 1] = caps
  if drafts is not None:
    ints[:rows, width + _FIXED: width + _FIXED + length] = drafts
  return StepBatch(ints, width, length)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DeviceBatch:
  """``unpack_batch``'s views (device arrays)."""

  page_indices: jax.Array  # i32[B, W]
  slots: jax.Array  # i32[B]
  num_draft: jax.Array  # i32[B]
  drafts: jax.Array  # i32[B, L]
  replay_source: jax.Array | None = None  # i32[B], with the column


def unpack_batch(ints: jax.Array, length: int, replay_source: bool = False) -> DeviceBatch:
  """Inverse of ``build_batch`` inside a jitted step (``length``, ``replay_source``:
  whether the batch has the source column, static)."""
  width = ints.shape[1] - _FIXED - length - replay_source
  return DeviceBatch(page_indices=ints[:, :width], slots=ints[:, width],
                     num_draft=ints[:, width + 1],
                     drafts=ints[:, width + _FIXED: width + _FIXED + length],
                     replay_source=ints[:, -1] if replay_source else None)
