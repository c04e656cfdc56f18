"""Goodput pieces shared by the adaptive-length methods (TurboSpec, SV): the start-up
profile of the step cost on this hardware, the ``cost_model`` option's forms, expected
committed tokens, and the per-position acceptance EMA.

The step cost itself is ``specjax.cost_model.CostModel`` (``step_time(batch, query
tokens, KV tokens, draft work)``); the profile fits its goodput form
``specjax.cost_model.StepCostModel``: ``T = verify_base + verify_per_token * num_tokens +
verify_per_kv * kv_tokens + draft_steps * (draft_base + draft_per_row * num_rows)``
seconds, where ``num_tokens`` is the batched verify tokens (rows x (drafts + 1)),
``kv_tokens`` the KV positions the rows read, and ``draft_steps`` the draft forwards (0
for a plain decoding step).
"""

from __future__ import annotations

import time

import jax
import numpy as np

from models.llama import init_kv_caches
from pallas_kernels.paged_attention.metadata import AttentionMetadata
from specjax.cost_model import CostModel, StepCostModel, load
from specjax.steps import forward_step

__all__ = ["cached_profile", "expected_committed", "profile_cost_model",
           "resolve_cost_model", "update_position_ema"]


def resolve_cost_model(cost_model, drafter: str) -> CostModel | None:
  """The ``cost_model`` option of TurboSpec / SV as a ``CostModel`` (None: profile one).

  Args:
    cost_model: a ``CostModel`` (e.g. ``StepCostModel(...)``), the dict of
      ``StepCostModel``'s fields, a ``specjax.cost_model`` preset name or a ``.json`` file
      of ``CostModel.to_json``, or None.
    drafter: the wrapped drafter's method name, whose draft cost the model must have.

  Raises:
    ValueError: an unknown preset or field, a bad coefficient, or no draft cost for
      ``drafter``.
  """
  if cost_model is None or isinstance(cost_model, CostModel):
    cost = cost_model
  elif isinstance(cost_model, dict):
    try:
      cost = StepCostModel(**cost_model)
    except TypeError as e:
      raise ValueError(f"cost_model={cost_model!r} must hold StepCostModel's fields "
                       f"(verify_base, ...): {e}") from None
  elif isinstance(cost_model, str):
    cost = load(cost_model)
  else:
    raise ValueError(f"cost_model={cost_model!r} must be a CostModel, a dict of "
                     "StepCostModel fields, a preset name or a .json file")
  if cost is not None:
    cost.draft(drafter)
  return cost


def expected_committed(survival: np.ndarray) -> float:
  """Expected committed tokens of a row verifying drafts with prefix survival
  probabilities ``survival`` (``a_j = prod_{i<=j} alpha_i``): ``1 + sum_j a_j`` (bonus
  included). Example: alpha = (0.5, 0.5) -> a = (0.5, 0.25) -> 1.75."""
  return 1.0 + float(np.sum(survival))


def update_position_ema(alpha: np.ndarray, num_drafted: int, num_accepted: int,
                        beta: float) -> np.ndarray:
  """Per-position acceptance EMA after one verification (vLLM ``adaptive_k``'s form).

  Position j (1-based) was examined if ``j <= min(num_drafted, num_accepted + 1)`` (the
  chain reached it); its label is 1 if ``j <= num_accepted``. Examined positions move
  ``alpha_j <- (1 - beta) alpha_j + beta * label``; the others keep their value.
  Example: alpha 0.85 everywhere, 3 drafted, 1 accepted, beta 0.3 -> position 1: 0.895,
  position 2: 0.595, positions 3, 4: 0.85.
  """
  alpha = np.asarray(alpha, np.float64).copy()
  examined = min(num_drafted, num_accepted + 1)
  labels = (np.arange(examined) < num_accepted).astype(np.float64)
  alpha[:examined] = (1 - beta) * alpha[:examined] + beta * labels
  return alpha


def _time_call(fn, repeats: int) -> float:
  jax.block_until_ready(fn())  # compile + warm-up
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def _forward_timer(model, rows: int, q_len: int, kv_len: int, page_size: int, implementation):
  pages = -(-kv_len // page_size)
  caches = [init_kv_caches(model.config, rows * pages, page_size)]
  table = np.arange(rows * pages, dtype=np.int32).reshape(rows, pages)
  meta = AttentionMetadata(table, np.full(rows, kv_len, np.int32), np.full(rows, q_len, np.int32))
  tokens = np.zeros((rows, q_len), np.int32)
  idx = np.broadcast_to(np.arange(q_len, dtype=np.int32), (rows, q_len))

  def call():
    caches[0], logits, _ = forward_step(model.graphdef, model.params, caches[0], tokens, meta,
                                        idx, implementation=implementation)
    return logits

  return call


def profile_cost_model(runtime, k: int, *, rows=(1, 8), context: int = 512,
                       repeats: int = 5) -> CostModel:
  """Fits ``specjax.cost_model.StepCostModel`` on this hardware by timing the target's
  (and draft's) forward at a few shapes: rows x (1 or k + 1) query tokens at KV lengths
  ``context / 4`` and ``context`` (capped at ``max_model_len``); median of ``repeats`` after a warm-up,
  least squares, negative fitted coefficients set to 0 (timing noise). Draft cost is
  profiled only when a draft model is loaded (host drafters and heads cost 0 here).
  Runs at every ``init_state`` (each ``Engine.generate``), before the timed window; the
  compiled shapes are reused, so later profiles cost only the timed calls.
  """
  ctx = min(context, runtime.max_model_len)
  impl = runtime.attention_implementation
  xs, ys = [], []
  for r in rows:
    for q in (1, k + 1):
      for kv in (max(q, ctx // 4), ctx):
        t = _time_call(_forward_timer(runtime.target, r, q, kv, runtime.page_size, impl), repeats)
        xs.append([1.0, r * q, r * kv])
        ys.append(t)
  coef = np.linalg.lstsq(np.asarray(xs), np.asarray(ys), rcond=None)[0]
  base, per_tok, per_kv = (max(float(c), 0.0) for c in coef)
  draft_base = draft_row = 0.0
  if runtime.draft is not None:
    dt = [_time_call(_forward_timer(runtime.draft, r, 1, ctx, runtime.page_size, impl), repeats)
          for r in rows]
    draft_row = max((dt[-1] - dt[0]) / max(rows[-1] - rows[0], 1), 0.0)
    draft_base = max(dt[0] - draft_row * rows[0], 0.0)
  return StepCostModel(verify_base=max(base, 1e-9), verify_per_token=per_tok,
                       verify_per_kv=per_kv, draft_base=draft_base, draft_per_row=draft_row)


def cached_profile(method, runtime, k: int, context: int) -> CostModel:
  """``profile_cost_model`` once per (method instance, target, draft): ``init_state``
  runs at every ``Engine.generate``, the profile need not. Kept on the instance."""
  key = (id(runtime.target.params), id(runtime.draft.params) if runtime.draft else None,
         runtime.attention_implementation, k, context)
  cache = method.__dict__.setdefault("_profiles", {})
  if key not in cache:
    cache[key] = profile_cost_model(runtime, k, context=context)
  return cache[key]
