"""Step-time cost model of SD on one device: target forward, drafting, per-step overhead.

All times are seconds. One engine step of R rows, row r verifying ``l_r`` drafts, costs

  target(kv, q)      = fixed_s + per_query_token_s * q + per_kv_token_s * kv
  draft_m(R_m, L, kv, verify_s)
                     = 0 when no row of method m drafts, else
                       fixed_s + per_row_s * R_m + per_step_s * L + per_row_token_s * R_m * L
                       + per_kv_token_s * kv + verify_fraction * verify_s
  overhead           = ar_step_s + ar_per_row_s * R                        (plain decoding)
                     = sd_step_s + sd_per_row_s * R + sd_per_row_token_s * R * L   (SD)
  switch             = switch_s per row whose method differs from its previous step's

with q the verified query tokens (``query_padding="ragged"``: sum of ``l_r + 1``;
``"engine"``: this project's padded step, ``bucket(R) * (bucket(max l_r) + 1)``, see
``specjax.engine``), kv the KV tokens of all rows at the step's start, L = max l_r over
the method's rows and R_m its drafting rows.

Two sources:
  * ``preset("seed-llama8b-h100")``: the seed paper's linear H100 model for
    Llama-3.1-8B (SpecDecode-Bench/simulator ``predictor.py``, class ``Llama8BH100``,
    "fitted with instructcoder bs=1,8,16,32,64"; methods_reference.md 1.7). Every
    coefficient of that class is here: target 3.92645679e-8 s per KV token,
    2.10103129e-5 s per batched token, 5.88590713e-3 s fixed; EAGLE drafting
    2.37768493e-9 s per KV token + 8.41429603e-7 s per "num_spec_tokens" + 2.13526175e-3 s;
    n-gram drafting 0.005875 x the verify time; 1.20683946e-3 s overhead per step; zero
    switching cost. The seed charges EAGLE with num_spec_tokens = verify input length
    (l + 1), here ``per_step_s * L`` with the extra 8.41e-7 s folded into ``fixed_s``;
    the seed also charges EAGLE on steps that draft nothing, here such steps are free.
    The seed has no separate AR overhead: AR and SD steps both pay 1.2068 ms.
  * ``fit(...)``: least squares (``scipy.optimize.nnls``, coefficients >= 0, rows
    weighted by 1 / measured time so every point counts by its relative error) on this
    project's own timings: ``benchmarks.engine_loop`` CSVs (target forward from the
    profiled ``device_ms``; overheads from ``step_ms - device_ms`` of AR rows, L = 0,
    and SD rows) and ``harness.evaluation`` ``results.csv`` files (per-method
    ``draft_ms`` against ``batch_size`` and ``k``); the target's query tokens are the
    engine's padded ``bucket(B) * (bucket(L) + 1)``. The JSON records the device, JAX
    version, dtype, target and files it came from, and per-part fit errors.
"""

from __future__ import annotations

import dataclasses
import json
import platform

import numpy as np

__all__ = ["CostModel", "DraftCost", "OverheadCost", "PRESETS", "TargetCost", "fit",
           "load", "preset"]


def _bucket(n: int) -> int:
  """Next power of two >= n (the engine's batch and draft-length buckets), 0 for 0."""
  return 0 if n <= 0 else 1 << (int(n) - 1).bit_length()


@dataclasses.dataclass(frozen=True, kw_only=True)
class TargetCost:
  """Target forward time: ``fixed_s + per_query_token_s * q + per_kv_token_s * kv``."""

  fixed_s: float
  per_query_token_s: float
  per_kv_token_s: float

  def time(self, kv_tokens: float, query_tokens: float) -> float:
    return self.fixed_s + self.per_query_token_s * query_tokens + self.per_kv_token_s * kv_tokens


@dataclasses.dataclass(frozen=True, kw_only=True)
class DraftCost:
  """One method's drafting time per step (module docstring); zero when nobody drafts."""

  fixed_s: float = 0.0
  per_row_s: float = 0.0
  per_step_s: float = 0.0
  per_row_token_s: float = 0.0
  per_kv_token_s: float = 0.0
  verify_fraction: float = 0.0

  def time(self, rows: int, length: int, kv_tokens: float, verify_s: float) -> float:
    if rows <= 0 or length <= 0:
      return 0.0
    return (self.fixed_s + self.per_row_s * rows + self.per_step_s * length
            + self.per_row_token_s * rows * length + self.per_kv_token_s * kv_tokens
            + self.verify_fraction * verify_s)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OverheadCost:
  """Host time per step outside the target forward and drafting."""

  ar_step_s: float = 0.0
  ar_per_row_s: float = 0.0
  sd_step_s: float = 0.0
  sd_per_row_s: float = 0.0
  sd_per_row_token_s: float = 0.0

  def ar(self, rows: int) -> float:
    return self.ar_step_s + self.ar_per_row_s * rows

  def sd(self, rows: int, length: int) -> float:
    return self.sd_step_s + self.sd_per_row_s * rows + self.sd_per_row_token_s * rows * length


@dataclasses.dataclass(frozen=True, kw_only=True)
class CostModel:
  """Target, per-method draft and overhead costs, and where they were measured.

  Attributes:
    name: a label.
    target: ``TargetCost``.
    drafts: method name (``methods.registry`` name) -> ``DraftCost``.
    overhead: ``OverheadCost``.
    switch_s: cost per row that changes method between steps (oracle combinations).
    query_padding: "ragged" (q = sum of l_r + 1) or "engine" (padded buckets).
    prefill_emits_token: True if the prefill forward samples output token 0 (vLLM, the
      seed: decoding starts at position 1); False for ``specjax.engine``, whose prefill
      leaves the last prompt token pending, so the first decode step makes token 0.
    meta: device, versions, sources and fit statistics (free-form, JSON).
  """

  name: str
  target: TargetCost
  drafts: dict
  overhead: OverheadCost
  switch_s: float = 0.0
  query_padding: str = "ragged"
  prefill_emits_token: bool = True
  meta: dict = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    if self.query_padding not in ("ragged", "engine"):
      raise ValueError(f"query_padding={self.query_padding!r} must be 'ragged' or 'engine'")
    if self.switch_s < 0:
      raise ValueError(f"switch_s={self.switch_s} must be >= 0")

  def draft(self, method: str) -> DraftCost:
    """The draft cost of ``method``. Raises ValueError (naming the known ones) if absent."""
    if method not in self.drafts:
      raise ValueError(f"cost model {self.name!r} has no draft cost for {method=}; it has "
                       f"{sorted(self.drafts)}")
    return self.drafts[method]

  def query_tokens(self, lengths) -> int:
    """Verified query tokens of a step whose rows verify ``lengths`` drafts."""
    lengths = np.asarray(lengths, np.int64)
    if lengths.size == 0:
      return 0
    if self.query_padding == "ragged":
      return int(np.sum(lengths + 1))
    return _bucket(lengths.size) * (_bucket(int(lengths.max())) + 1)

  def with_switch(self, switch_s: float) -> CostModel:
    return dataclasses.replace(self, switch_s=switch_s)

  def to_json(self) -> str:
    return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

  @classmethod
  def from_json(cls, text: str) -> CostModel:
    d = json.loads(text)
    return cls(name=d["name"], target=TargetCost(**d["target"]),
               drafts={k: DraftCost(**v) for k, v in d["drafts"].items()},
               overhead=OverheadCost(**d["overhead"]), switch_s=d.get("switch_s", 0.0),
               query_padding=d.get("query_padding", "ragged"),
               prefill_emits_token=d.get("prefill_emits_token", True), meta=d.get("meta", {}))


_SEED_EAGLE = DraftCost(fixed_s=2.13526175e-3 + 8.41429603e-7, per_step_s=8.41429603e-7,
                        per_kv_token_s=2.37768493e-9)
PRESETS: dict[str, CostModel] = {
    "seed-llama8b-h100": CostModel(
        name="seed-llama8b-h100",
        target=TargetCost(fixed_s=5.88590713e-3, per_query_token_s=2.10103129e-5,
                          per_kv_token_s=3.92645679e-8),
        drafts={"ngram": DraftCost(verify_fraction=0.005875), "eagle": _SEED_EAGLE,
                "eagle3": _SEED_EAGLE},
        overhead=OverheadCost(ar_step_s=1.20683946e-3, sd_step_s=1.20683946e-3),
        switch_s=0.0, query_padding="ragged",
        meta={"device": "NVIDIA H100", "target": "Llama-3.1-8B-Instruct", "engine": "vLLM",
              "source": "SpecDecode-Bench/simulator predictor.py Llama8BH100 (2fdccbd)"}),
}


def preset(name: str) -> CostModel:
  if name not in PRESETS:
    raise ValueError(f"cost model preset {name=} is unknown; presets: {sorted(PRESETS)}")
  return PRESETS[name]


def load(name_or_path: str) -> CostModel:
  """A preset name or a JSON file written by ``CostModel.to_json``."""
  if name_or_path in PRESETS:
    return PRESETS[name_or_path]
  if not name_or_path.endswith(".json"):
    raise ValueError(f"cost model {name_or_path!r} must be a preset ({sorted(PRESETS)}) or a "
                     ".json file")
  with open(name_or_path) as f:
    return CostModel.from_json(f.read())


# ---------------------------------------------------------------------- fitting
def _nnls(features: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, dict]:
  """Non-negative least squares weighted by 1/y; returns coefs and fit statistics."""
  from scipy.optimize import nnls  # noqa: PLC0415

  w = 1.0 / y
  coef, _ = nnls(features * w[:, None], y * w)
  rel = features @ coef / y - 1.0
  return coef, {"num_points": int(y.size), "rms_rel_error": float(np.sqrt(np.mean(rel**2))),
                "max_abs_rel_error": float(np.max(np.abs(rel)))}


def _single(frame, column: str):
  values = sorted({str(v) for v in frame[column].dropna()}) if column in frame else []
  return values[0] if len(values) == 1 else values


def fit(engine_loop_frames, eval_frames=(), *, new_tokens: int = 64, name: str = "fitted",
        switch_s: float = 0.0) -> CostModel:
  """Fits a ``CostModel`` (module docstring) from this project's timings.

  Args:
    engine_loop_frames: ``benchmarks.engine_loop`` CSVs as DataFrames (columns batch,
      context, L, step_ms, device_ms, ...); rows of one target shape and dtype.
    eval_frames: ``harness.evaluation`` results as DataFrames (method, batch_size, k,
      draft_ms); every method but ``ar`` gets a draft cost.
    new_tokens: tokens each engine-loop request generated (its ``--new_tokens``; the
      CSV does not record it): the mean KV per row is ``context + new_tokens / 2``.

  Raises:
    ValueError: no engine-loop rows with a finite ``device_ms``, or more than one target.
  """
  import pandas as pd  # noqa: PLC0415
  import scipy  # noqa: PLC0415

  loop = pd.concat(list(engine_loop_frames), ignore_index=True)
  loop = loop[np.isfinite(loop.device_ms) & np.isfinite(loop.step_ms)]
  if loop.empty:
    raise ValueError("engine_loop_frames must hold rows with finite device_ms (run "
                     "benchmarks.engine_loop with --profile)")
  if loop.target.nunique() != 1 or loop.dtype.nunique() != 1:
    raise ValueError(f"engine_loop_frames must be of one target and dtype, got "
                     f"{sorted(set(zip(loop.target, loop.dtype)))}")
  batch = loop.batch.to_numpy(float)
  length = loop.L.to_numpy(float)
  kv = batch * (loop.context.to_numpy(float) + new_tokens / 2)
  # The engine verifies a padded [bucket(B), bucket(L) + 1] block (query_padding="engine").
  q = np.asarray([_bucket(int(b)) * (_bucket(int(v)) + 1) for b, v in zip(batch, length)],
                 float)
  device_s = loop.device_ms.to_numpy(float) / 1e3
  ones = np.ones_like(batch)
  coef, target_stats = _nnls(np.stack([ones, q, kv], 1), device_s)
  target = TargetCost(fixed_s=coef[0], per_query_token_s=coef[1], per_kv_token_s=coef[2])

  host_s = np.maximum(loop.step_ms.to_numpy(float) / 1e3 - device_s, 1e-6)
  ar, sd = length == 0, length > 0
  stats = {"target": target_stats}
  ar_coef = np.zeros(2)
  if ar.any():
    ar_coef, stats["ar_overhead"] = _nnls(np.stack([ones[ar], batch[ar]], 1), host_s[ar])
  sd_coef = np.zeros(3)
  if sd.any():
    sd_coef, stats["sd_overhead"] = _nnls(
        np.stack([ones[sd], batch[sd], batch[sd] * length[sd]], 1), host_s[sd])
  overhead = OverheadCost(ar_step_s=ar_coef[0], ar_per_row_s=ar_coef[1], sd_step_s=sd_coef[0],
                          sd_per_row_s=sd_coef[1], sd_per_row_token_s=sd_coef[2])

  drafts = {}
  evals = pd.concat(list(eval_frames), ignore_index=True) if len(eval_frames) else None
  draft_sources = {}
  if evals is not None:
    for method, g in evals[evals.method != "ar"].groupby("method"):
      g = g[np.isfinite(g.draft_ms) & (g.draft_ms > 0)]
      if g.empty:
        continue
      drafts[method], stats[f"draft_{method}"] = _fit_draft(g)
      draft_sources[method] = {"model": _single(g, "model"), "draft": _single(g, "draft"),
                               "device": _single(g, "device")}
  meta = {
      "device": _single(loop, "device"), "jax_version": _single(loop, "jax_version"),
      "backend": _single(loop, "backend"), "target": _single(loop, "target"),
      "dtype": _single(loop, "dtype"),
      "attention_implementation": _single(loop, "attention_implementation"),
      "engine": "specjax", "new_tokens": new_tokens, "fit": stats,
      "draft_sources": draft_sources, "numpy": np.__version__, "scipy": scipy.__version__,
      "python": platform.python_version(),
  }
  return CostModel(name=name, target=target, drafts=drafts, overhead=overhead,
                   switch_s=switch_s, query_padding="engine", prefill_emits_token=False,
                   meta=meta)


def _fit_draft(g) -> tuple[DraftCost, dict]:
  """Draft cost from (batch_size, k, draft_ms) points, with the terms the points identify:
  one point: time proportional to L; several batches, one k: fixed + per row; one batch,
  several k: fixed + per draft position; both: fixed + per row + per position (+ per
  row x position with >= 4 points)."""
  rows = g.batch_size.to_numpy(float)
  length = g.k.to_numpy(float)
  y = g.draft_ms.to_numpy(float) / 1e3
  ones = np.ones_like(rows)
  varied_rows, varied_len = len(set(rows)) > 1, len(set(length)) > 1
  if not varied_rows and not varied_len:
    names, cols = ["per_step_s"], [length]
  elif varied_rows and not varied_len:
    names, cols = ["fixed_s", "per_row_s"], [ones, rows]
  elif varied_len and not varied_rows:
    names, cols = ["fixed_s", "per_step_s"], [ones, length]
  else:
    names, cols = ["fixed_s", "per_row_s", "per_step_s"], [ones, rows, length]
    if y.size >= 4:
      names.append("per_row_token_s")
      cols.append(rows * length)
  coef, stats = _nnls(np.stack(cols, 1), y)
  stats["terms"] = names
  return DraftCost(**dict(zip(names, (float(c) for c in coef)))), stats
