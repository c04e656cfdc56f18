"""Block sizes of the paged-attention kernels, as frozen configs that validate themselves.

A KV compute block is ``pages_per_block`` whole pages, i.e. ``block_kv = pages_per_block *
page_size`` key positions; it is gathered page by page (pages are not contiguous) and
then treated as one tile. Worked example: page_size 16 and pages_per_block 4 give 64-key
blocks; a 4096-token context is 64 such blocks.

Split-KV (flash-decoding; Dao et al. 2023, "Flash-Decoding for long-context inference"):
the GPU kernels can split each sequence's KV blocks over ``num_splits`` CTAs (grid
``(B, K, num_splits)``) when ``B * K`` CTAs cannot fill the GPU. ``num_splits=None`` picks
it with :meth:`BlockSizes.splits`; worked example (H200, ``target_ctas`` 132, 128-key
blocks): batch 1, 8 KV heads, 4096-token table = 32 blocks -> ``ceil(132 / 8) = 17``
wanted, ``ceil(32 / 17) = 2`` blocks per split, so 16 splits (128 CTAs); batch 32 has
256 >= 132 CTAs already, so 1 split (the unsplit kernel, unchanged).
"""

from __future__ import annotations

import dataclasses

__all__ = ["MAX_SPLITS", "BlockSizes", "default_block_sizes"]

MAX_SPLITS = 256


def _is_power_of_two(x: int) -> bool:
  return x > 0 and x & (x - 1) == 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockSizes:
  """Static tuning knobs (hashable: usable as a static jit argument).

  Attributes:
    pages_per_block: KV pages per compute block (a power of two).
    num_warps: Triton warps per program (ignored by other backends).
    num_stages: pipelining depth: Triton ``num_stages``, Mosaic GPU shared-memory
      KV buffers in flight. At least 1; Mosaic GPU needs at least 2 to overlap.
    num_splits: KV splits per (sequence, KV head) for the GPU kernels; ``None`` lets
      :meth:`splits` choose from ``target_ctas``. A forced value is used as given, also
      when some splits then get no block (they contribute nothing). The TPU kernel does
      not split: it raises ``NotImplementedError`` for a forced value > 1.
    target_ctas: CTAs (programs) the ``num_splits=None`` rule aims for; the default is
      the H200's 132 SMs.
  """

  pages_per_block: int = 4
  num_warps: int = 4
  num_stages: int = 2
  num_splits: int | None = None
  target_ctas: int = 132

  def __post_init__(self):
    if not _is_power_of_two(self.pages_per_block):
      raise ValueError(f"{self.pages_per_block=} must be a power of two")
    if self.num_warps not in (1, 2, 4, 8, 16):
      raise ValueError(f"{self.num_warps=} must be one of 1, 2, 4, 8, 16")
    if not 1 <= self.num_stages <= 8:
      raise ValueError(f"{self.num_stages=} must be in [1, 8]")
    if self.num_splits is not None and not 1 <= self.num_splits <= MAX_SPLITS:
      raise ValueError(f"{self.num_splits=} must be None or in [1, {MAX_SPLITS}]")
    if self.target_ctas < 1:
      raise ValueError(f"{self.target_ctas=} must be >= 1")

  def splits(self, *, batch: int, num_kv_heads: int, max_blocks: int) -> int:
    """KV splits for a ``(batch, num_kv_heads)`` grid over ``max_blocks`` KV blocks.

    A forced ``num_splits`` is returned as is. Otherwise: 1 if ``batch * num_kv_heads >=
    target_ctas``; else ``wanted = ceil(target_ctas / (batch * num_kv_heads))`` (at most
    ``max_blocks``), then the fewest splits with the same blocks per split, so that a
    full-length sequence leaves no split empty: ``ceil(max_blocks / ceil(max_blocks /
    wanted))``.
    """
    if self.num_splits is not None:
      return self.num_splits
    ctas = batch * num_kv_heads
    if ctas >= self.target_ctas or max_blocks <= 1:
      return 1
    wanted = min(-(-self.target_ctas // ctas), max_blocks, MAX_SPLITS)
    per_split = -(-max_blocks // wanted)
    return -(-max_blocks // per_split)

  def block_kv(self, page_size: int) -> int:
    """Key positions per compute block."""
    return self.pages_per_block * page_size


def default_block_sizes(backend: str, page_size: int) -> BlockSizes:
  """Defaults per backend; ``backend`` is "pallas_gpu", "pallas_triton" or "pallas_tpu".

  GPU defaults come from ``benchmarks/bench_attention.py`` on one H200 (JAX 0.11.2,
  Llama-8B decode shape, batch 32, 4k context, page_size 16 and 64): 128-key blocks were
  fastest for both GPU kernels; Mosaic GPU liked 2 shared-memory stages (more stages
  cost occupancy), Triton 4 pipeline stages with 4 warps. TPU: one 128-key block per grid
  step (untuned; no TPU was available). Splits: ``num_splits=None`` (the
  ``target_ctas=132`` rule); at batch 1 / 4096 its 16 splits beat forced 8 and 32 on the
  H200 (docs/gpu/split_kv_attention), and at batch 32 it picks 1.
  """
  if page_size < 1:
    raise ValueError(f"{page_size=} must be >= 1")
  if backend not in ("pallas_gpu", "pallas_triton", "pallas_tpu"):
    raise ValueError(f"{backend=} must be pallas_gpu, pallas_triton or pallas_tpu")
  pages = 1
  while pages * page_size < 128:
    pages *= 2
  num_stages = {"pallas_gpu": 2, "pallas_triton": 4, "pallas_tpu": 2}[backend]
  return BlockSizes(pages_per_block=pages, num_warps=4, num_stages=num_stages)
