"""Verification math over the vocabulary: public function and implementation dispatch.

``verify_rows`` returns, for each verified row, the greedy argmax, p(x) and q(x) of the
draft token x and a draw from the residual normalize(max(p - q, 0)) (or from p), in one
sweep over V (see ``reference.py``). ``implementation`` is "reference", a backend name
or a sequence tried in order; only ``NotImplementedError`` moves on to the next one, and
the backend that ran is recorded (:func:`implementations_used`).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax

from pallas_kernels.verify.reference import (
    RowStats,
    gumbel_noise,
    tempered_logits,
    uniform_noise,
    verify_rows_reference,
)

__all__ = ["IMPLEMENTATIONS", "RowStats", "gumbel_noise", "implementations_used",
           "tempered_logits", "uniform_noise", "verify_rows", "verify_rows_reference"]

# "reference": pure jnp (XLA), any platform; "pallas_triton": pl.pallas_call lowered
# through Pallas' Triton backend (CUDA GPUs; CPU with interpret=True).
IMPLEMENTATIONS = ("reference", "pallas_triton")

_USED: set[str] = set()


def implementations_used() -> tuple[str, ...]:
  """Backends that served ``verify_rows`` calls in this process, sorted."""
  return tuple(sorted(_USED))


def verify_rows(
    logits: jax.Array,
    temperature: jax.Array,
    tokens: jax.Array,
    seeds: jax.Array,
    q: jax.Array | None = None,
    *,
    implementation: str | Sequence[str] = "reference",
    interpret: bool = False,
) -> RowStats:
  """Per-row verification statistics (``reference.verify_rows_reference`` contract).

  Args:
    logits: ``f32/bf16[B, T, V]``; temperature ``f32[B]``; tokens ``i32[B, T]`` (-1 =
      none); seeds ``u32[B, T]``; q optional ``f32[B, T - 1, V]``.
    implementation: name or names tried in order (``IMPLEMENTATIONS``).
    interpret: run Pallas backends in interpret mode (CPU tests).

  Raises:
    ValueError: an unknown implementation name (allowed: ``IMPLEMENTATIONS``) or
      mismatched shapes.
    NotImplementedError: no listed implementation accepted the call (each one's reason).
  """
  names = (implementation,) if isinstance(implementation, str) else tuple(implementation)
  errors = []
  for name in names:
    if name == "reference":
      _USED.add(name)
      return verify_rows_reference(logits, temperature, tokens, seeds, q)
    if name == "pallas_triton":
      from pallas_kernels.verify.triton import verify_rows_triton  # noqa: PLC0415
      try:
        out = verify_rows_triton(logits, temperature, tokens, seeds, q, interpret=interpret)
      except NotImplementedError as e:
        errors.append(f"{name}: {e}")
        continue
      _USED.add(name)
      return out
    raise ValueError(f"implementation={name!r} is not a verify implementation; allowed: "
                     f"{IMPLEMENTATIONS}")
  raise NotImplementedError("no verify implementation accepted the call: " + "; ".join(errors))
