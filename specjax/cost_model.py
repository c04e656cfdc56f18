"""The step-cost model: seconds of one engine step T(batch, query tokens, KV tokens, draft work).

Used by the bound simulator (``harness.simulator``, ``harness.seed_simulator``), goodput
control (``methods.turbospec``, ``methods.sv``) and verify skipping
(``methods.verify_skip``); fitted from measurements by ``harness.cost_fit.fit``
(``experiments/fit_cost_model.py``), loaded with ``load`` from a preset name or a JSON file.

All times are seconds, all counts tokens or rows (Python or numpy numbers). One step of
B rows, row r verifying ``l_r`` drafts, costs ``CostModel.step_time``:

  target(B, q, kv)   = fixed_s + per_row_s * B + per_query_token_s * max(q - query_knee, 0)
                       + per_kv_token_s * kv
                     (or, with ``query_segments``, a piecewise-linear query term in
                     place of the ``per_query_token_s`` one: ``TargetCost``)
  draft_m(R_m, L_m, kv, verify_s)
                     = 0 when no row of method m drafts, else
                       fixed_s + per_row_s * R_m + per_step_s * L_m + per_row_token_s * R_m * L_m
                       + per_kv_token_s * kv + verify_fraction * verify_s
  overhead           = ar_step_s + ar_per_row_s * B                        (plain decoding)
                     = sd_step_s + sd_per_row_s * B + sd_per_row_token_s * B * L   (SD)
  switch             = switch_s per row whose method differs from its previous step's

with q the verified query tokens (``query_padding="ragged"``: sum of ``l_r + 1``;
``"engine"``: this project's padded step, ``bucket(B) * (min(bucket(max l_r), k) + 1)``
with the method's k, see ``specjax.engine``), kv the KV tokens of all rows at the step's
start, L = max l_r, R_m and L_m the rows drafting with method m and their longest draft
(the draft work).
``CostModel.verify_time(B, L)`` is the step of B rows that each verify L drafts, no draft
work: the T(B, L) verify skipping compares lengths with.

Sources and constructors:
  * ``preset("seed-llama8b-h100")``: the seed paper's linear H100 model for
    Llama-3.1-8B (SpecDecode-Bench/simulator ``predictor.py``, class ``Llama8BH100``,
    "fitted with instructcoder bs=1,8,16,32,64"; methods_reference.md 1.7). Every
    coefficient of that class is here: target 3.92645679e-8 s per KV token,
    2.10103129e-5 s per batched token, 5.88590713e-3 s fixed; EAGLE drafting
    2.37768493e-9 s per KV token + 8.41429603e-7 s per "num_spec_tokens" + 2.13526175e-3 s;
    n-gram drafting 0.005875 x the verify time; 1.20683946e-3 s overhead per step; zero
    switching cost. The seed charges EAGLE with num_spec_tokens = verify input length
    (l + 1), here ``per_step_s * L`` with the extra 8.41e-7 s folded into ``fixed_s``;
    the seed also charges EAGLE on steps that draft nothing, here such steps are free
    (``DraftCost.time(..., charge_idle=True)`` charges them, as ``harness.seed_simulator``
    does). The seed has no separate AR overhead: AR and SD steps both pay 1.2068 ms.
  * ``harness.cost_fit.fit``: least squares on this project's engine-loop and evaluation
    timings (JSON written by ``CostModel.to_json``).
  * ``StepCostModel(verify_base=..., ...)``: the goodput methods' five coefficients (the
    profile ``methods.goodput.profile_cost_model`` measures at start-up).
  * ``LinearVerifyCost(fixed_s=..., per_row_s=..., per_token_s=...)``: verify skipping's
    linear prior for the whole engine step.
  * ``TableVerifyCost``: measured step seconds on a (B, L) grid, for verify skipping only
    (not linear, so not a ``CostModel``; any callable ``(batch, length) -> seconds`` works
    there).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

__all__ = ["ANY_METHOD", "PRESETS", "CostModel", "DraftCost", "LinearVerifyCost",
           "OverheadCost", "StepCost", "StepCostModel", "TableVerifyCost", "TargetCost",
           "bucket", "load", "preset", "segment_widths"]

ANY_METHOD = "*"
"""Key of ``CostModel.drafts`` whose draft cost applies to every method not listed."""


def bucket(n: int) -> int:
  """Next power of two >= n (the engine's batch and draft-length buckets), 0 for 0."""
  return 0 if n <= 0 else 1 << (int(n) - 1).bit_length()


def segment_widths(query_tokens, starts) -> np.ndarray:
  """How many of ``query_tokens`` fall in each segment ``[starts[j], starts[j + 1])`` (the
  last open-ended): ``clip(q - start_j, 0, start_{j+1} - start_j)``, f64 of shape
  ``shape(query_tokens) + (len(starts),)``; the piecewise query term is this times the
  slopes (``TargetCost``), and ``harness.cost_fit`` fits the slopes on it."""
  q = np.asarray(query_tokens, float)[..., None]
  lo = np.asarray(starts, float)
  hi = np.append(lo[1:], np.inf)
  return np.clip(q - lo, 0.0, hi - lo)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TargetCost:
  """Target forward seconds: ``fixed_s + per_row_s * rows + query term + per_kv_token_s *
  kv`` (module docstring).

  The query term is ``per_query_token_s * max(q - query_knee, 0)``, or, when
  ``query_segments`` is given, piecewise linear in q: ``sum_j slope_j * clip(q - start_j,
  0, start_{j+1} - start_j)`` over ``query_segments = ((start_0, slope_0), (start_1,
  slope_1), ...)`` (tokens, seconds per token; the last segment is open-ended).

  ``query_knee`` (tokens, default 0: linear in q, the seed's form) is where the forward
  stops being bound by reading the weights: below it more query tokens ride along with
  the weight read for free (a roofline's flat part), above it each costs
  ``per_query_token_s`` (its compute-bound slope). Segments follow a forward whose cost
  per query token changes with the token count for other reasons (the matmul kernels
  XLA picks for a small token count: on an H100 the 8B forward's 36th query token cost
  twice the 144th, ``docs/gpu/cost_model_check/README.md``). ``harness.cost_fit.fit``
  chooses the knee (``query_model="knee"``) or fits segments (``"segments"``).

  Raises:
    ValueError: ``query_knee`` < 0; ``query_segments`` not finite, whose starts are not
      increasing from >= 0, with a negative slope, or given together with a nonzero
      ``per_query_token_s`` or ``query_knee``.
  """

  fixed_s: float
  per_query_token_s: float
  per_kv_token_s: float
  per_row_s: float = 0.0
  query_knee: float = 0.0
  query_segments: tuple = ()

  def __post_init__(self):
    if self.query_knee < 0:
      raise ValueError(f"query_knee={self.query_knee} must be >= 0 (query tokens)")
    segments = tuple((float(a), float(b)) for a, b in self.query_segments)
    object.__setattr__(self, "query_segments", segments)  # lists from JSON -> tuples
    if not segments:
      return
    starts = [a for a, _ in segments]
    if not np.all(np.isfinite(segments)) or starts[0] < 0 or any(
        b <= a for a, b in zip(starts, starts[1:])) or any(slope < 0 for _, slope in segments):
      raise ValueError(f"query_segments={segments} must be finite (start tokens, seconds "
                       "per token) pairs with starts increasing from >= 0 and slopes >= 0")
    if self.per_query_token_s or self.query_knee:
      raise ValueError(f"query_segments given with per_query_token_s="
                       f"{self.per_query_token_s}, query_knee={self.query_knee}: give "
                       "segments or a slope and knee, not both")

  def query_time(self, query_tokens):
    """Seconds of the query term for ``query_tokens`` tokens (a number, or an array for a
    sequence)."""
    if np.ndim(query_tokens):
      query_tokens = np.asarray(query_tokens, float)
    if not self.query_segments:
      if self.query_knee:
        query_tokens = np.maximum(np.asarray(query_tokens, float) - self.query_knee, 0.0)
      return self.per_query_token_s * query_tokens
    starts, slopes = zip(*self.query_segments)
    total = segment_widths(query_tokens, starts) @ np.asarray(slopes)
    return float(total) if np.ndim(total) == 0 else total

  def time(self, kv_tokens, query_tokens, rows=0):
    """Seconds (float, or an array if an argument is one) of a forward of ``rows`` rows,
    ``query_tokens`` tokens in all, reading ``kv_tokens`` KV positions in all."""
    return (self.fixed_s + self.per_row_s * rows + self.query_time(query_tokens)
            + self.per_kv_token_s * kv_tokens)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DraftCost:
  """One method's drafting seconds per step (module docstring); zero when nobody drafts."""

  fixed_s: float = 0.0
  per_row_s: float = 0.0
  per_step_s: float = 0.0
  per_row_token_s: float = 0.0
  per_kv_token_s: float = 0.0
  verify_fraction: float = 0.0

  def time(self, rows, length, kv_tokens, verify_s, *, charge_idle: bool = False):
    """Seconds of ``rows`` rows drafting up to ``length`` tokens over ``kv_tokens`` KV
    positions in a step whose target forward takes ``verify_s``. 0.0 if ``rows <= 0`` or
    ``length <= 0`` unless ``charge_idle`` (the seed's rule; then arrays are allowed)."""
    if not charge_idle and (rows <= 0 or length <= 0):
      return 0.0
    return (self.fixed_s + self.per_row_s * rows + self.per_step_s * length
            + self.per_row_token_s * rows * length + self.per_kv_token_s * kv_tokens
            + self.verify_fraction * verify_s)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OverheadCost:
  """Host seconds per step outside the target forward and drafting."""

  ar_step_s: float = 0.0
  ar_per_row_s: float = 0.0
  sd_step_s: float = 0.0
  sd_per_row_s: float = 0.0
  sd_per_row_token_s: float = 0.0

  def ar(self, rows):
    return self.ar_step_s + self.ar_per_row_s * rows

  def sd(self, rows, length):
    return self.sd_step_s + self.sd_per_row_s * rows + self.sd_per_row_token_s * rows * length


class StepCost(NamedTuple):
  """The parts of one step's seconds; ``total`` is their sum."""

  verify_s: float
  draft_s: float
  overhead_s: float
  switch_s: float

  @property
  def total(self) -> float:
    return self.verify_s + self.draft_s + self.overhead_s + self.switch_s


@dataclasses.dataclass(frozen=True, kw_only=True)
class CostModel:
  """Target, per-method draft and overhead costs, and where they were measured.

  Attributes:
    name: a label.
    target: ``TargetCost``.
    drafts: method name (``methods.registry`` name, or ``ANY_METHOD``) -> ``DraftCost``.
    overhead: ``OverheadCost``.
    switch_s: cost per row that changes method between steps (oracle combinations).
    query_padding: "ragged" (q = sum of l_r + 1) or "engine" (padded buckets).
    prefill_emits_token: True if the prefill forward samples output token 0 (vLLM, the
      seed: decoding starts at position 1); False for ``specjax.engine``, whose prefill
      leaves the last prompt token pending, so the first decode step makes token 0.
    meta: device, versions, sources and fit statistics (free-form, JSON).

  Raises:
    ValueError: ``query_padding`` not "ragged" / "engine", ``switch_s`` < 0, a ``drafts``
      value not a ``DraftCost``.
  """

  name: str
  target: TargetCost
  drafts: dict
  overhead: OverheadCost = OverheadCost()
  switch_s: float = 0.0
  query_padding: str = "ragged"
  prefill_emits_token: bool = True
  meta: dict = dataclasses.field(default_factory=dict, repr=False)

  def __post_init__(self):
    if self.query_padding not in ("ragged", "engine"):
      raise ValueError(f"query_padding={self.query_padding!r} must be 'ragged' or 'engine'")
    if self.switch_s < 0:
      raise ValueError(f"switch_s={self.switch_s} must be >= 0")
    bad = {k: v for k, v in self.drafts.items() if not isinstance(v, DraftCost)}
    if bad:
      raise ValueError(f"drafts={bad!r} must map method names to DraftCost")

  def __hash__(self):  # methods holding a cost model stay hashable (static jit arguments)
    return hash(self.to_json())

  def draft(self, method: str) -> DraftCost:
    """The draft cost of ``method`` (else the ``ANY_METHOD`` one). Raises ValueError
    (naming the known ones) if neither is present."""
    if method in self.drafts:
      return self.drafts[method]
    if ANY_METHOD in self.drafts:
      return self.drafts[ANY_METHOD]
    raise ValueError(f"cost model {self.name!r} has no draft cost for {method=}; it has "
                     f"{sorted(self.drafts)}")

  def query_tokens(self, lengths, k: int | None = None) -> int:
    """Verified query tokens of a step whose rows verify ``lengths`` (ints) drafts.

    ``k``: the step's most drafts (the method's k), where the engine's draft-length
    buckets stop (``specjax.batch.bucket(n, cap=k)``: k = 5 verifies 5 + 1 query tokens a
    row, not bucket(5) + 1 = 9); None: no cap. Only ``query_padding="engine"`` reads it.

    Raises:
      ValueError: ``lengths`` not a 1-D sequence of integers >= 0, ``k`` not an integer
        >= 0, or a length above ``k``.
    """
    raw = np.asarray(lengths)
    if raw.ndim != 1 or (raw.size and (not np.issubdtype(raw.dtype, np.integer)
                                       or raw.min() < 0)):
      raise ValueError(f"lengths={raw.tolist()} must be a 1-D sequence of integers >= 0")
    if k is not None and (isinstance(k, bool) or not isinstance(k, (int, np.integer))
                          or k < 0):
      raise ValueError(f"k={k!r} must be an integer >= 0 or None")
    lengths = raw.astype(np.int64)
    if lengths.size == 0:
      return 0
    if k is not None and int(lengths.max()) > k:
      raise ValueError(f"lengths up to {int(lengths.max())} exceed the step's k={k}")
    if self.query_padding == "ragged":
      return int(np.sum(lengths + 1))
    width = bucket(int(lengths.max()))
    return bucket(lengths.size) * ((width if k is None else min(width, k)) + 1)

  def step_parts(self, batch: int, query_tokens: int, kv_tokens: float,
                 drafts: Mapping[str, tuple[int, int]] | None = None, *,
                 length: int | None = None, speculative: bool | None = None,
                 switches: int = 0) -> StepCost:
    """The parts of ``step_time`` (same arguments)."""
    verify = self.target.time(kv_tokens, query_tokens, batch)
    drafts = drafts or {}
    draft = sum(self.draft(m).time(r, n, kv_tokens, verify) for m, (r, n) in drafts.items())
    if length is None:
      length = max((n for r, n in drafts.values() if r > 0), default=0)
    if speculative is None:
      speculative = length > 0
    overhead = self.overhead.sd(batch, length) if speculative else self.overhead.ar(batch)
    return StepCost(verify, draft, overhead, switches * self.switch_s)

  def step_time(self, batch: int, query_tokens: int, kv_tokens: float,
                drafts: Mapping[str, tuple[int, int]] | None = None, *,
                length: int | None = None, speculative: bool | None = None,
                switches: int = 0) -> float:
    """Seconds of one step (module docstring).

    Args:
      batch: B, rows in the step.
      query_tokens: q, verified query tokens (``query_tokens(lengths)`` for a step's
        per-row draft lengths).
      kv_tokens: KV positions all rows read.
      drafts: the draft work, method name -> (rows drafting, longest draft).
      length: L of the SD overhead, the longest verified draft; default the longest
        draft in ``drafts``.
      speculative: SD (True) or plain-decoding (False) overhead; default ``length > 0``.
      switches: rows that changed method since their previous step.

    Raises:
      ValueError: a method of ``drafts`` with no draft cost here.
    """
    return self.step_parts(batch, query_tokens, kv_tokens, drafts, length=length,
                           speculative=speculative, switches=switches).total

  def verify_time(self, batch: int, length: int) -> float:
    """``T(B, L)``: seconds of a step of ``batch`` rows each verifying ``length`` drafts
    (no draft work, no KV term): what verify skipping compares lengths with."""
    return self.step_time(batch, self.query_tokens(np.full(batch, length), k=length), 0,
                          length=length)

  def __call__(self, batch: int, length: int) -> float:
    """``verify_time``: a cost model is a ``(batch, length) -> seconds`` callable."""
    return self.verify_time(batch, length)

  def with_switch(self, switch_s: float) -> CostModel:
    return dataclasses.replace(self, switch_s=switch_s)

  def to_json(self) -> str:
    return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

  @classmethod
  def from_json(cls, text: str) -> CostModel:
    """The model ``to_json`` wrote. Raises ValueError on a field it does not know."""
    d = json.loads(text)
    try:
      return cls(name=d["name"], target=TargetCost(**d["target"]),
                 drafts={k: DraftCost(**v) for k, v in d["drafts"].items()},
                 overhead=OverheadCost(**d.get("overhead", {})),
                 switch_s=d.get("switch_s", 0.0), query_padding=d.get("query_padding", "ragged"),
                 prefill_emits_token=d.get("prefill_emits_token", True),
                 meta=d.get("meta", {}))
    except (KeyError, TypeError) as e:
      raise ValueError(f"cost model JSON {e} must hold name, target and drafts as "
                       "CostModel.to_json writes them") from None


def _coefficients(**values) -> None:
  for name, v in values.items():
    if not (isinstance(v, (int, float, np.floating, np.integer)) and np.isfinite(v) and v >= 0):
      raise ValueError(f"{name}={v!r} must be a finite number >= 0 (seconds)")


def StepCostModel(*, verify_base: float, verify_per_token: float = 0.0,  # noqa: N802
                  verify_per_kv: float = 0.0, draft_base: float = 0.0,
                  draft_per_row: float = 0.0) -> CostModel:
  """The goodput methods' (TurboSpec, SV) linear step cost as a ``CostModel``:
  ``T = verify_base + verify_per_token * num_tokens + verify_per_kv * kv_tokens
  + draft_steps * (draft_base + draft_per_row * num_rows)`` seconds (the draft term is the
  ``ANY_METHOD`` draft cost, no overhead).

  Raises:
    ValueError: a coefficient negative or not finite, or ``verify_base`` <= 0.
  """
  _coefficients(verify_base=verify_base, verify_per_token=verify_per_token,
                verify_per_kv=verify_per_kv, draft_base=draft_base, draft_per_row=draft_per_row)
  if verify_base <= 0:
    raise ValueError(f"verify_base={verify_base} must be > 0 (a step takes time)")
  return CostModel(
      name=(f"step(verify_base={verify_base}, verify_per_token={verify_per_token}, "
            f"verify_per_kv={verify_per_kv}, draft_base={draft_base}, "
            f"draft_per_row={draft_per_row})"),
      target=TargetCost(fixed_s=verify_base, per_query_token_s=verify_per_token,
                        per_kv_token_s=verify_per_kv),
      drafts={ANY_METHOD: DraftCost(per_step_s=draft_base, per_row_token_s=draft_per_row)})


def LinearVerifyCost(*, fixed_s: float = 7.2e-3, per_row_s: float = 6.8e-5,  # noqa: N802
                     per_token_s: float = 2.0e-5) -> CostModel:
  """Verify skipping's prior as a ``CostModel``: ``T(B, L) = fixed_s + per_row_s * B +
  per_token_s * B * (L + 1)`` seconds (``verify_time``).

  The defaults fit the whole engine step of the Llama-3.1-8B shape (bf16) on the H200
  at B = 16 and 64, L = 1 and 8 (``docs/gpu/runtime_cost_model``, step_ms 8.93, 11.42,
  14.12, 22.96): a rough prior for other setups, which should pass measured costs
  (``TableVerifyCost``, or a fitted ``CostModel``).

  Raises:
    ValueError: a coefficient negative or not finite.
  """
  _coefficients(fixed_s=fixed_s, per_row_s=per_row_s, per_token_s=per_token_s)
  return CostModel(
      name=f"linear-verify(fixed_s={fixed_s}, per_row_s={per_row_s}, per_token_s={per_token_s})",
      target=TargetCost(fixed_s=fixed_s, per_row_s=per_row_s, per_query_token_s=per_token_s,
                        per_kv_token_s=0.0),
      drafts={})


@dataclasses.dataclass(frozen=True)
class TableVerifyCost:
  """Measured step seconds: ``seconds[i][j]`` at ``batches[i]`` rows, length
  ``lengths[j]`` (increasing). Linear in B between (and beyond, clamped to the end
  points) measured batches; a length between measured ones takes the next larger one.

  Raises:
    ValueError: shapes disagree, batches not integers >= 1 or lengths not integers >= 0,
      axes not increasing, a time not finite and > 0, or a length past the table.
  """

  batches: tuple[int, ...]
  lengths: tuple[int, ...]
  seconds: tuple[tuple[float, ...], ...]

  def __post_init__(self):
    for name, low in (("batches", 1), ("lengths", 0)):
      axis = tuple(getattr(self, name))
      if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= low
                 for v in axis):
        raise ValueError(f"{name}={axis} must be integers >= {low}")
      object.__setattr__(self, name, tuple(int(v) for v in axis))
    object.__setattr__(self, "seconds", tuple(tuple(float(v) for v in row)
                                              for row in self.seconds))
    s = np.asarray(self.seconds, np.float64)
    if s.shape != (len(self.batches), len(self.lengths)) or not s.size:
      raise ValueError(f"seconds shape {s.shape} must be (len(batches), len(lengths)) = "
                       f"({len(self.batches)}, {len(self.lengths)})")
    if np.any(np.diff(self.batches) <= 0) or np.any(np.diff(self.lengths) <= 0):
      raise ValueError(f"batches={self.batches} and lengths={self.lengths} must increase")
    if not np.all(np.isfinite(s)) or np.any(s <= 0):
      raise ValueError(f"seconds={s.tolist()} must all be finite and > 0")

  def __call__(self, batch: int, length: int) -> float:
    j = int(np.searchsorted(self.lengths, length))
    if j == len(self.lengths):
      raise ValueError(f"length={length} is past the cost table's lengths {self.lengths}")
    col = np.asarray(self.seconds, np.float64)[:, j]
    return float(np.interp(batch, self.batches, col))


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
  """The preset ``name``. Raises ValueError naming the presets if unknown."""
  if name not in PRESETS:
    raise ValueError(f"cost model preset {name=} is unknown; presets: {sorted(PRESETS)}")
  return PRESETS[name]


def load(name_or_path: str) -> CostModel:
  """A preset name or a JSON file written by ``CostModel.to_json``.

  Raises:
    ValueError: neither a preset nor a path ending in .json, or a malformed JSON model.
    OSError: the file cannot be read.
  """
  if name_or_path in PRESETS:
    return PRESETS[name_or_path]
  if not str(name_or_path).endswith(".json"):
    raise ValueError(f"cost model {name_or_path!r} must be a preset ({sorted(PRESETS)}) or a "
                     ".json file")
  with open(name_or_path) as f:
    return CostModel.from_json(f.read())
