"""Where two greedy outputs of the same prompt part, and how close the target was to a tie.

Greedy SD is lossless in exact arithmetic, but a verify step (T = L + 1 query tokens)
and a decode step (T = 1) reduce in different orders, so in bf16 (or on another
backend) the target's argmax can flip where its top two logits are nearly equal. For a
divergence at output position ``pos`` this module recomputes the target's logits for
the reference context (prompt + reference output[:pos]) and reports the top-2 margin
there: a near-tie (margin of a few bf16 ulps of the logit) is rounding, a large margin
is a bug.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from models.llama import init_kv_caches
from pallas_kernels.paged_attention.metadata import AttentionMetadata
from specjax.steps import SplitModel, forward_step

__all__ = ["Divergence", "first_divergence", "top2_margin", "divergence"]


@dataclasses.dataclass(frozen=True)
class Divergence:
  """One parted pair of outputs.

  Attributes:
    position: first output index where they differ (0-based).
    reference_token: the reference output's token there (-1 if it had ended).
    other_token: the other output's token there (-1 if it had ended).
    top1_token, top2_token: the target's two best tokens for the reference context.
    margin: ``logit[top1] - logit[top2]`` (f32 logits of the target in its dtype).
  """

  position: int
  reference_token: int
  other_token: int
  top1_token: int
  top2_token: int
  margin: float


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
  """First index where two token lists differ (a length difference counts); None if equal.

  Example: ``[5, 6, 7]`` vs ``[5, 6, 9, 1]`` -> 2; ``[5, 6]`` vs ``[5, 6, 7]`` -> 2.
  """
  for i, (x, y) in enumerate(zip(a, b)):
    if x != y:
      return i
  return None if len(a) == len(b) else min(len(a), len(b))


def top2_margin(model: SplitModel, context: Sequence[int], page_size: int = 16
                ) -> tuple[int, int, float]:
  """The target's two best next tokens after ``context`` and their logit margin.

  One uncached forward over the whole context (padded to a power of two >= 16 tokens,
  so nearby lengths share a compile).

  Args:
    model: the target from ``specjax.steps.split_model``.
    context: token ids (prompt + output so far), at least one.
    page_size: KV page size of the scratch cache.

  Returns:
    ``(top1_token, top2_token, margin)`` with margin >= 0 in logit units.

  Raises:
    ValueError: empty context.
  """
  n = len(context)
  if n < 1:
    raise ValueError("context must hold at least one token")
  t_len = 16
  while t_len < n:
    t_len *= 2
  pages = -(-t_len // page_size)
  kv = init_kv_caches(model.config, pages, page_size)
  tokens = np.zeros((1, t_len), np.int32)
  tokens[0, :n] = context
  meta = AttentionMetadata(np.arange(pages, dtype=np.int32)[None], np.array([n], np.int32),
                           np.array([n], np.int32))
  _, logits, _ = forward_step(model.graphdef, model.params, kv, jnp.asarray(tokens), meta,
                              jnp.array([[n - 1]], jnp.int32))
  top = jax.lax.top_k(logits[0, 0].astype(jnp.float32), 2)
  values, ids = np.asarray(top[0]), np.asarray(top[1])
  return int(ids[0]), int(ids[1]), float(values[0] - values[1])


def divergence(model: SplitModel, prompt: Sequence[int], reference: Sequence[int],
               other: Sequence[int]) -> Divergence | None:
  """Where ``other`` parts from ``reference`` (both outputs of ``prompt``), with the
  target's top-2 margin for the reference context there; None if they are equal."""
  pos = first_divergence(reference, other)
  if pos is None:
    return None
  top1, top2, margin = top2_margin(model, list(prompt) + list(reference[:pos]))
  return Divergence(
      position=pos,
      reference_token=int(reference[pos]) if pos < len(reference) else -1,
      other_token=int(other[pos]) if pos < len(other) else -1,
      top1_token=top1, top2_token=top2, margin=margin,
  )
