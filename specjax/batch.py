"""Host step builder: the rows of one engine step -> one packed ``i32`` and one ``f32``
array (one host-to-device copy each), and their unpacking inside the jitted step.

Column layout of ``ints i32[B, C]`` for a page-table width ``W`` and draft width ``L``
(worked example: W = 4, L = 2 gives C = 4 + 9 + 2 = 15; a row with pages [7, 2], 18
committed tokens and one draft 42 is ``[7, 2, -1, -1, 20, 2, 18, t, -1, 0, k0, k1, 1, 0,
42]`` when its pending token ``t`` comes from the host):

  ``[0, W)``      page_indices (-1 padded)
  ``W + 0``       kv_lens after the step's writes (0 for padding rows)
  ``W + 1``       q_lens = 1 + drafts (0 for padding rows)
  ``W + 2``       positions: absolute position of the token the first logits row predicts
  ``W + 3``       pending token from the host
  ``W + 4``       prev_row: row of the previous step whose last token is this row's
                  pending token (-1: use the host's)
  ``W + 5``       top_k
  ``W + 6, 7``    the request key (``u32[2]`` bit-cast)
  ``W + 8``       num_draft
  ``W + 9``       jnp_rows: 1 if the row takes the jnp sampler's result ("fused+jnp")
  ``W + 10 ..``   L host draft tokens (-1 padded), unused when drafts come from the device

``floats f32[B, 2]``: temperature, top_p.

``AttentionMetadata`` lives next to the kernel it describes
(``pallas_kernels.paged_attention.metadata``) and is re-exported here.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.paged_attention.metadata import AttentionMetadata

__all__ = ["AttentionMetadata", "DeviceBatch", "StepBatch", "build_batch", "unpack_batch"]

_FIXED = 10  # columns after the page table, before the drafts


@dataclasses.dataclass
class StepBatch:
  """The numpy arrays of one step (host side).

  Attributes:
    ints: ``i32[B, W + 10 + L]`` (module docstring).
    floats: ``f32[B, 2]``.
    width: W, pages per row in this step's table.
    length: L.
  """

  ints: np.ndarray
  floats: np.ndarray
  width: int
  length: int


def build_batch(*, batch: int, width: int, length: int, page_tables: list[list[int]],
                kv_lens, q_lens, positions, pending, prev_row, top_k, keys, num_draft,
                temperature, top_p, jnp_rows=None, drafts=None) -> StepBatch:
  """Packs per-row lists/arrays (``len(page_tables)`` real rows) into a ``StepBatch``.

  Raises:
    ValueError: a row has more pages than ``width`` or more drafts than ``length``.
  """
  rows = len(page_tables)
  if rows > batch:
    raise ValueError(f"{rows=} real rows must be <= batch={batch}")
  ints = np.full((batch, width + _FIXED + length), -1, np.int32)
  ints[:, width: width + _FIXED] = 0
  ints[:, width + 4] = -1
  for i, pages in enumerate(page_tables):
    if len(pages) > width:
      raise ValueError(f"row {i} has {len(pages)} pages; the step's table holds {width=}")
    ints[i, : len(pages)] = pages
  cols = (kv_lens, q_lens, positions, pending, prev_row, top_k)
  for c, values in enumerate(cols):
    ints[:rows, width + c] = values
  ints[:rows, width + 6: width + 8] = np.asarray(keys, np.uint32).reshape(rows, 2).view(np.int32)
  nd = np.asarray(num_draft, np.int32)
  if rows and nd.max(initial=0) > length:
    raise ValueError(f"num_draft={nd.tolist()} must be <= the step's draft width {length}")
  ints[:rows, width + 8] = nd
  if jnp_rows is not None:
    ints[:rows, width + 9] = np.asarray(jnp_rows, np.int32)
  if drafts is not None:
    ints[:rows, width + _FIXED:] = drafts
  floats = np.zeros((batch, 2), np.float32)
  floats[:, 1] = 1.0
  floats[:rows, 0] = temperature
  floats[:rows, 1] = top_p
  return StepBatch(ints, floats, width, length)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DeviceBatch:
  """``unpack_batch``'s views (device arrays, one per column group)."""

  page_indices: jax.Array  # i32[B, W]
  kv_lens: jax.Array
  q_lens: jax.Array
  positions: jax.Array
  pending: jax.Array
  prev_row: jax.Array
  top_k: jax.Array
  keys: jax.Array  # u32[B, 2]
  num_draft: jax.Array
  jnp_rows: jax.Array
  drafts: jax.Array  # i32[B, L]
  temperature: jax.Array  # f32[B]
  top_p: jax.Array


def unpack_batch(ints: jax.Array, floats: jax.Array, length: int) -> DeviceBatch:
  """Inverse of ``build_batch`` inside a jitted step (``length`` static)."""
  width = ints.shape[1] - _FIXED - length
  col = lambda c: ints[:, width + c]
  keys = jax.lax.bitcast_convert_type(ints[:, width + 6: width + 8], jnp.uint32)
  return DeviceBatch(
      page_indices=ints[:, :width], kv_lens=col(0), q_lens=col(1), positions=col(2),
      pending=col(3), prev_row=col(4), top_k=col(5), keys=keys, num_draft=col(8),
      jnp_rows=col(9), drafts=ints[:, width + _FIXED:], temperature=floats[:, 0],
      top_p=floats[:, 1])
