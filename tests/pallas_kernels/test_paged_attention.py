"""One paged-attention suite run against every backend.

``PagedAttentionSuite`` holds the cases; each ``Test*`` subclass binds a backend. The
``*Interpret`` subclasses run the Pallas kernels in interpret mode on CPU, so CPU CI
covers every kernel; the ``@pytest.mark.gpu`` subclasses run them natively (device
machine: ``python3 -m pytest -m gpu tests/pallas_kernels``).

Inputs: permuted page tables, unused pages and stale slots past ``kv_lens`` filled with
NaN, padding query tokens NaN, kv lengths around page boundaries. Comparisons are on
real query rows (``t < q_lens``); kernels must write zeros on padding rows.

Split-KV (flash-decoding) cases force ``BlockSizes.num_splits > 1`` on the GPU kernels,
with sequences short enough that some splits get no block; the ``Test*`` classes that
pin ``num_splits=1`` keep the unsplit kernel covered.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels.paged_attention as pa
from pallas_kernels.paged_attention import (
    IMPLEMENTATIONS,
    _backend,
    paged_attention,
    paged_attention_reference,
    split,
)
from pallas_kernels.paged_attention.tuning import BlockSizes, default_block_sizes

PAGE = 16
HEAD_DIM = 64
_reference = jax.jit(paged_attention_reference, static_argnames=("sm_scale", "sliding_window"))


def make_inputs(seed, *, kv_lens, q_lens, num_tokens, num_heads, num_kv_heads,
                head_dim=HEAD_DIM, page_size=PAGE, pages_per_seq=8, dtype=jnp.float32,
                tree=False):
  """Random paged inputs; unused pages, stale slots and padding queries are NaN."""
  rng = np.random.default_rng(seed)
  batch = len(kv_lens)
  used = [-(-n // page_size) for n in kv_lens]
  assert max(used) <= pages_per_seq
  num_pages = sum(used) + 3
  kv = np.full((num_pages, page_size, 2 * num_kv_heads, head_dim), np.nan, np.float32)
  perm = rng.permutation(num_pages)
  page_indices = np.full((batch, pages_per_seq), -1, np.int32)
  cursor = 0
  for b, n in enumerate(kv_lens):
    for j in range(used[b]):
      page = perm[cursor]
      cursor += 1
      page_indices[b, j] = page
      slots = min(page_size, n - j * page_size)
      kv[page, :slots] = rng.standard_normal((slots, 2 * num_kv_heads, head_dim))
  q = rng.standard_normal((batch, num_tokens, num_heads, head_dim)).astype(np.float32)
  for b, n in enumerate(q_lens):
    q[b, n:] = np.nan
  tree_mask = None
  if tree:
    tree_mask = np.zeros((batch, num_tokens, num_tokens), bool)
    for b in range(batch):
      parent = [-1] + [int(rng.integers(-1, i)) for i in range(1, num_tokens)]
      for i in range(num_tokens):
        j = i
        while j >= 0:  # i sees itself and its ancestors
          tree_mask[b, i, j] = True
          j = parent[j]
    tree_mask = jnp.asarray(tree_mask)
  return dict(
      q=jnp.asarray(q, dtype), kv_pages=jnp.asarray(kv, dtype),
      page_indices=jnp.asarray(page_indices), kv_lens=jnp.asarray(kv_lens, jnp.int32),
      q_lens=jnp.asarray(q_lens, jnp.int32), tree_mask=tree_mask,
  )


class PagedAttentionSuite:
  """The cases; subclasses set the backend. Not collected itself (no ``Test`` prefix)."""

  implementation = "reference"
  interpret = False
  dtype = jnp.float32
  atol = 1e-4
  block_sizes: BlockSizes | None = None
  zero_padding_rows = True
  splits_kv = True  # the backend implements BlockSizes.num_splits > 1

  def force_splits(self, num_splits):
    if not self.splits_kv:
      pytest.skip(f"{self.implementation} does not split KV")
    base = self.block_sizes or default_block_sizes(self.implementation, PAGE)
    self.block_sizes = dataclasses.replace(base, num_splits=num_splits)

  def attention(self, inputs, *, sliding_window=None, sm_scale=0.125):
    kwargs = dict(inputs)
    fn = _reference if self.implementation == "reference" else _backend(self.implementation)
    if self.implementation != "reference":
      kwargs.update(interpret=self.interpret, block_sizes=self.block_sizes)
    return fn(**kwargs, sm_scale=sm_scale, sliding_window=sliding_window)

  def check(self, inputs, *, sliding_window=None):
    out = self.attention(inputs, sliding_window=sliding_window)
    ref = _reference(**inputs, sm_scale=0.125, sliding_window=sliding_window)
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    q_lens = np.asarray(inputs["q_lens"])
    real = np.arange(out.shape[1])[None, :] < q_lens[:, None]  # [B, T]
    assert out.shape == ref.shape and out.dtype == np.float32
    np.testing.assert_allclose(out[real], ref[real], atol=self.atol, rtol=0)
    assert not np.isnan(out[real]).any()
    if self.zero_padding_rows:
      np.testing.assert_array_equal(out[~real], 0.0)  # padding query rows are zeros
    return out

  @pytest.mark.parametrize("group", [1, 8])
  def test_decode_page_boundaries(self, group):
    num_kv_heads = 2 if group == 1 else 1
    inputs = make_inputs(
        0, kv_lens=[1, PAGE - 1, PAGE, PAGE + 1, 5 * PAGE + 3], q_lens=[1] * 5, num_tokens=1,
        num_heads=group * num_kv_heads, num_kv_heads=num_kv_heads, dtype=self.dtype,
    )
    self.check(inputs)

  def test_verify_mixed_batch_with_padding_rows(self):
    # Chain verify (q_len = L + 1 = 4 at the KV tail), decode, an idle row, a partial
    # verify and a prefill chunk straddling a page boundary, GQA 2.
    inputs = make_inputs(
        1, kv_lens=[20, 33, 7, 4, PAGE + 2], q_lens=[4, 1, 0, 3, 4], num_tokens=4,
        num_heads=4, num_kv_heads=2, dtype=self.dtype,
    )
    self.check(inputs)

  def test_tree_mask(self):
    inputs = make_inputs(
        2, kv_lens=[20, 5 * PAGE, 4], q_lens=[4, 4, 3], num_tokens=4, num_heads=4,
        num_kv_heads=2, dtype=self.dtype, tree=True,
    )
    self.check(inputs)

  def test_sliding_window(self):
    inputs = make_inputs(
        3, kv_lens=[5 * PAGE + 3, 40, 3], q_lens=[2, 1, 2], num_tokens=2, num_heads=4,
        num_kv_heads=2, dtype=self.dtype,
    )
    self.check(inputs, sliding_window=PAGE + 5)

  def test_two_runs_bitwise_equal(self):
    inputs = make_inputs(
        1, kv_lens=[20, 33, 7, 4, PAGE + 2], q_lens=[4, 1, 0, 3, 4], num_tokens=4,
        num_heads=4, num_kv_heads=2, dtype=self.dtype,
    )
    first = np.asarray(self.attention(inputs))
    second = np.asarray(self.attention(inputs))
    np.testing.assert_array_equal(first, second)

  # ------------------------------------------------------------ split-KV (flash-decoding)
  # 16-page tables: 4 blocks of 64 keys (Mosaic GPU) or 8 of 32 (Triton, 2 pages/block),
  # so with 3-4 splits the short rows (1 block) leave splits empty and 13P+7 leaves the
  # last split empty (Mosaic GPU: 2 + 2 + 0 blocks) or short.
  @pytest.mark.parametrize("group,num_splits", [(1, 3), (2, 4), (8, 3)])
  def test_split_decode_page_boundaries(self, group, num_splits):
    self.force_splits(num_splits)
    num_kv_heads = 2 if group == 1 else 1
    inputs = make_inputs(
        10, kv_lens=[1, PAGE - 1, PAGE, PAGE + 1, 5 * PAGE + 3, 13 * PAGE + 7],
        q_lens=[1] * 6, num_tokens=1, num_heads=group * num_kv_heads,
        num_kv_heads=num_kv_heads, pages_per_seq=16, dtype=self.dtype,
    )
    self.check(inputs)

  def test_split_verify_mixed_batch(self):
    self.force_splits(3)
    inputs = make_inputs(
        11, kv_lens=[20, 33, 7, 4, PAGE + 2, 9 * PAGE + 5], q_lens=[4, 1, 0, 3, 4, 4],
        num_tokens=4, num_heads=4, num_kv_heads=2, pages_per_seq=16, dtype=self.dtype,
    )
    self.check(inputs)

  def test_split_tree_mask(self):
    self.force_splits(2)
    inputs = make_inputs(
        12, kv_lens=[20, 11 * PAGE + 1, 4], q_lens=[4, 4, 3], num_tokens=4, num_heads=4,
        num_kv_heads=2, pages_per_seq=16, dtype=self.dtype, tree=True,
    )
    self.check(inputs)

  def test_split_sliding_window(self):
    self.force_splits(3)
    inputs = make_inputs(
        13, kv_lens=[12 * PAGE + 3, 40], q_lens=[2, 1], num_tokens=2, num_heads=4,
        num_kv_heads=2, pages_per_seq=16, dtype=self.dtype,
    )
    self.check(inputs, sliding_window=5 * PAGE + 5)


# ---------------------------------------------------------------- CPU (CI) backends
class TestReference(PagedAttentionSuite):
  # reference.py's docstring promises zero padding rows, but its mask has no
  # ``t < q_lens`` term: padding tokens attend like real ones (NaN here, as their q is).
  zero_padding_rows = False
  splits_kv = False


class TestTritonInterpret(PagedAttentionSuite):
  implementation = "pallas_triton"
  interpret = True
  block_sizes = BlockSizes(pages_per_block=2, num_splits=1)


class TestMosaicGpuInterpret(PagedAttentionSuite):
  """Mosaic GPU's CPU interpreter (TMA copies, barriers, pipelining, masks, zeroing).

  JAX 0.10's interpreter has no transposed-B or register-A ``wgmma``, so in interpret
  mode the kernel's two matmuls are ``dot_general`` on the same shared-memory tiles;
  the ``wgmma`` path itself is checked by lowering (below) and natively (gpu marker).
  The kernel is bf16/f16 only, hence the bf16 tolerance.
  """

  implementation = "pallas_gpu"
  interpret = True
  dtype = jnp.bfloat16
  atol = 2e-2
  block_sizes = BlockSizes(pages_per_block=4, num_stages=2, num_splits=1)


class TestTpuInterpret(PagedAttentionSuite):
  implementation = "pallas_tpu"
  interpret = True
  block_sizes = BlockSizes(pages_per_block=2)
  splits_kv = False

  def test_forced_splits_raise_not_implemented(self):
    inputs = make_inputs(4, kv_lens=[PAGE + 1], q_lens=[1], num_tokens=1, num_heads=2,
                         num_kv_heads=1)
    with pytest.raises(NotImplementedError):
      self.block_sizes = BlockSizes(pages_per_block=2, num_splits=2)
      self.attention(inputs)

  def test_bf16_packed_kv_split(self):
    self.dtype, self.atol = jnp.bfloat16, 2e-2
    inputs = make_inputs(
        4, kv_lens=[PAGE + 1, 3], q_lens=[2, 1], num_tokens=2, num_heads=4, num_kv_heads=2,
        dtype=jnp.bfloat16,
    )
    self.check(inputs)


# ---------------------------------------------------------------- GPU-native backends
@pytest.mark.gpu
class TestTritonGpu(PagedAttentionSuite):
  implementation = "pallas_triton"  # f32 dots run IEEE (Precision.HIGHEST), not tf32
  block_sizes = BlockSizes(pages_per_block=8, num_warps=4, num_stages=4, num_splits=1)


@pytest.mark.gpu
class TestTritonGpuBf16(PagedAttentionSuite):
  implementation = "pallas_triton"
  dtype = jnp.bfloat16
  atol = 2e-2


@pytest.mark.gpu
class TestMosaicGpu(PagedAttentionSuite):
  implementation = "pallas_gpu"
  dtype = jnp.bfloat16
  atol = 2e-2
  block_sizes = BlockSizes(pages_per_block=4, num_stages=2, num_splits=1)


@pytest.mark.gpu
class TestMosaicGpuDefaultBlocks(PagedAttentionSuite):
  implementation = "pallas_gpu"  # default blocks and the default split rule
  dtype = jnp.float16
  atol = 5e-3


# ---------------------------------------------------------------- lowering checks
def _abstract_specs(dtype, num_tokens, tree, batch=2, num_heads=8, num_kv_heads=2,
                    head_dim=128, page_size=PAGE, pages_per_seq=8, num_pages=40):
  return [
      jax.ShapeDtypeStruct((batch, num_tokens, num_heads, head_dim), dtype),
      jax.ShapeDtypeStruct((num_pages, page_size, 2 * num_kv_heads, head_dim), dtype),
      jax.ShapeDtypeStruct((batch, pages_per_seq), jnp.int32),
      jax.ShapeDtypeStruct((batch,), jnp.int32),
      jax.ShapeDtypeStruct((batch,), jnp.int32),
      jax.ShapeDtypeStruct((batch, num_tokens, num_tokens), jnp.bool_) if tree else None,
  ]


def _custom_calls(text):
  return set(re.findall(r"custom_call @([\w$.]+)", text))


@pytest.mark.parametrize("dtype,num_tokens,tree", [
    (jnp.float32, 1, False), (jnp.bfloat16, 4, True),
])
def test_tpu_kernel_lowers_to_mosaic(dtype, num_tokens, tree):
  """``jax.export(platforms=["tpu"])`` on CPU under an abstract TPU mesh.

  Checks Pallas -> Mosaic lowering, not Mosaic's own compile (that needs a TPU).
  """
  from jax._src import mesh as mesh_lib

  from pallas_kernels.paged_attention import tpu

  block_sizes = default_block_sizes("pallas_tpu", PAGE)
  fn = lambda *a: tpu._call(*a, sm_scale=0.1, sliding_window=64, block_sizes=block_sizes,
                            interpret=False)
  device = mesh_lib.AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
  mesh = mesh_lib.AbstractMesh((1,), ("x",), abstract_device=device)
  with jax.sharding.use_abstract_mesh(mesh):
    exported = jax.export.export(jax.jit(fn), platforms=["tpu"])(
        *_abstract_specs(dtype, num_tokens, tree))
  assert "tpu_custom_call" in _custom_calls(exported.mlir_module())


@pytest.mark.parametrize("module,custom_call", [
    ("gpu", "mosaic_gpu_v2"), ("triton", "__gpu$xla.gpu.triton"),
])
@pytest.mark.parametrize("num_tokens,tree", [(1, False), (16, True)])
def test_gpu_kernels_lower_for_cuda_on_cpu(module, custom_call, num_tokens, tree):
  """Lowers for CUDA on a CPU host: proves which backend each kernel goes through."""
  import importlib

  mod = importlib.import_module(f"pallas_kernels.paged_attention.{module}")
  backend = {"gpu": "pallas_gpu", "triton": "pallas_triton"}[module]
  block_sizes = default_block_sizes(backend, PAGE)
  fn = lambda *a: mod._call(*a, sm_scale=0.1, sliding_window=None, block_sizes=block_sizes,
                            interpret=False)
  specs = _abstract_specs(jnp.bfloat16, num_tokens, tree, num_heads=32, num_kv_heads=8)
  text = jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
  assert custom_call in _custom_calls(text)


# ---------------------------------------------------------------- dispatch and config
def test_dispatcher_falls_through_on_not_implemented():
  inputs = make_inputs(5, kv_lens=[5, 20], q_lens=[1, 1], num_tokens=1, num_heads=2,
                       num_kv_heads=1)
  ref = _reference(**inputs, sm_scale=0.125)
  # f32 is outside pallas_gpu's dtypes on any host; on CPU the Triton/TPU kernels
  # also decline (no interpret through the dispatcher), so "reference" answers.
  dispatch = jax.jit(lambda x: paged_attention(
      **x, sm_scale=0.125, implementation=("pallas_gpu", "pallas_tpu", "reference")))
  used_before = set(pa._USED)
  pa._USED.clear()
  try:
    np.testing.assert_array_equal(np.asarray(dispatch(inputs)), np.asarray(ref))
    assert pa.implementations_used() == ("reference",)  # what ran, not what was asked
  finally:
    pa._USED.update(used_before)
  with pytest.raises(NotImplementedError):
    paged_attention(**inputs, sm_scale=0.125, implementation="pallas_gpu")
  with pytest.raises(ValueError):
    paged_attention(**inputs, sm_scale=0.125, implementation="pallas_cuda")
  assert set(IMPLEMENTATIONS) == {"reference", "pallas_gpu", "pallas_triton", "pallas_tpu"}


@pytest.mark.parametrize("implementation", ["pallas_gpu", "pallas_triton", "pallas_tpu"])
def test_unsupported_shapes_raise_not_implemented(implementation):
  fn = _backend(implementation)
  inputs = make_inputs(6, kv_lens=[5], q_lens=[1], num_tokens=1, num_heads=2,
                       num_kv_heads=1, head_dim=24, page_size=12, pages_per_seq=2,
                       dtype=jnp.bfloat16)  # head_dim / page_size no kernel can tile
  with pytest.raises(NotImplementedError):
    fn(**inputs, sm_scale=0.1, interpret=True)


def test_block_sizes_validate_themselves():
  with pytest.raises(ValueError):
    BlockSizes(pages_per_block=3)
  with pytest.raises(ValueError):
    BlockSizes(num_warps=3)
  with pytest.raises(ValueError):
    BlockSizes(num_stages=0)
  with pytest.raises(ValueError):
    default_block_sizes("pallas_cuda", 16)
  assert default_block_sizes("pallas_gpu", 16).block_kv(16) % 64 == 0
  assert hash(BlockSizes()) == hash(BlockSizes())


def test_split_rule():
  rule = BlockSizes()  # target_ctas 132 (H200 SMs)
  assert rule.splits(batch=32, num_kv_heads=8, max_blocks=32) == 1  # 256 CTAs already
  assert rule.splits(batch=1, num_kv_heads=8, max_blocks=32) == 16  # 17 wanted, 2 blocks each
  assert rule.splits(batch=1, num_kv_heads=8, max_blocks=1) == 1
  assert rule.splits(batch=2, num_kv_heads=1, max_blocks=5) == 5
  assert BlockSizes(num_splits=7).splits(batch=32, num_kv_heads=8, max_blocks=2) == 7
  assert BlockSizes(target_ctas=264).splits(batch=1, num_kv_heads=8, max_blocks=32) == 32
  with pytest.raises(ValueError):
    BlockSizes(num_splits=0)
  with pytest.raises(ValueError):
    BlockSizes(target_ctas=0)


def test_split_range_and_combine_are_exact():
  # 5 blocks from block 2 over 3 splits: 2, 2, 1 blocks; 4 splits of 1 block: one empty.
  ranges = [tuple(int(x) for x in split.split_range(jnp.int32(s), 3, jnp.int32(2),
                                                    jnp.int32(5))) for s in range(3)]
  assert ranges == [(2, 2), (4, 2), (6, 1)]
  assert int(split.split_range(jnp.int32(3), 4, jnp.int32(0), jnp.int32(3))[1]) == 0
  rng = np.random.default_rng(0)
  logits = rng.standard_normal((2, 3, 10)) * 4  # [B, R, keys]
  values = rng.standard_normal((2, 10, 8))
  p = np.exp(logits - logits.max(-1, keepdims=True))
  want = np.einsum("brj,bjh->brh", p / p.sum(-1, keepdims=True), values)
  o_parts, lse_parts = [], []
  for lo, hi in ((0, 4), (4, 4), (4, 10)):  # the middle split is empty
    if lo == hi:
      o_parts.append(np.zeros((2, 3, 8)))
      lse_parts.append(np.full((2, 3), -np.inf))
      continue
    x = logits[..., lo:hi]
    m = x.max(-1, keepdims=True)
    e = np.exp(x - m)
    o_parts.append(np.einsum("brj,bjh->brh", e / e.sum(-1, keepdims=True), values[:, lo:hi]))
    lse_parts.append(m[..., 0] + np.log(e.sum(-1)))
  o = split.combine(jnp.asarray(np.stack(o_parts, 1)[:, None], jnp.float32),
                    jnp.asarray(np.stack(lse_parts, 1)[:, None], jnp.float32))
  np.testing.assert_allclose(np.asarray(o)[:, 0], want, atol=1e-5, rtol=0)
  empty = split.combine(jnp.zeros((1, 1, 2, 8, 4)), jnp.full((1, 1, 2, 8), -jnp.inf))
  np.testing.assert_array_equal(np.asarray(empty), 0.0)


# ---------------------------------------------------------------- Mosaic GPU shared memory
def test_mosaic_gpu_smem_count_matches_what_mosaic_reported():
  """The one measured point: a 17-token verify (GQA 4: 128 query rows), split, 128-key
  blocks of 8 pages, 2 stages, bf16, head_dim 128; Mosaic GPU said smem_bytes=232712."""
  from pallas_kernels.paged_attention import gpu

  assert gpu.smem_bytes(128, 128, 128, 2, 2, num_splits=8, pages_per_block=8) == 232_712
  # unsplit: no f32 partial-output tile nor log-sum-exp row
  assert gpu.smem_bytes(128, 128, 128, 2, 2, num_splits=1, pages_per_block=8) == 232_712 - (
      128 * 128 * 4 + 1024)


def test_mosaic_gpu_defaults_shrink_the_kv_block_only_where_it_does_not_fit():
  from pallas_kernels.paged_attention import gpu

  defaults = default_block_sizes("pallas_gpu", 16)
  shape = dict(head_dim=128, page_size=16, itemsize=2, batch=1, num_kv_heads=8, num_pages=64)
  sizes, splits = gpu.fitting_block_sizes(defaults, rows=128, **shape)
  assert sizes.block_kv(16) == 64 and splits > 1  # 128 keys: 232,712 B > 232,448 B
  assert gpu.smem_bytes(128, 128, 64, 2, 2, splits, 4) == 167_048
  assert gpu.fitting_block_sizes(defaults, rows=64, **shape)[0] == defaults  # fits as is
  # batch 32: one CTA per (sequence, KV head) already fills the GPU, no split, fits
  assert gpu.fitting_block_sizes(defaults, rows=128, **{**shape, "batch": 32})[0] == defaults
  assert gpu.fitting_block_sizes(dataclasses.replace(defaults, pages_per_block=2), rows=128,
                                 **{**shape, "head_dim": 1024}) is None


def test_mosaic_gpu_explicit_block_sizes_over_budget_raise():
  """Explicit block sizes are used as given: over budget is NotImplementedError naming
  the bytes (checked before the kernel is built, so on any host)."""
  from pallas_kernels.paged_attention import gpu

  inputs = make_inputs(14, kv_lens=[60 * PAGE], q_lens=[17], num_tokens=17, num_heads=32,
                       num_kv_heads=8, head_dim=128, pages_per_seq=64, dtype=jnp.bfloat16)
  with pytest.raises(NotImplementedError, match="232712 B of shared memory"):
    gpu.paged_attention_mosaic_gpu(**inputs, sm_scale=0.1, interpret=True,
                                   block_sizes=BlockSizes(pages_per_block=8, num_stages=2))


def test_mosaic_gpu_default_blocks_lower_for_a_17_token_split_verify():
  """The shape that overflowed on the H100 / H200 (a 17-token verify, GQA 4, batch 1,
  64 pages: split) lowers for CUDA with the default block sizes, now 64-key blocks (the
  kernel's name carries its block)."""
  from pallas_kernels.paged_attention import gpu

  specs = _abstract_specs(jnp.bfloat16, 17, False, batch=1, num_heads=32, num_kv_heads=8,
                          pages_per_seq=64, num_pages=80)
  sizes, splits = gpu.fitting_block_sizes(default_block_sizes("pallas_gpu", PAGE), rows=128,
                                          head_dim=128, page_size=PAGE, itemsize=2, batch=1,
                                          num_kv_heads=8, num_pages=64)
  fn = lambda *a: gpu._call(*a, sm_scale=0.1, sliding_window=None, block_sizes=sizes,
                            interpret=False, num_splits=splits)
  text = jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu_v2" in _custom_calls(text)
  assert f"r128_bkv64_s2_k{splits}" in text


@pytest.mark.gpu
def test_mosaic_gpu_17_token_split_verify_matches_the_reference():
  """Natively, the shape that overflowed: default blocks, against the reference."""
  inputs = make_inputs(15, kv_lens=[60 * PAGE + 3], q_lens=[17], num_tokens=17, num_heads=32,
                       num_kv_heads=8, head_dim=128, pages_per_seq=64, dtype=jnp.bfloat16)
  out = _backend("pallas_gpu")(**inputs, sm_scale=0.125)
  ref = _reference(**inputs, sm_scale=0.125, sliding_window=None)
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                             atol=2e-2, rtol=0)
