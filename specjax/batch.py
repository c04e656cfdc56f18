"""Host step builder: numpy arrays of one engine step -> the metadata pytrees its jitted
step reads. ``AttentionMetadata`` itself lives next to the kernel it describes
(``pallas_kernels.paged_attention.metadata``) and is re-exported here."""

from __future__ import annotations

from pallas_kernels.paged_attention.metadata import AttentionMetadata

__all__ = ["AttentionMetadata"]
