"""Ragged paged attention: public function and implementation dispatch.

``implementation`` is "reference", a backend name, or a sequence tried in order; a
backend that cannot serve the shapes raises ``NotImplementedError`` and only then is
the next one tried. Nothing else is caught.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax

from pallas_kernels.paged_attention.reference import (
    copy_kv,
    kv_cache_shape,
    paged_attention_reference,
    query_positions,
    write_kv,
)

__all__ = [
    "IMPLEMENTATIONS",
    "copy_kv",
    "kv_cache_shape",
    "paged_attention",
    "query_positions",
    "implementations_used",
    "resolve_implementation",
    "write_kv",
]

# Backend name -> what it lowers to:
#   "reference"      pure jnp (XLA), any platform
#   "pallas_gpu"     Mosaic GPU (jax.experimental.pallas.mosaic_gpu; Hopper wgmma + TMA), bf16/f16
#   "pallas_triton"  Pallas' Triton backend (plain pl.pallas_call + triton CompilerParams)
#   "pallas_tpu"     Mosaic TPU (jax.experimental.pallas.tpu)
IMPLEMENTATIONS = ("reference", "pallas_gpu", "pallas_triton", "pallas_tpu")


def _backend(name: str):
  # Kernel modules are imported on first use so that importing this package stays cheap.
  if name == "reference":
    return paged_attention_reference
  if name == "pallas_gpu":
    from pallas_kernels.paged_attention.gpu import paged_attention_mosaic_gpu
    return paged_attention_mosaic_gpu
  if name == "pallas_triton":
    from pallas_kernels.paged_attention.triton import paged_attention_triton
    return paged_attention_triton
  if name == "pallas_tpu":
    from pallas_kernels.paged_attention.tpu import paged_attention_tpu
    return paged_attention_tpu
  raise ValueError(f"{name=} is not a paged-attention implementation; allowed: {IMPLEMENTATIONS}")


_USED: set[str] = set()


def implementations_used() -> tuple[str, ...]:
  """Backends that ``paged_attention`` dispatched to in this process so far (recorded when
  a call is traced, i.e. once per compiled step shape), sorted. E.g. an f32 model run with
  ``("pallas_gpu", "reference")`` records ``("reference",)``: the Mosaic GPU kernel takes
  bf16/f16 only and raised NotImplementedError."""
  return tuple(sorted(_USED))


def resolve_implementation(implementation: str | Sequence[str]) -> tuple[str, ...]:
  """Validates and normalizes ``implementation`` to a tuple of backend names."""
  names = (implementation,) if isinstance(implementation, str) else tuple(implementation)
  if not names:
    raise ValueError(f"{implementation=} must name at least one of {IMPLEMENTATIONS}")
  for name in names:
    _backend(name)
  return names


def paged_attention(
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
    implementation: str | Sequence[str] = "reference",
) -> jax.Array:
  """Causal paged attention; see ``reference.paged_attention_reference`` for shapes.

  Raises:
    ValueError: unknown implementation name.
    NotImplementedError: no listed implementation supports these shapes.
  """
  errors = []
  for name in resolve_implementation(implementation):
    try:
      out = _backend(name)(
          q, kv_pages, page_indices, kv_lens, q_lens,
          sm_scale=sm_scale, sliding_window=sliding_window, tree_mask=tree_mask,
          positions=positions,
      )
    except NotImplementedError as e:  # only "this backend can't do these shapes"
      errors.append(f"{name}: {e}")
      continue
    _USED.add(name)
    return out
  raise NotImplementedError("no paged-attention implementation accepted the call: " + "; ".join(errors))
