"""Block sizes of the paged-attention kernels, as frozen configs that validate themselves.

A KV compute block is ``pages_per_block`` whole pages, i.e. ``block_kv = pages_per_block *
page_size`` key positions; it is gathered page by page (pages are not contiguous) and
then treated as one tile. Worked example: page_size 16 and pages_per_block 4 give 64-key
blocks; a 4096-token context is 64 such blocks.
"""

from __future__ import annotations

import dataclasses

__all__ = ["BlockSizes", "default_block_sizes"]


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
  """

  pages_per_block: int = 4
  num_warps: int = 4
  num_stages: int = 2

  def __post_init__(self):
    if not _is_power_of_two(self.pages_per_block):
      raise ValueError(f"{self.pages_per_block=} must be a power of two")
    if self.num_warps not in (1, 2, 4, 8, 16):
      raise ValueError(f"{self.num_warps=} must be one of 1, 2, 4, 8, 16")
    if not 1 <= self.num_stages <= 8:
      raise ValueError(f"{self.num_stages=} must be in [1, 8]")

  def block_kv(self, page_size: int) -> int:
    """Key positions per compute block."""
    return self.pages_per_block * page_size


def default_block_sizes(backend: str, page_size: int) -> BlockSizes:
  """Defaults per backend; ``backend`` is "pallas_gpu", "pallas_triton" or "pallas_tpu".

  Mosaic GPU feeds the tensor cores 64-key tiles (a multiple of 64 keys per block);
  Triton likes 64..128 keys per program step; TPU pipelines one block per grid step.
  """
  if page_size < 1:
    raise ValueError(f"{page_size=} must be >= 1")
  target = {"pallas_gpu": 64, "pallas_triton": 64, "pallas_tpu": 128}.get(backend)
  if target is None:
    raise ValueError(f"{backend=} must be pallas_gpu, pallas_triton or pallas_tpu")
  pages = 1
  while pages * page_size < target:
    pages *= 2
  num_stages = 3 if backend == "pallas_gpu" else 2
  return BlockSizes(pages_per_block=pages, num_warps=4, num_stages=num_stages)
