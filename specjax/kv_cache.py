"""Host side of the paged KV cache: the page allocator and per-sequence page lists.

Device pages live with the model (``models.llama.init_kv_caches``); this module only
hands out page ids. Page 0.. ``num_pages - 1`` are real; -1 pads page tables.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["PageAllocator", "pages_needed", "page_table"]


def pages_needed(num_tokens: int, page_size: int) -> int:
  """Pages covering positions ``0 .. num_tokens - 1`` (e.g. 17 tokens, page 16 -> 2)."""
  return -(-num_tokens // page_size)


class PageAllocator:
  """Free-list allocator of KV page ids owned by the scheduler.

  Raises:
    ValueError: freeing a page that is not allocated (double free), or a bad size.
  """

  def __init__(self, num_pages: int):
    if num_pages < 1:
      raise ValueError(f"{num_pages=} must be >= 1")
    self.num_pages = num_pages
    self._free = list(range(num_pages - 1, -1, -1))
    self._used: set[int] = set()

  @property
  def num_free(self) -> int:
    return len(self._free)

  @property
  def num_used(self) -> int:
    return len(self._used)

  def allocate(self, n: int) -> list[int] | None:
    """Returns ``n`` page ids, or None (allocating nothing) if fewer are free."""
    if n < 0:
      raise ValueError(f"{n=} must be >= 0")
    if n > len(self._free):
      return None
    pages = [self._free.pop() for _ in range(n)]
    self._used.update(pages)
    return pages

  def free(self, pages: list[int]) -> None:
    for p in pages:
      if p not in self._used:
        raise ValueError(f"page {p} is not allocated (double free or foreign page)")
      self._used.remove(p)
      self._free.append(p)


def page_table(page_lists: Sequence, num_rows: int, width: int) -> np.ndarray:
  """``i32[num_rows, width]`` table, -1 padded; rows past ``len(page_lists)`` are all -1.
  ``page_lists``: per row its page ids (a list or ``RequestState.page_array()``)."""
  table = np.full((num_rows, width), -1, np.int32)
  for i, pages in enumerate(page_lists):
    n = min(len(pages), width)
    table[i, :n] = pages[:n]
  return table
