"""N-gram prompt lookup on the device: pure jnp, jittable, batched.

Gives exactly the drafts of the host oracle ``methods.ngram.ngram_lookup`` (budgets
applied as ``NGram.propose`` does), for every row of a fixed-shape token history at once.

Formulation. Index a candidate window by its END position ``e`` (its start is
``i = e - n + 1``). With ``len`` the row's token count, the window ending at ``e``
matches the length-n suffix iff ``history[e - t] == history[len - 1 - t]`` for all
``t < n``. Writing ``eq_t[e]`` for that single comparison, the match for n is
``AND_{t < n} eq_t[e]``: a running AND over ``t``, so all n in ``1..n_max`` cost
``n_max`` compares of ``[B, M]`` (not ``sum(n)``). The host's candidates
``0 <= i <= len - 1 - n`` are ``n - 1 <= e <= len - 2``; the latest match is the largest
such ``e``, and the draft starts at ``e + 1`` whatever n matched. Larger n win.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["ngram_lookup_device"]


def ngram_lookup_device(
    history: jax.Array,
    num_tokens: jax.Array,
    budgets: jax.Array,
    *,
    k: int,
    n_min: int,
    n_max: int,
) -> tuple[jax.Array, jax.Array]:
  """Prompt-lookup drafts for a batch of rows (``M`` = history capacity per row).

  Args:
    history: ``i32[B, M]``; row b's tokens at positions ``0..num_tokens[b]-1``; entries
      after them are ignored (any int, including -1).
    num_tokens: ``i32[B]``, tokens per row (``0`` = inactive row); clipped to ``[0, M]``.
    budgets: ``i32[B]``, most drafts per row; ``<= 0`` gives no drafts.
    k: static, the draft width (``>= 1``).
    n_min: static, smallest n-gram size (``>= 1``).
    n_max: static, largest n-gram size (``>= n_min``).

  Returns:
    ``(drafts i32[B, k], num i32[B])``: ``num[b]`` equals
    ``len(ngram_lookup(history[b, :num_tokens[b]], n_min, n_max, min(k, budgets[b])))``
    (0 where the budget is ``<= 0``), ``drafts[b, :num[b]]`` are those tokens and the
    rest of the row is -1.
  """
  if k < 1:
    raise ValueError(f"k={k} must be >= 1")
  if not 1 <= n_min <= n_max:
    raise ValueError(f"n_min={n_min}, n_max={n_max} must satisfy 1 <= n_min <= n_max")
  history = jnp.asarray(history, jnp.int32)
  rows, capacity = history.shape
  length = jnp.clip(jnp.asarray(num_tokens, jnp.int32), 0, capacity)  # i32[B]
  ends = jnp.arange(capacity, dtype=jnp.int32)[None, :]  # i32[1, M]
  # A row of length len admits n <= len - 1 <= capacity - 1: larger n never match.
  n_top = min(n_max, capacity - 1)

  running = jnp.ones((rows, capacity), jnp.bool_)  # AND_{t' < t} eq_t'
  best_end = jnp.full((rows,), -1, jnp.int32)  # end of the latest match of the largest n
  for t in range(n_top):
    # eq_t[b, e] = history[b, e - t] == history[b, len - 1 - t]; e < t is padding, and
    # is masked below since e >= n - 1 >= t (which also keeps len - 1 - t >= 1).
    shifted = jnp.pad(history[:, : capacity - t], ((0, 0), (t, 0)), constant_values=-1)
    suffix_token = jnp.take_along_axis(
        history, jnp.clip(length - 1 - t, 0, capacity - 1)[:, None], axis=1)  # i32[B, 1]
    running = running & (shifted == suffix_token)
    n = t + 1
    if n < n_min:
      continue
    valid = running & (ends >= n - 1) & (ends <= (length - 2)[:, None])
    latest = jnp.max(jnp.where(valid, ends, -1), axis=1)  # i32[B], -1 = no match
    best_end = jnp.where(latest >= 0, latest, best_end)

  start = best_end + 1  # i32[B], first drafted position (0 = no match)
  kk = jnp.clip(jnp.asarray(budgets, jnp.int32), 0, k)
  num = jnp.where(best_end >= 0, jnp.minimum(kk, length - start), 0).astype(jnp.int32)
  offsets = jnp.arange(k, dtype=jnp.int32)[None, :]  # i32[1, k]
  positions = jnp.clip(start[:, None] + offsets, 0, capacity - 1)
  tokens = jnp.take_along_axis(history, positions, axis=1)
  drafts = jnp.where(offsets < num[:, None], tokens, -1).astype(jnp.int32)
  return drafts, num
