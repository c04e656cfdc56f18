"""Paged attention as a **Mosaic GPU** kernel (``jax.experimental.pallas.mosaic_gpu``), Hopper.

Implementation name ``"pallas_gpu"``. Decode (``T = 1``), chain verify (``T = L + 1``)
and tree verify, GQA, optional sliding window; bf16 / f16 only (its matmuls run on the
tensor cores through ``wgmma``; f32 would silently become tf32, so f32 raises
``NotImplementedError`` and the dispatcher falls through).

One CTA (a single warpgroup, ``plgpu.kernel`` grid ``(B, K)``) owns the ``rows`` (64 or
128) query rows of one sequence and KV head: row ``r = t * G + g`` (see
``common.to_row_tiles``). The KV is walked in blocks of ``pages_per_block`` pages.
Each page's key slab ``kv_pages[page, :, 2k, :]`` and value slab
``kv_pages[page, :, 2k + 1, :]`` (strided in HBM) is one TMA copy into a swizzled shared
memory tile, ``num_stages`` blocks in flight, one barrier per page copy. Per block:
``S = Q K^T`` (wgmma, f32 accumulator), mask, online softmax in registers, ``O += P V``
(wgmma, P from registers).

Split-KV (flash-decoding, Dao et al. 2023; see ``split.py``): when ``num_splits > 1``
(``BlockSizes.splits``: by default only when ``B * K`` CTAs are fewer than
``target_ctas``) the grid is ``(B, K, S)``; CTA ``(b, k, s)`` walks its share of the
blocks (``split.split_range``) and writes its normalized partial output (f32, only the
first ``ceil(T * G / 8) * 8`` rows) and per-row log-sum-exp through one extra f32 shared
memory tile; ``split.combine`` (jnp, one XLA fusion) merges them. Decode, chain verify,
tree masks and sliding windows all split (masks depend on absolute key positions only).
With ``num_splits == 1`` the kernel is the unsplit one (grid ``(B, K)``, bf16/f16 output).

Dynamic precondition (the engine's page tables satisfy it): every page holding a
position ``< kv_lens[b]`` is mapped (``>= 0``). Unmapped pages past that are read as page
0 and masked; slots at or past ``kv_lens[b]`` are zeroed in shared memory before the
``P V`` product, so stale NaNs there never leak. The reference also masks -1 pages *inside*
the context; this kernel does not.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.paged_attention import common, split
from pallas_kernels.paged_attention.tuning import BlockSizes, default_block_sizes

try:  # Mosaic GPU's Python side; keep the package importable without it.
  from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover - depends on the jaxlib build
  plgpu = None

__all__ = ["fitting_block_sizes", "paged_attention_mosaic_gpu", "smem_bytes"]

_SMEM_LIMIT = 227 * 1024  # H100/H200 opt-in shared memory per block
_SMEM_ALIGNMENT = 1024  # Mosaic GPU aligns every shared memory buffer to this
# Mosaic GPU's CompilerParams.reduction_scratch_bytes default (128 * 4 * 4), reserved
# whenever a kernel reduces (JAX 0.10.2 and 0.11.2).
_REDUCTION_SCRATCH = 2048
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)


def _interpret_params():
  """``InterpretGPUParams`` (public in JAX 0.11, private module in 0.10)."""
  params = getattr(plgpu, "InterpretGPUParams", None)
  if params is None:
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams as params
  return params()


def smem_bytes(rows: int, head_dim: int, block_kv: int, num_stages: int, itemsize: int,
               num_splits: int = 1, pages_per_block: int = 1) -> int:
  """Shared memory of one CTA in bytes, as Mosaic GPU allocates it: the Q/O tile,
  ``num_stages`` K and V blocks and (split) an f32 partial-output tile and an f32
  log-sum-exp row, each rounded up to ``_SMEM_ALIGNMENT``; the lowering's reduction
  scratch (``_REDUCTION_SCRATCH``: the kernel's row max and sum are reductions); and
  8 bytes per barrier (one for Q, one per page copy of each K and V stage).
  Measured: rows 128, head_dim 128, 128-key blocks of 8 pages, 2 stages, bf16, split:
  Mosaic GPU reported ``smem_bytes=232712`` (H100 and H200), this returns the same."""
  def aligned(n):
    return -(-n // _SMEM_ALIGNMENT) * _SMEM_ALIGNMENT
  tiles = aligned(rows * head_dim * itemsize)
  tiles += 2 * aligned(num_stages * block_kv * head_dim * itemsize)
  if num_splits > 1:
    tiles += aligned(rows * head_dim * 4) + aligned(rows * 4)
  barriers = 1 + 2 * num_stages * pages_per_block
  return tiles + _REDUCTION_SCRATCH + 8 * barriers


def fitting_block_sizes(block_sizes: BlockSizes, *, rows: int, head_dim: int, page_size: int,
                        itemsize: int, batch: int, num_kv_heads: int,
                        num_pages: int) -> tuple[BlockSizes, int] | None:
  """``(block sizes, num_splits)``: ``block_sizes``, or the same with ``pages_per_block``
  halved until the CTA's ``smem_bytes`` fits ``_SMEM_LIMIT`` (down to 64 keys per block),
  with the splits ``BlockSizes.splits`` picks for it over ``num_pages`` pages; None if
  none fits. Example: a 17-token verify of a GQA-4 model (128 query rows) at batch 1
  over 64 pages (8 KV heads: split) with the default 128-key blocks needs 232,712 B >
  232,448 B; with 64-key blocks 167,048 B."""
  ppb = block_sizes.pages_per_block
  while ppb * page_size >= 64:
    sizes = dataclasses.replace(block_sizes, pages_per_block=ppb)
    splits = sizes.splits(batch=batch, num_kv_heads=num_kv_heads,
                          max_blocks=-(-num_pages // ppb))
    if smem_bytes(rows, head_dim, ppb * page_size, sizes.num_stages, itemsize, splits,
                  ppb) <= _SMEM_LIMIT:
      return sizes, splits
    ppb //= 2
  return None


def _kernel(
    kv_lens_ref, q_lens_ref, pages_ref, q_ref, kv_ref, *rest,
    group: int, num_tokens: int, page_size: int, pages_per_block: int, num_stages: int,
    sm_scale: float, sliding_window: int | None, has_tree: bool, interpret: bool,
    num_splits: int, split_rows: int,
):
  refs = list(rest)
  bits_ref = refs.pop(0) if has_tree else None
  o_ref = refs.pop(0)
  lse_ref = refs.pop(0) if num_splits > 1 else None
  q_smem, k_smem, v_smem = refs[:3]
  o32_smem, lse_smem = refs[3:5] if num_splits > 1 else (None, None)
  q_bar, k_bars, v_bars = refs[-3:]
  rows, head_dim = q_smem.shape
  block_kv = pages_per_block * page_size
  dtype = q_smem.dtype
  b = lax.axis_index("b")
  kh = lax.axis_index("k")
  kv_len = kv_lens_ref[b]
  q_len = q_lens_ref[b]
  start = kv_len - q_len  # position of the step's first query token

  # Blocks [first, first + num_blocks) intersect some query's visible range.
  lo = jnp.int32(0) if sliding_window is None else jnp.maximum(start - sliding_window + 1, 0)
  first = lax.div(lo, jnp.int32(block_kv))
  last = jnp.where(q_len > 0, lax.div(kv_len + (block_kv - 1), jnp.int32(block_kv)), first)
  num_blocks = jnp.maximum(last - first, 0)
  if num_splits > 1:
    first, num_blocks = split.split_range(lax.axis_index("s"), num_splits, first, num_blocks)

  total_blocks = pages_ref.shape[1] // pages_per_block

  def load_pages(block):
    # Worked example: pages_per_block 4, block 3 covers logical pages 12..15. Unmapped
    # (-1) pages are read as page 0 and masked. The block is clamped so that a look-ahead
    # load past the table stays in bounds (its pages are then never used).
    block = jnp.minimum(block, total_blocks - 1)
    return tuple(jnp.maximum(pages_ref[b, block * pages_per_block + j], 0)
                 for j in range(pages_per_block))

  def issue(pages, slot):
    for j, page in enumerate(pages):
      rows_j = pl.ds(j * page_size, page_size)
      plgpu.copy_gmem_to_smem(
          kv_ref.at[page, :, 2 * kh, :], k_smem.at[slot, rows_j],
          k_bars.at[slot * pages_per_block + j],
      )
      plgpu.copy_gmem_to_smem(
          kv_ref.at[page, :, 2 * kh + 1, :], v_smem.at[slot, rows_j],
          v_bars.at[slot * pages_per_block + j],
      )

  plgpu.copy_gmem_to_smem(q_ref.at[b, kh], q_smem, q_bar.at[0])
  for s in range(num_stages - 1):
    @pl.when(s < num_blocks)
    def _prologue():
      issue(load_pages(first + s), s)

  # Register layouts are annotations for the Mosaic GPU compiler; its CPU interpreter
  # has no rules for them, so they are skipped there (values are identical).
  wgmma_layout = plgpu.Layout.WGMMA
  row_layout = plgpu.Layout.WGMMA.reduce(1)

  def iota(shape, dim):
    if interpret:
      return lax.broadcasted_iota(jnp.int32, shape, dim)
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=wgmma_layout)

  def with_layout(x, layout):
    return x if interpret else plgpu.layout_cast(x, layout)

  row = iota((rows, block_kv), 0)
  col = iota((rows, block_kv), 1)
  token = lax.div(row, jnp.int32(group))
  row_ok = token < q_len
  q_pos = token + start
  if has_tree:
    # Row r's bit word is bits[b, r // G]; built once by a select chain over T scalars.
    bits = jnp.zeros_like(row)
    for t in range(num_tokens):
      bits = jnp.where(token == t, bits_ref[b, t], bits)
  v_row = iota((block_kv, head_dim), 0)

  plgpu.barrier_wait(q_bar.at[0])

  def body(i, carry):
    acc, m_i, l_i, ahead_pages = carry
    slot = lax.rem(i, jnp.int32(num_stages))
    block = first + i
    nxt = i + (num_stages - 1)

    @pl.when(nxt < num_blocks)
    def _prefetch():
      issue(ahead_pages, lax.rem(nxt, jnp.int32(num_stages)))

    # Page-table entries for the next step's prefetch are loaded one step early: a
    # global scalar load costs ~1 us of latency, which would otherwise sit on every
    # step's critical path in front of the TMA issue.
    ahead_pages = load_pages(first + nxt + 1)

    for j in range(pages_per_block):
      plgpu.barrier_wait(k_bars.at[slot * pages_per_block + j])

    if interpret:  # JAX 0.10's interpreter has no transposed-B / register-A wgmma
      s = lax.dot_general(q_smem[...], k_smem.at[slot][...], (((1,), (1,)), ((), ())),
                          preferred_element_type=jnp.float32)
    else:
      def compute_qk(acc_ref):
        plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
        return acc_ref[...]

      s = pl.run_scoped(compute_qk, plgpu.ACC((rows, block_kv), jnp.float32))
    key = col + block * block_kv
    mask = row_ok & (key <= q_pos)
    if sliding_window is not None:
      mask &= key > q_pos - sliding_window
    if has_tree:
      rel = key - start  # index of the key among the step's tokens
      bit = lax.shift_right_logical(bits, jnp.clip(rel, 0, common.MAX_TREE_TOKENS - 1)) & 1
      mask &= (rel < 0) | (bit != 0)
    s = jnp.where(mask, s * (sm_scale * _LOG2E), -jnp.inf)  # base-2 logits
    m_new = jnp.maximum(m_i, s.max(axis=1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows with nothing visible yet
    alpha = jnp.exp2(m_i - m_safe)
    p = jnp.exp2(s - lax.broadcast_in_dim(m_safe, s.shape, [0]))
    l_i = l_i * alpha + p.sum(axis=1)
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

    for j in range(pages_per_block):
      plgpu.barrier_wait(v_bars.at[slot * pages_per_block + j])

    @pl.when(block * block_kv + block_kv > kv_len)
    def _zero_stale_values():
      # Slots at or past kv_len (stale, maybe NaN) must not meet P = 0 in the product.
      v_tile = v_smem.at[slot]
      v = v_tile[...]  # tiled + swizzled smem loads in the WGMMA layout
      v_tile[...] = jnp.where(v_row + block * block_kv < kv_len, v, jnp.zeros_like(v))
      plgpu.commit_smem()

    if interpret:
      pv = jnp.dot(p.astype(dtype), v_smem.at[slot][...], preferred_element_type=jnp.float32)
    else:
      def compute_pv(acc_ref):
        plgpu.wgmma(acc_ref, p.astype(dtype), v_smem.at[slot])
        return acc_ref[...]

      pv = pl.run_scoped(compute_pv, plgpu.ACC((rows, head_dim), jnp.float32))
    return acc + pv, m_new, l_i, ahead_pages

  acc = with_layout(jnp.zeros((rows, head_dim), jnp.float32), wgmma_layout)
  m_i = with_layout(jnp.full((rows,), -jnp.inf, jnp.float32), row_layout)
  l_i = with_layout(jnp.zeros((rows,), jnp.float32), row_layout)
  ahead_pages = load_pages(first + num_stages - 1)
  acc, m_i, l_i, _ = lax.fori_loop(0, num_blocks, body, (acc, m_i, l_i, ahead_pages))
  seen = l_i > 0
  l_i = jnp.where(seen, l_i, 1.0)
  acc = acc / lax.broadcast_in_dim(l_i, acc.shape, [0])
  if num_splits > 1:
    # Natural-log LSE from the base-2 running max; -inf where this split saw nothing.
    o32_smem[...] = acc
    lse_smem[...] = jnp.where(seen, m_i * _LN2 + jnp.log(l_i), -jnp.inf)
    plgpu.commit_smem()
    s_idx = lax.axis_index("s")
    head = (lambda ref: ref) if split_rows == rows else (lambda ref: ref.at[pl.ds(0, split_rows)])
    plgpu.copy_smem_to_gmem(head(o32_smem), o_ref.at[b, kh, s_idx])
    plgpu.copy_smem_to_gmem(head(lse_smem), lse_ref.at[b, kh, s_idx])
    plgpu.wait_smem_to_gmem(0)
    return
  q_smem[...] = acc.astype(dtype)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(q_smem, o_ref.at[b, kh])
  plgpu.wait_smem_to_gmem(0)


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "sliding_window", "block_sizes", "interpret", "num_splits"),
)
def _call(q, kv_pages, page_indices, kv_lens, q_lens, tree_mask, *, sm_scale, sliding_window,
          block_sizes: BlockSizes, interpret: bool, num_splits: int = 1):
  batch, num_tokens, num_heads, head_dim = q.shape
  _, page_size, two_k, _ = kv_pages.shape
  num_kv_heads = two_k // 2
  group = num_heads // num_kv_heads
  rows = 64 if num_tokens * group <= 64 else 128
  ppb = block_sizes.pages_per_block
  block_kv = ppb * page_size
  stages = block_sizes.num_stages
  pages_per_seq = page_indices.shape[1]
  padded_pages = -(-pages_per_seq // ppb) * ppb
  page_indices = jnp.pad(
      page_indices.astype(jnp.int32), ((0, 0), (0, padded_pages - pages_per_seq)),
      constant_values=-1,
  )
  operands = [kv_lens.astype(jnp.int32), q_lens.astype(jnp.int32), page_indices,
              common.to_row_tiles(q, num_kv_heads, rows), kv_pages]
  has_tree = tree_mask is not None
  if has_tree:
    operands.append(common.tree_bits(tree_mask))
  swizzle = 128
  transforms = (plgpu.TilingTransform((8, swizzle // q.dtype.itemsize)),
                plgpu.SwizzleTransform(swizzle))
  split_rows = -(-(num_tokens * group) // 8) * 8  # real rows, 8-row (tile) aligned
  kernel = functools.partial(
      _kernel, group=group, num_tokens=num_tokens, page_size=page_size, pages_per_block=ppb,
      num_stages=stages, sm_scale=sm_scale, sliding_window=sliding_window, has_tree=has_tree,
      interpret=interpret, num_splits=num_splits, split_rows=split_rows,
  )
  scratch = [
      plgpu.SMEM((rows, head_dim), q.dtype, transforms=transforms),
      plgpu.SMEM((stages, block_kv, head_dim), q.dtype, transforms=transforms),
      plgpu.SMEM((stages, block_kv, head_dim), q.dtype, transforms=transforms),
  ]
  if num_splits > 1:
    f32_transforms = (plgpu.TilingTransform((8, swizzle // 4)), plgpu.SwizzleTransform(swizzle))
    scratch += [plgpu.SMEM((rows, head_dim), jnp.float32, transforms=f32_transforms),
                plgpu.SMEM((rows,), jnp.float32)]
    out_type = [
        jax.ShapeDtypeStruct((batch, num_kv_heads, num_splits, split_rows, head_dim),
                             jnp.float32),
        jax.ShapeDtypeStruct((batch, num_kv_heads, num_splits, split_rows), jnp.float32),
    ]
    grid, grid_names = (batch, num_kv_heads, num_splits), ("b", "k", "s")
  else:
    out_type = jax.ShapeDtypeStruct((batch, num_kv_heads, rows, head_dim), q.dtype)
    grid, grid_names = (batch, num_kv_heads), ("b", "k")
  scratch += [
      plgpu.Barrier(num_barriers=1),
      plgpu.Barrier(num_barriers=stages * ppb),
      plgpu.Barrier(num_barriers=stages * ppb),
  ]
  out = plgpu.kernel(
      kernel,
      out_type=out_type,
      scratch_types=scratch,
      grid=grid,
      grid_names=grid_names,
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=_interpret_params() if interpret else None,
      kernel_name=f"paged_attention_mosaic_gpu_r{rows}_bkv{block_kv}_s{stages}_k{num_splits}",
  )(*operands)
  if num_splits > 1:
    out = split.combine(*out).astype(q.dtype)
  return common.from_row_tiles(out, num_tokens, num_heads)


def paged_attention_mosaic_gpu(
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
  """Mosaic GPU paged attention; same contract as ``paged_attention_reference``.

  ``interpret=True`` runs Mosaic GPU's interpreter on CPU (slow; small shapes).

  Raises:
    ValueError: malformed inputs.
    NotImplementedError: not a Hopper-or-newer GPU (and not ``interpret``); dtype not
      bf16/f16; head_dim not a multiple of 64; page_size not a multiple of 8; block not
      a multiple of 64 keys; more than 128 query rows (T * G) per KV head; tree mask
      with T > 31; shared memory over budget (``smem_bytes``; explicit ``block_sizes``
      only: the defaults take smaller KV blocks where 128 keys do not fit,
      ``fitting_block_sizes``); explicit ``positions`` with a sliding window.
  """
  common.check_inputs(q, kv_pages, page_indices, kv_lens, q_lens, sliding_window, tree_mask,
                      positions)
  common.check_slot_window("pallas_gpu", sliding_window, positions)
  if plgpu is None:
    raise NotImplementedError("jax.experimental.pallas.mosaic_gpu is not importable")
  if not interpret:
    if jax.default_backend() != "gpu":
      raise NotImplementedError(f"pallas_gpu needs a GPU; backend={jax.default_backend()}")
    capability = getattr(jax.devices()[0], "compute_capability", "0")
    if float(capability) < 9.0:
      raise NotImplementedError(f"pallas_gpu needs sm_90+ (wgmma, TMA); got {capability=}")
  _, num_tokens, num_heads, head_dim = q.shape
  page_size = kv_pages.shape[1]
  group = num_heads // (kv_pages.shape[2] // 2)
  if q.dtype not in (jnp.bfloat16, jnp.float16) or kv_pages.dtype != q.dtype:
    raise NotImplementedError(f"pallas_gpu runs bf16/f16 only; got {q.dtype=}, {kv_pages.dtype=}")
  if head_dim % 64:
    raise NotImplementedError(f"pallas_gpu needs head_dim % 64 == 0; got {head_dim}")
  if page_size % 8:
    raise NotImplementedError(f"pallas_gpu needs page_size % 8 == 0; got {page_size}")
  if num_tokens * group > 128:
    raise NotImplementedError(f"pallas_gpu handles <= 128 query rows; got T*G={num_tokens * group}")
  if tree_mask is not None and num_tokens > common.MAX_TREE_TOKENS:
    raise NotImplementedError(f"tree masks need T <= {common.MAX_TREE_TOKENS}; got {num_tokens}")
  default = block_sizes is None
  if default:
    block_sizes = default_block_sizes("pallas_gpu", page_size)
  block_kv = block_sizes.block_kv(page_size)
  if block_kv % 64 or block_kv > 256:
    raise NotImplementedError(f"pallas_gpu needs 64..256 keys per block (multiple of 64); {block_kv=}")
  if block_sizes.num_stages < 2:
    raise NotImplementedError(f"pallas_gpu needs num_stages >= 2; {block_sizes=}")
  rows = 64 if num_tokens * group <= 64 else 128
  shape = dict(rows=rows, head_dim=head_dim, page_size=page_size, itemsize=q.dtype.itemsize,
               batch=q.shape[0], num_kv_heads=kv_pages.shape[2] // 2,
               num_pages=page_indices.shape[1])
  # The defaults shrink the KV block where the CTA's shared memory would not fit;
  # explicit block sizes are used as given.
  fit = fitting_block_sizes(block_sizes, **shape)
  if fit is None or (not default and fit[0] != block_sizes):
    splits = block_sizes.splits(batch=shape["batch"], num_kv_heads=shape["num_kv_heads"],
                                max_blocks=-(-shape["num_pages"] // block_sizes.pages_per_block))
    need = smem_bytes(rows, head_dim, block_kv, block_sizes.num_stages, q.dtype.itemsize,
                      splits, block_sizes.pages_per_block)
    raise NotImplementedError(f"pallas_gpu needs {need} B of shared memory > {_SMEM_LIMIT} "
                              f"with {block_sizes=}")
  block_sizes, num_splits = fit
  return _call(
      q, kv_pages, page_indices, kv_lens, q_lens, tree_mask,
      sm_scale=float(sm_scale),
      sliding_window=None if sliding_window is None else int(sliding_window),
      block_sizes=block_sizes, interpret=bool(interpret), num_splits=num_splits,
  )
