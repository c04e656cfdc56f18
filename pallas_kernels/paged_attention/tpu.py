"""Paged attention as a **Mosaic TPU** kernel (``jax.experimental.pallas.tpu``).

Implementation name ``"pallas_tpu"``. Checked on CPU two ways (no TPU is lent to this
project): its semantics in Pallas' TPU interpreter, and its lowering to a Mosaic custom
call with ``jax.export(..., platforms=["tpu"])`` under an abstract TPU mesh (see
``tests/pallas_kernels/test_paged_attention.py``). Lowering is not Mosaic's final
compile; the kernel has not run on a TPU.

Grid ``(B, blocks)`` with the page table and lengths scalar-prefetched into SMEM. A KV
block is ``pages_per_block`` pages, each its own pipelined BlockSpec whose index map
reads the page table (``[page_size, 2K, H]``, all KV heads of the page; one DMA per
page). Block steps outside a row's causal / window range keep the previous block index,
so Pallas issues no DMA for them, and skip their compute. Inside a step each page is
flattened to ``[page_size * 2K, H]`` and K / V of head ``k`` are strided row loads
(rows ``2k + i * 2K`` and ``2k + 1 + i * 2K``; for bf16 the K/V pair shares one 32-bit
word and is split by bit shifts, as JAX's ragged paged attention does).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.paged_attention import common
from pallas_kernels.paged_attention.tuning import BlockSizes, default_block_sizes

try:
  from jax.experimental.pallas import tpu as pltpu
except ImportError:  # pragma: no cover - depends on the jaxlib build
  pltpu = None

__all__ = ["paged_attention_tpu"]

_LANES = 128


def _block_range(kv_len, q_len, block_kv: int, sliding_window: int | None):
  """``[first, last)`` KV blocks some query of the row may see (empty if ``q_len == 0``)."""
  start = kv_len - q_len
  lo = 0 if sliding_window is None else jnp.maximum(start - sliding_window + 1, 0)
  first = lo // block_kv
  last = jnp.where(q_len > 0, (kv_len + block_kv - 1) // block_kv, first)
  return first, last


def _load_kv(page_ref, kh: int, num_kv_heads: int):
  """Keys and values ``[page_size, H]`` of KV head ``kh`` from one page block."""
  page_size, two_k, head_dim = page_ref.shape
  flat = page_ref.reshape(page_size * two_k, head_dim)  # row i * 2K + c: slot i, head c
  if page_ref.dtype == jnp.bfloat16:
    # Packed rows 2w, 2w+1 share 32-bit word row w: K (even) low half, V (odd) high half.
    w = flat.bitcast(jnp.uint32)[kh::num_kv_heads, :]
    k = pltpu.bitcast(w << 16, jnp.float32).astype(jnp.bfloat16)
    v = pltpu.bitcast(w & jnp.uint32(0xFFFF0000), jnp.float32).astype(jnp.bfloat16)
    return k, v
  return flat[2 * kh::two_k, :], flat[2 * kh + 1::two_k, :]


def _kernel(
    kv_lens_ref, q_lens_ref, pages_ref, q_ref, *rest,
    num_kv_heads: int, group: int, page_size: int, pages_per_block: int, padded_pages: int,
    sm_scale: float, sliding_window: int | None, has_tree: bool, num_steps: int,
):
  page_refs = rest[:pages_per_block]
  rest = rest[pages_per_block:]
  if has_tree:
    bits_ref, o_ref, m_ref, l_ref, acc_ref = rest
  else:
    o_ref, m_ref, l_ref, acc_ref = rest
  rows, head_dim = q_ref.shape[1:]
  block_kv = pages_per_block * page_size
  b = pl.program_id(0)
  i = pl.program_id(1)
  kv_len = kv_lens_ref[b]
  q_len = q_lens_ref[b]
  start = kv_len - q_len
  first, last = _block_range(kv_len, q_len, block_kv, sliding_window)
  block = first + i

  @pl.when(i == 0)
  def _init():
    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  @pl.when(block < last)
  def _compute():
    row = lax.broadcasted_iota(jnp.int32, (rows, page_size), 0)
    col = lax.broadcasted_iota(jnp.int32, (rows, page_size), 1)
    token = lax.div(row, jnp.int32(group))
    q_pos = start + token
    row_ok = token < q_len
    if has_tree:
      bits = jnp.broadcast_to(bits_ref[...], (rows, page_size))
    for j in range(pages_per_block):
      page = pages_ref[b * padded_pages + block * pages_per_block + j]
      key = (block * pages_per_block + j) * page_size + col
      mask = row_ok & (key <= q_pos) & (key < kv_len) & (page >= 0)
      if sliding_window is not None:
        mask &= key > q_pos - sliding_window
      if has_tree:
        rel = key - start  # index of the key among the step's tokens
        bit = lax.shift_right_logical(bits, jnp.clip(rel, 0, common.MAX_TREE_TOKENS - 1)) & 1
        mask &= (rel < 0) | (bit != 0)
      v_ok = (lax.broadcasted_iota(jnp.int32, (page_size, head_dim), 0)
              + (block * pages_per_block + j) * page_size < kv_len) & (page >= 0)
      for kh in range(num_kv_heads):
        k, v = _load_kv(page_refs[j], kh, num_kv_heads)
        v = jnp.where(v_ok, v, jnp.zeros_like(v))  # stale slots may hold NaN
        s = lax.dot_general(
            q_ref[kh], k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
        ) * sm_scale  # [rows, page_size]
        s = jnp.where(mask, s, -jnp.inf)
        m_prev = m_ref[kh]  # [rows, 128], every lane equal
        l_prev = l_ref[kh]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp(s - m_safe[:, :1])
        alpha = jnp.exp(m_prev - m_safe)
        l_ref[kh] = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
        m_ref[kh] = m_new
        pv = lax.dot_general(
            p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32,
        )
        acc_ref[kh] = acc_ref[kh] * alpha[:, :1] + pv

  @pl.when(i == num_steps - 1)
  def _finish():
    for kh in range(num_kv_heads):
      l = l_ref[kh][:, :1]
      o_ref[kh] = (acc_ref[kh] / jnp.where(l > 0, l, 1.0)).astype(o_ref.dtype)


@functools.partial(
    jax.jit, static_argnames=("sm_scale", "sliding_window", "block_sizes", "interpret")
)
def _call(q, kv_pages, page_indices, kv_lens, q_lens, tree_mask, *, sm_scale, sliding_window,
          block_sizes: BlockSizes, interpret: bool):
  batch, num_tokens, num_heads, head_dim = q.shape
  _, page_size, two_k, _ = kv_pages.shape
  num_kv_heads = two_k // 2
  group = num_heads // num_kv_heads
  sublanes = 16 if q.dtype == jnp.bfloat16 else 8
  rows = -(-num_tokens * group // sublanes) * sublanes
  ppb = block_sizes.pages_per_block
  block_kv = ppb * page_size
  pages_per_seq = page_indices.shape[1]
  num_steps = -(-pages_per_seq // ppb)
  padded_pages = num_steps * ppb
  page_indices = jnp.pad(
      page_indices.astype(jnp.int32), ((0, 0), (0, padded_pages - pages_per_seq)),
      constant_values=-1,
  ).reshape(-1)  # 1D: SMEM pads 2D arrays badly
  has_tree = tree_mask is not None

  def page_map(j):
    def index_map(b, i, kv_lens_ref, q_lens_ref, pages_ref):
      first, last = _block_range(kv_lens_ref[b], q_lens_ref[b], block_kv, sliding_window)
      # Steps past the row's range repeat the last block index: no new DMA is issued.
      block = jnp.clip(jnp.minimum(first + i, last - 1), 0, num_steps - 1)
      return jnp.maximum(pages_ref[b * padded_pages + block * ppb + j], 0), 0, 0, 0
    return index_map

  in_specs = [pl.BlockSpec((None, num_kv_heads, rows, head_dim), lambda b, i, *_: (b, 0, 0, 0))]
  in_specs += [pl.BlockSpec((None, page_size, two_k, head_dim), page_map(j)) for j in range(ppb)]
  operands = [common.to_row_tiles(q, num_kv_heads, rows)] + [kv_pages] * ppb
  if has_tree:
    operands.append(common.row_tree_bits(tree_mask, group, rows)[:, :, None])
    in_specs.append(pl.BlockSpec((None, rows, 1), lambda b, i, *_: (b, 0, 0)))
  kernel = functools.partial(
      _kernel, num_kv_heads=num_kv_heads, group=group, page_size=page_size,
      pages_per_block=ppb, padded_pages=padded_pages, sm_scale=sm_scale,
      sliding_window=sliding_window, has_tree=has_tree, num_steps=num_steps,
  )
  out = pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=3,
          grid=(batch, num_steps),
          in_specs=in_specs,
          out_specs=pl.BlockSpec((None, num_kv_heads, rows, head_dim),
                                 lambda b, i, *_: (b, 0, 0, 0)),
          scratch_shapes=[
              pltpu.VMEM((num_kv_heads, rows, _LANES), jnp.float32),  # running max
              pltpu.VMEM((num_kv_heads, rows, _LANES), jnp.float32),  # running denominator
              pltpu.VMEM((num_kv_heads, rows, head_dim), jnp.float32),  # accumulator
          ],
      ),
      out_shape=jax.ShapeDtypeStruct((batch, num_kv_heads, rows, head_dim), q.dtype),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
      interpret=interpret,
      name=f"paged_attention_tpu_r{rows}_bkv{block_kv}",
  )(kv_lens.astype(jnp.int32), q_lens.astype(jnp.int32), page_indices, *operands)
  return common.from_row_tiles(out, num_tokens, num_heads)


def paged_attention_tpu(
    q: jax.Array,
    kv_pages: jax.Array,
    page_indices: jax.Array,
    kv_lens: jax.Array,
    q_lens: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    tree_mask: jax.Array | None = None,
    positions: jax.Array | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
) -> jax.Array:
  """Mosaic TPU paged attention; same contract as ``paged_attention_reference``.

  Pages marked -1 and slots at or past ``kv_lens`` are masked (never contribute).

  Raises:
    ValueError: malformed inputs.
    NotImplementedError: not on a TPU (and not ``interpret``); dtype not f32/bf16 or
      q and kv dtypes differ; ``2K`` heads not fully tileable (as in JAX's ragged paged
      attention); page_size not a multiple of the sublane tile; tree mask with T > 31;
      explicit ``positions`` with a sliding window; a forced ``block_sizes.num_splits``
      > 1 (split-KV is GPU-only; ``None`` means one split here).
  """
  common.check_inputs(q, kv_pages, page_indices, kv_lens, q_lens, sliding_window, tree_mask,
                      positions)
  common.check_slot_window("pallas_tpu", sliding_window, positions)
  if pltpu is None:
    raise NotImplementedError("jax.experimental.pallas.tpu is not importable")
  if not interpret and jax.default_backend() != "tpu":
    raise NotImplementedError(f"pallas_tpu needs a TPU; backend={jax.default_backend()}")
  num_tokens = q.shape[1]
  page_size, two_k = kv_pages.shape[1:3]
  if q.dtype not in (jnp.float32, jnp.bfloat16) or kv_pages.dtype != q.dtype:
    raise NotImplementedError(f"pallas_tpu runs f32/bf16 only; got {q.dtype=}, {kv_pages.dtype=}")
  packing = 2 if q.dtype == jnp.bfloat16 else 1
  heads = two_k // packing
  if two_k % packing or not (heads in (1, 2, 4, 8) or heads % 8 == 0):
    raise NotImplementedError(f"pallas_tpu cannot tile 2K={two_k} combined heads for {q.dtype}")
  if page_size % (8 * packing):
    raise NotImplementedError(f"pallas_tpu needs page_size % {8 * packing} == 0; got {page_size}")
  if tree_mask is not None and num_tokens > common.MAX_TREE_TOKENS:
    raise NotImplementedError(f"tree masks need T <= {common.MAX_TREE_TOKENS}; got {num_tokens}")
  if block_sizes is None:
    block_sizes = default_block_sizes("pallas_tpu", page_size)
  if block_sizes.num_splits not in (None, 1):
    raise NotImplementedError(f"pallas_tpu does not split KV; got {block_sizes.num_splits=}")
  return _call(
      q, kv_pages, page_indices, kv_lens, q_lens, tree_mask,
      sm_scale=float(sm_scale),
      sliding_window=None if sliding_window is None else int(sliding_window),
      block_sizes=block_sizes, interpret=bool(interpret),
  )
