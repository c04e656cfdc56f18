"""Paged attention as a plain ``pl.pallas_call`` lowered through Pallas' **Triton** backend.

Implementation name ``"pallas_triton"``. This is not Mosaic GPU: it passes
``jax.experimental.pallas.triton.CompilerParams`` so JAX lowers it to Triton IR (see
``gpu.py`` for the Mosaic GPU kernel). It runs on any CUDA GPU JAX supports and on CPU
with ``interpret=True``.

Grid ``(B, K)``: one program per sequence and KV head holds the ``rows`` query rows of
that head's group (``common.to_row_tiles``) and walks the sequence's pages in blocks of
``pages_per_block`` pages with an online softmax. Blocks wholly outside the causal /
sliding window range of the row's queries are never read.

Split-KV (flash-decoding, Dao et al. 2023; see ``split.py``): with ``num_splits > 1``
(``BlockSizes.splits``) the grid is ``(B, K, S)``; program ``(b, k, s)`` walks its share
of the blocks and writes an f32 partial output and per-row log-sum-exp, merged by
``split.combine`` (jnp). Decode, verify, tree masks and sliding windows all split.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.paged_attention import common, split
from pallas_kernels.paged_attention.tuning import BlockSizes, default_block_sizes

try:  # Absent from some jaxlib builds; the module must still import on CPU.
  from jax.experimental.pallas import triton as pltriton
except ImportError:  # pragma: no cover - depends on the jaxlib build
  pltriton = None

__all__ = ["paged_attention_triton"]

MIN_ROWS = 16  # tl.dot needs every matrix dimension >= 16


def _next_power_of_two(x: int) -> int:
  return 1 << max(0, (x - 1).bit_length())


def _kernel(
    kv_lens_ref, q_lens_ref, pages_ref, q_ref, k_ref, v_ref, *rest,
    group: int, page_size: int, pages_per_block: int, sm_scale: float,
    sliding_window: int | None, has_tree: bool, precision, num_splits: int,
):
  refs = list(rest)
  bits_ref = refs.pop(0) if has_tree else None
  o_ref = refs.pop(0)
  lse_ref = refs.pop(0) if num_splits > 1 else None
  b = pl.program_id(0)
  rows, head_dim = q_ref.shape
  block_kv = pages_per_block * page_size
  kv_len = kv_lens_ref[b]
  q_len = q_lens_ref[b]
  start = kv_len - q_len  # position of the step's first query token

  row = lax.broadcasted_iota(jnp.int32, (rows,), 0)
  token = row // group
  row_ok = token < q_len
  q_pos = start + token  # [rows]
  bits = bits_ref[...] if has_tree else None
  q = q_ref[...]

  lo = jnp.int32(0) if sliding_window is None else jnp.maximum(start - sliding_window + 1, 0)
  first_block = lo // block_kv
  last_block = jnp.where(q_len > 0, pl.cdiv(kv_len, block_kv), first_block)
  if num_splits > 1:
    first_block, count = split.split_range(
        pl.program_id(2), num_splits, first_block, jnp.maximum(last_block - first_block, 0))
    last_block = first_block + count

  def body(i, carry):
    acc, m, l = carry
    pages = pages_ref[pl.ds(i * pages_per_block, pages_per_block)]  # [pages_per_block]
    safe = jnp.maximum(pages, 0)
    k = k_ref[safe].reshape(block_kv, head_dim)
    v = v_ref[safe].reshape(block_kv, head_dim)
    key = i * block_kv + lax.broadcasted_iota(jnp.int32, (block_kv,), 0)
    page_ok = jnp.broadcast_to((pages >= 0)[:, None], (pages_per_block, page_size))
    key_ok = (key < kv_len) & page_ok.reshape(block_kv)
    v = jnp.where(key_ok[:, None], v, jnp.zeros_like(v))  # stale slots may hold NaN
    s = lax.dot_general(
        q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32, precision=precision
    ) * sm_scale  # [rows, block_kv]
    mask = row_ok[:, None] & key_ok[None, :] & (key[None, :] <= q_pos[:, None])
    if sliding_window is not None:
      mask &= key[None, :] > q_pos[:, None] - sliding_window
    if has_tree:
      rel = key[None, :] - start  # index of the key among the step's tokens
      bit = jnp.right_shift(bits[:, None], jnp.clip(rel, 0, common.MAX_TREE_TOKENS - 1)) & 1
      mask &= (rel < 0) | (bit != 0)
    s = jnp.where(mask, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows with nothing visible yet
    p = jnp.exp(s - m_safe[:, None])
    alpha = jnp.exp(m - m_safe)
    l = l * alpha + jnp.sum(p, axis=1)
    pv = lax.dot_general(
        p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
        preferred_element_type=jnp.float32, precision=precision,
    )
    return acc * alpha[:, None] + pv, m_new, l

  init = (
      jnp.zeros((rows, head_dim), jnp.float32),
      jnp.full((rows,), -jnp.inf, jnp.float32),
      jnp.zeros((rows,), jnp.float32),
  )
  acc, m, l = lax.fori_loop(first_block, last_block, body, init)
  seen = l > 0
  l = jnp.where(seen, l, 1.0)
  o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
  if num_splits > 1:
    lse_ref[...] = jnp.where(seen, m + jnp.log(l), -jnp.inf)


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "sliding_window", "block_sizes", "interpret", "num_splits"),
)
def _call(q, kv_pages, page_indices, kv_lens, q_lens, tree_mask, *, sm_scale, sliding_window,
          block_sizes: BlockSizes, interpret: bool, num_splits: int = 1):
  batch, num_tokens, num_heads, head_dim = q.shape
  num_pages, page_size, two_k, _ = kv_pages.shape
  num_kv_heads = two_k // 2
  group = num_heads // num_kv_heads
  rows = max(MIN_ROWS, _next_power_of_two(num_tokens * group))
  ppb = block_sizes.pages_per_block
  pages_per_seq = page_indices.shape[1]
  padded_pages = pl.cdiv(pages_per_seq, ppb) * ppb
  page_indices = jnp.pad(
      page_indices.astype(jnp.int32), ((0, 0), (0, padded_pages - pages_per_seq)),
      constant_values=-1,
  )
  q_tiles = common.to_row_tiles(q, num_kv_heads, rows)
  has_tree = tree_mask is not None
  operands = [kv_lens.astype(jnp.int32), q_lens.astype(jnp.int32), page_indices, q_tiles,
              kv_pages, kv_pages]
  in_specs = [
      pl.BlockSpec((batch,), lambda b, k, *_: (0,)),
      pl.BlockSpec((batch,), lambda b, k, *_: (0,)),
      pl.BlockSpec((None, padded_pages), lambda b, k, *_: (b, 0)),
      pl.BlockSpec((None, None, rows, head_dim), lambda b, k, *_: (b, k, 0, 0)),
      # Squeezed head axis: block index == element index, K at 2k and V at 2k + 1.
      pl.BlockSpec((num_pages, page_size, None, head_dim), lambda b, k, *_: (0, 0, 2 * k, 0)),
      pl.BlockSpec((num_pages, page_size, None, head_dim), lambda b, k, *_: (0, 0, 2 * k + 1, 0)),
  ]
  if has_tree:
    operands.append(common.row_tree_bits(tree_mask, group, rows))
    in_specs.append(pl.BlockSpec((None, rows), lambda b, k, *_: (b, 0)))
  precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else lax.Precision.DEFAULT
  kernel = functools.partial(
      _kernel, group=group, page_size=page_size, pages_per_block=ppb, sm_scale=sm_scale,
      sliding_window=sliding_window, has_tree=has_tree, precision=precision,
      num_splits=num_splits,
  )
  compiler_params = None
  if pltriton is not None:
    compiler_params = pltriton.CompilerParams(
        num_warps=block_sizes.num_warps, num_stages=block_sizes.num_stages
    )
  if num_splits > 1:
    grid = (batch, num_kv_heads, num_splits)
    out_specs = [
        pl.BlockSpec((None, None, None, rows, head_dim), lambda b, k, s: (b, k, s, 0, 0)),
        pl.BlockSpec((None, None, None, rows), lambda b, k, s: (b, k, s, 0)),
    ]
    out_shape = [
        jax.ShapeDtypeStruct((batch, num_kv_heads, num_splits, rows, head_dim), jnp.float32),
        jax.ShapeDtypeStruct((batch, num_kv_heads, num_splits, rows), jnp.float32),
    ]
  else:
    grid = (batch, num_kv_heads)
    out_specs = pl.BlockSpec((None, None, rows, head_dim), lambda b, k: (b, k, 0, 0))
    out_shape = jax.ShapeDtypeStruct((batch, num_kv_heads, rows, head_dim), q.dtype)
  out = pl.pallas_call(
      kernel,
      grid=grid,
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=compiler_params,
      interpret=interpret,
      name=f"paged_attention_triton_r{rows}_bkv{ppb * page_size}_k{num_splits}",
  )(*operands)
  if num_splits > 1:
    out = split.combine(*out).astype(q.dtype)
  return common.from_row_tiles(out, num_tokens, num_heads)


def paged_attention_triton(
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
  """Triton-lowered paged attention; same contract as ``paged_attention_reference``.

  Pages marked -1 and slots at or past ``kv_lens`` are masked (never contribute, even if
  they hold NaN).

  Raises:
    ValueError: malformed inputs.
    NotImplementedError: no CUDA backend (and not ``interpret``), Triton unavailable, or
      shapes Triton cannot tile (head_dim or page_size not a power of two, T > 31 with a
      tree mask, more than 128 query rows per KV head, explicit ``positions`` with a
      sliding window).
  """
  common.check_inputs(q, kv_pages, page_indices, kv_lens, q_lens, sliding_window, tree_mask,
                      positions)
  common.check_slot_window("pallas_triton", sliding_window, positions)
  if not interpret:
    if pltriton is None:
      raise NotImplementedError("jax.experimental.pallas.triton is not importable")
    if jax.default_backend() != "gpu":
      raise NotImplementedError(f"pallas_triton needs a GPU; backend={jax.default_backend()}")
  batch, num_tokens, num_heads, head_dim = q.shape
  page_size = kv_pages.shape[1]
  group = num_heads // (kv_pages.shape[2] // 2)
  for name, value in (("head_dim", head_dim), ("page_size", page_size)):
    if value & (value - 1):
      raise NotImplementedError(f"pallas_triton needs a power-of-two {name}; got {value}")
  if head_dim < 16:
    raise NotImplementedError(f"pallas_triton needs head_dim >= 16; got {head_dim}")
  if num_tokens * group > 128:
    raise NotImplementedError(f"pallas_triton handles <= 128 query rows; got T*G={num_tokens * group}")
  if tree_mask is not None and num_tokens > common.MAX_TREE_TOKENS:
    raise NotImplementedError(f"tree masks need T <= {common.MAX_TREE_TOKENS}; got {num_tokens}")
  if block_sizes is None:
    block_sizes = default_block_sizes("pallas_triton", page_size)
  if block_sizes.block_kv(page_size) < 16:
    raise NotImplementedError(f"pallas_triton needs >= 16 keys per block; {block_sizes=}")
  max_blocks = -(-page_indices.shape[1] // block_sizes.pages_per_block)
  num_splits = block_sizes.splits(batch=batch, num_kv_heads=kv_pages.shape[2] // 2,
                                  max_blocks=max_blocks)
  return _call(
      q, kv_pages, page_indices, kv_lens, q_lens, tree_mask,
      sm_scale=float(sm_scale),
      sliding_window=None if sliding_window is None else int(sliding_window),
      block_sizes=block_sizes, interpret=bool(interpret), num_splits=num_splits,
  )
