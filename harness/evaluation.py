"""One evaluation: AR and SD methods over the same prompts, measured and compared.

``run_evaluation(EvalConfig(...))`` is the library call behind
``experiments/evaluate.py``. For each batch size it builds one ``Engine`` per method
(``"ar"``, the reference, always included) on the same target model and request list,
warms each engine up untimed: ``Engine.precompile`` compiles every prefill, decode and
verify shape the measured passes can meet, then a batch of the shortest prompts with at
most ``warmup_tokens`` new tokens compiles what is left (``_warmup_requests``; without
precompile, one request per prefill-length bucket, and decode buckets first reached
later compile in the measured pass, where those steps are flagged and left out of the
timings); a method that calls its own jitted functions from the host warms up on the
whole workload instead (``_engine_warmup_requests``), then ``repeats`` measured passes.
Each measured pass of each method gives one row.

Definitions (per row; see ``specjax.metrics``):

- ``tau``: committed tokens per sequence per step (accepted + bonus/recovered).
- ``c``: SD step time / matched AR step time (``metrics.matched_c`` against the AR run
  of the same batch size and repeat); ``share_matched``: share of SD steps whose
  (rows, KV-page bucket) signature had an AR step.
- ``S_pred = tau / c``: the predicted speedup.
- ``decode_s``: the run's steady-state generation time = sum of the step times of
  steps that did not compile + prefill time. ``measured_speedup`` = AR ``decode_s`` /
  SD ``decode_s`` over the same requests, and ``tokens_per_s`` = output tokens /
  ``decode_s``. ``wall_speedup`` is the same ratio of ``wall_s - compile_s`` (it also
  counts host time between steps and, online, idle time waiting for arrivals).
- ``lossless`` (greedy runs of SD methods only; None otherwise): True iff every
  request's output ids equal AR's; ``num_mismatched`` counts the requests that differ
  and ``first_divergence`` maps each of them to the first differing output position;
  ``divergence_margins`` gives the target's top-2 logit margin there (recomputed for
  AR's context, ``harness.divergence``) and ``max_divergence_margin`` the largest: in
  f32 with highest precision there should be none; in bf16 each should be a near-tie.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import math
import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
import pandas as pd
from absl import logging

from harness.build import build_method, load_model, method_base
from harness.device_time import device_busy_seconds, ops_table
from harness.divergence import divergence, first_divergence
from harness.kv_memory import method_kv_bytes_per_token
from harness.reconcile import speedups
from harness.stats import aggregate, format_mean_std
from harness.traces import parse_replay, read_jsonl, replay_requests
from harness.workloads import (
  RANDOM_DATASET,
  Prompt,
  load_prompts,
  poisson_arrivals,
  random_prompts,
  tokenize_prompts,
)
from methods.registry import METHODS
from models.layers import small_f32_matmul
from models.zoo import is_random_name
from pallas_kernels.paged_attention import implementations_used, resolve_implementation
from pallas_kernels.small_matmul import implementations_used as small_matmul_backends
from pallas_kernels.verify import implementations_used as verify_implementations_used
from specjax import sharding
from specjax.compile_cache import enable_compilation_cache
from specjax.config import MATMUL_PRECISIONS, EngineConfig, SamplingParams
from specjax.engine import Engine, bucket
from specjax.metrics import compile_affected, summarize
from specjax.request import Request
from specjax.steps import split_model

__all__ = [
    "MATMUL_PRECISIONS",
    "SUMMARY_COLUMNS",
    "EvalConfig",
    "default_output_dir",
    "first_divergence",
    "category_table",
    "load_model",
    "method_base",
    "run_evaluation",
    "run_summary",
    "summary_table",
]

# How the target's (and draft's) layers run: ``specjax.steps.split_model(unroll_layers=)``.
LAYER_EXECUTIONS = ("unrolled", "scan")
# Peers run beside specjax on the same prompt ids (``EvalConfig.peer``).
PEERS = (None, "hf")

# Printed summary: result column -> header.
SUMMARY_COLUMNS = {
    "method": "method",
    "batch_size": "batch",
    "tau": "tau",
    "acceptance_rate": "accept_rate",
    "c": "c",
    "S_pred": "S_pred",
    "measured_speedup": "measured_speedup",
    "e2e_speedup": "e2e_speedup",
    "tokens_per_s": "tokens/s",
    "lossless": "lossless",
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalConfig:
  """What to evaluate. Shared by ``experiments/evaluate.py`` and tests.

  Attributes:
    target: target model: a ``models.zoo`` name, a ``.gguf`` file or an HF directory.
      A ``random:<shape>`` target (random weights, no tokenizer) needs
      ``dataset="random"``.
    draft: draft model for methods that need one (same tokenizer), or None.
    methods: method names (``methods.registry``); ``"ar"`` is added first if absent. A
      name may carry a label, ``NAME@LABEL`` (e.g. ``eagle3@tree``), so one run compares
      several configurations of one method against one AR run; each label is its own
      method (own options, own result rows).
    method_options: per method name (with its label), keyword options for its config,
      e.g. ``{"eagle": {"head_path": "heads/eagle"}}`` (passed to ``make_method``); ``k``
      sets that method's draft length in place of ``num_speculative_tokens``.
    dataset: a ``harness.workloads.DATASETS`` name, or ``"random"``
      (``RANDOM_DATASET``): ``num_prompts`` prompts of ``input_len`` random token ids
      in ``[0, V)`` of the target's vocabulary (``random_prompts``, seeded by ``seed``).
    input_len: prompt length in tokens of ``dataset="random"`` (required there, and
      only there).
    num_prompts: prompts, balanced over the categories.
    categories: subset of the dataset's categories; None = all.
    batch_sizes: each is one engine ``max_num_seqs``.
    num_speculative_tokens: k, the draft length of SD methods.
    max_new_tokens: per request.
    temperature: 0 = greedy.
    seed: prompt sampling, arrival times and the engine's request keys.
    repeats: measured passes per (method, batch size).
    output_dir: where ``results.csv``, ``outputs.jsonl`` and ``config.json`` go;
      None writes nothing.
    max_model_len: tokens per sequence; None = longest prompt + ``max_new_tokens``
      (rounded up to a page, at most the target's ``max_position_embeddings``).
    page_size: KV positions per page.
    attention_implementation: paged-attention implementation(s).
    verify_implementation: ``EngineConfig.verify_implementation`` ("auto": the fused
      sampler for temperature-only chain steps, else the jnp one; None: the jnp
      rejection sampler; names: the fused ``pallas_kernels.verify`` sampler).
    request_rate: requests/s of Poisson arrivals (online mode); None = offline (all
      requests at once, ``max_num_seqs`` of them running at a time).
    dtype: "float32" or "bfloat16" for the models.
    warmup: run a warm-up subset of the workload untimed per engine before measuring
      (``_warmup_requests``: with ``precompile``, a batch of the shortest prompts).
    precompile: before the warm-up pass, compile every decode, verify and prefill shape
      the measured passes can meet (``Engine.precompile``: in ``precompile_threads``
      threads, then one all-padding call each where not on a CPU), so they compile
      none; costs the compiles of shapes the workload may not reach (about 11 s
      each for SmolLM2 on a 2-core CPU, far less from a warm compilation cache).
    precompile_threads: compile threads of ``precompile`` (None: the machine's cores,
      at most 16; 1: one shape at a time).
    warmup_tokens: max new tokens per request in that warm-up pass (None: the full
      ``max_new_tokens``). Without ``precompile``, a short warm-up compiles every prefill
      bucket and the early decode buckets; buckets first reached later compile inside
      the measured pass,
      where those steps are flagged, left out of ``decode_s`` and step means, and
      reported as ``num_compiles``/``compile_s``.
    chat_template: apply the tokenizer's chat template when it has one.
    layer_execution: "unrolled" (each layer its own weights; fastest steps, ~11 s XLA
      compile per step shape for SmolLM2 on a 2-core CPU) or "scan" (one ``lax.scan``
      over stacked layers; compiles several times faster, slower steps on CPU).
    ignore_eos: ``SamplingParams.ignore_eos`` of every request (EOS ids do not end
      generation: each request makes ``max_new_tokens``). None (default): True iff the
      target has no tokenizer (``random:`` models, which have no EOS), else False.
    matmul_precision: None keeps JAX's default; else one of ``MATMUL_PRECISIONS``,
      applied with ``jax.default_matmul_precision`` around every pass. "highest" makes
      f32 matmuls full f32 on GPUs (whose f32 default may round inputs, so verify steps
      (T = k + 1) and AR steps (T = 1) can round differently and flip near-tied greedy
      tokens); CPUs compute f32 in f32 either way.
    max_num_batched_tokens: ``EngineConfig.max_num_batched_tokens`` (prefill chunk budget).
    steps_per_dispatch: ``EngineConfig.steps_per_dispatch`` (iterations per device call
      of plain decoding and fused proposers).
    mesh: "none", or a one-replica mesh such as "data:1,model:2" (``specjax.sharding``);
      ``draft_sharding``: ``EngineConfig.draft_sharding``. Rows get ``mesh``,
      ``mesh_devices`` and ``replicated``.
    compilation_cache: use JAX's persistent compilation cache
      (``specjax.compile_cache``; ``$SPECJAX_CACHE/jax_compilation_cache``).
    slo_ttft_s, slo_tpot_s: service-level objectives in seconds for ``slo_attainment``
      and ``goodput_rps`` (``specjax.metrics.latency_summary``); None = no SLO.
    plots: write the figures of ``harness.plots`` next to ``results.csv``.
    peer: None, or "hf": also run Hugging Face transformers on the same prompt ids
      (``harness.hf_peer``; skipped with a message when torch/transformers are absent).
    device_profile: after the last repeat of each batch size, one more pass per method
      under ``jax.profiler`` (``harness.device_time``): rows get ``device_ms`` (device
      busy time per engine step, prefill wall time subtracted) and ``c_device``
      (against AR's), so c splits into speculation (device) and host overhead; with
      ``output_dir``, ``ops_{method}_b{batch}.csv`` lists every device op per step. A
      GPU/TPU backend only (a CPU trace has no device track).
    method_by_method: per batch size, each method's warm-up and repeats run before the
      next method's engine is built (AR first; every method's rows against AR's pass of
      the same repeat), instead of every method in each repeat; with ``output_dir``, a
      run cut off early keeps the rows of every method it finished (``results.csv`` is
      rewritten after each measured pass either way). Not with ``device_profile``
      (which profiles every method against AR in one pass).
    acceptance: "real" (drafts are verified), or "replay:FILE[:METHOD]": the first
      ``num_prompts`` requests of a trace file (``harness.traces.replay_requests``: each
      record's prompt and output lengths; ``dataset``, ``input_len``, ``categories`` and
      ``max_new_tokens`` are then unused) with every SD method's acceptance replayed
      from the records (``EngineConfig.acceptance_replay``; AR runs the same requests
      plainly). For timing real acceptance on any target, random weights included;
      outputs are not lossless, so ``lossless`` is left empty.
  """

  target: str = "smollm2-135m"
  draft: str | None = None
  methods: tuple[str, ...] = ("ar", "ngram")
  method_options: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
  dataset: str = "spec_bench"
  input_len: int | None = None
  num_prompts: int = 24
  categories: tuple[str, ...] | None = None
  batch_sizes: tuple[int, ...] = (1, 4)
  num_speculative_tokens: int = 4
  max_new_tokens: int = 128
  temperature: float = 0.0
  seed: int = 0
  repeats: int = 1
  output_dir: str | None = None
  max_model_len: int | None = None
  page_size: int = 16
  attention_implementation: str | tuple[str, ...] = "reference"
  verify_implementation: str | tuple[str, ...] | None = "auto"
  request_rate: float | None = None
  dtype: str = "float32"
  warmup: bool = True
  warmup_tokens: int | None = 16
  precompile: bool = True
  precompile_threads: int | None = None
  chat_template: bool = True
  layer_execution: str = "unrolled"
  ignore_eos: bool | None = None
  matmul_precision: str | None = "highest"
  max_num_batched_tokens: int = 512
  steps_per_dispatch: int = EngineConfig.steps_per_dispatch
  mesh: str = "none"
  draft_sharding: str = "replicated"
  compilation_cache: bool = True
  slo_ttft_s: float | None = None
  slo_tpot_s: float | None = None
  plots: bool = True
  peer: str | None = None
  device_profile: bool = False
  method_by_method: bool = False
  acceptance: str = "real"

  def __post_init__(self):
    if self.acceptance != "real":
      parse_replay(self.acceptance)  # raises on another form
    methods = tuple(dict.fromkeys(["ar", *self.methods]))
    object.__setattr__(self, "methods", methods)
    unused = sorted(set(self.method_options) - set(methods))
    if unused:
      raise ValueError(f"method_options names methods {unused} that are not in "
                       f"methods={list(methods)}")
    object.__setattr__(self, "batch_sizes", tuple(int(b) for b in self.batch_sizes))
    if self.categories is not None:
      object.__setattr__(self, "categories", tuple(self.categories) or None)
    if isinstance(self.attention_implementation, list):
      object.__setattr__(self, "attention_implementation", tuple(self.attention_implementation))
    if isinstance(self.verify_implementation, list):
      object.__setattr__(self, "verify_implementation", tuple(self.verify_implementation) or None)
    if not self.batch_sizes or min(self.batch_sizes) < 1:
      raise ValueError(f"batch_sizes={self.batch_sizes} must be a non-empty list of ints >= 1")
    for name in ("num_prompts", "max_new_tokens", "repeats", "page_size"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
    if self.num_speculative_tokens < 1:
      raise ValueError(f"num_speculative_tokens={self.num_speculative_tokens} must be >= 1")
    if self.precompile_threads is not None and self.precompile_threads < 1:
      raise ValueError(f"precompile_threads={self.precompile_threads} must be >= 1 (None: "
                       "the machine's cores)")
    if not self.temperature >= 0:
      raise ValueError(f"temperature={self.temperature} must be >= 0")
    if self.request_rate is not None and not self.request_rate > 0:
      raise ValueError(f"request_rate={self.request_rate} must be > 0 requests/s (None = offline)")
    if self.max_model_len is not None and self.max_model_len < 2:
      raise ValueError(f"max_model_len={self.max_model_len} must be >= 2")
    if self.dtype not in ("float32", "bfloat16"):
      raise ValueError(f"dtype={self.dtype!r} must be 'float32' or 'bfloat16'")
    if self.layer_execution not in LAYER_EXECUTIONS:
      raise ValueError(f"layer_execution={self.layer_execution!r} must be one of "
                       f"{LAYER_EXECUTIONS}")
    unknown = [m for m in methods if method_base(m) not in METHODS]
    if unknown:
      raise ValueError(f"methods {unknown} are unknown; known methods: {sorted(METHODS)} "
                       "(each optionally NAME@LABEL)")
    bad = [m for m in methods if "@" in m and (not m.split("@", 1)[1] or "." in m
                                               or method_base(m) == "ar")]
    if bad:
      raise ValueError(f"methods {bad}: a label is NAME@LABEL with a non-empty LABEL "
                       "without '.', and 'ar' takes none")
    if self.verify_implementation not in (None, "auto"):
      _check_verify_implementation(self.verify_implementation)
    if self.dataset == RANDOM_DATASET:
      if self.input_len is None or self.input_len < 1:
        raise ValueError(f"input_len={self.input_len} must be >= 1 with "
                         f"dataset={RANDOM_DATASET!r} (prompt length in tokens)")
      if self.categories is not None:
        raise ValueError(f"categories={self.categories} must be None with "
                         f"dataset={RANDOM_DATASET!r} (it has no categories)")
    elif self.input_len is not None:
      raise ValueError(f"input_len={self.input_len} is only for dataset={RANDOM_DATASET!r}; "
                       f"dataset={self.dataset!r} has its own prompts (leave it None)")
    if (is_random_name(self.target) and self.dataset != RANDOM_DATASET
        and self.acceptance == "real"):
      raise ValueError(f"target={self.target!r} has random weights and no tokenizer: "
                       f"dataset={self.dataset!r} must be {RANDOM_DATASET!r} (token-id "
                       "prompts, with input_len)")
    for name in ("slo_ttft_s", "slo_tpot_s"):
      v = getattr(self, name)
      if v is not None and not v > 0:
        raise ValueError(f"{name}={v} must be > 0 seconds (None = no SLO)")
    if self.method_by_method and self.device_profile:
      raise ValueError("method_by_method=True cannot run with device_profile=True (the "
                       "profile pass times every method against AR in one pass)")
    if self.peer not in PEERS:
      raise ValueError(f"peer={self.peer!r} must be one of {PEERS}")
    if self.matmul_precision is not None and self.matmul_precision not in MATMUL_PRECISIONS:
      raise ValueError(f"matmul_precision={self.matmul_precision!r} must be None or one of "
                       f"{MATMUL_PRECISIONS}")


def _check_verify_implementation(value) -> None:
  """Raises ValueError for unknown ``pallas_kernels.verify`` names, or when none of the
  listed ones can run on this JAX backend (before any model is loaded)."""
  from pallas_kernels.verify import IMPLEMENTATIONS  # noqa: PLC0415

  names = (value,) if isinstance(value, str) else tuple(value)
  bad = [n for n in names if n not in IMPLEMENTATIONS]
  if bad or not names:
    raise ValueError(f"verify_implementation={','.join(names)} must be 'auto', None (the jnp "
                     f"sampler) or implementation names from {IMPLEMENTATIONS}")
  if "reference" not in names and jax.default_backend() != "gpu":
    raise ValueError(f"verify_implementation={','.join(names)} needs a GPU (backend is "
                     f"{jax.default_backend()!r}); add 'reference' or leave it unset")


def default_output_dir(root: str = "results") -> str:
  """``results/<YYYYmmdd-HHMMSS>``."""
  return os.path.join(root, datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))


def _ratio(num: float, den: float) -> float:
  return num / den if den > 0 else float("nan")


class _Progress:
  """One tqdm bar over every pass, in output tokens (``max_new_tokens`` per request)."""

  def __init__(self, total: int, enabled: bool):
    from tqdm.auto import tqdm  # noqa: PLC0415

    self.bar = tqdm(total=total, unit="tok", disable=not enabled, dynamic_ncols=True)
    self.budget = 0
    self.done = 0

  def start(self, desc: str, budget: int):
    self.bar.set_description(desc)
    self.budget, self.done = budget, 0

  def __call__(self, n: int):
    self.done += n
    self.bar.update(n)

  def finish(self):
    # Requests that stopped early leave part of their budget: skip it so the bar ends full.
    self.bar.update(max(0, self.budget - self.done))

  def close(self):
    self.bar.close()


def _make_requests(cfg: EvalConfig, prompt_ids: list[tuple[int, ...]], prompts,
                   ignore_eos: bool) -> list[Request]:
  sampling = SamplingParams(temperature=cfg.temperature, max_tokens=cfg.max_new_tokens,
                            ignore_eos=ignore_eos)
  arrivals = (poisson_arrivals(len(prompts), cfg.request_rate, cfg.seed)
              if cfg.request_rate is not None else np.zeros(len(prompts)))
  return [Request(p.id, ids, sampling, float(t))
          for p, ids, t in zip(prompts, prompt_ids, arrivals)]


def _warmup_subset(requests: Sequence[Request], min_count: int, min_prefill_bucket: int,
                   max_model_len: int) -> list[Request]:
  """The requests the warm-up pass runs: the first request of each prefill-length bucket
  (so every prefill shape the workload needs compiles), then the next ones in order
  until there are ``min_count`` (so the largest batch's decode shapes compile too).
  E.g. prompt lengths [40, 41, 700, 45, 1300] with min_count 2 -> the 40, 700 and 1300
  ones. Prefill dominates a CPU warm-up, so 24 Spec-Bench prompts warm up with 7."""
  chosen, seen = [], set()
  for r in requests:
    b = bucket(max(len(r.prompt_token_ids) - 1, 1), max_model_len, min_prefill_bucket)
    if b not in seen:
      seen.add(b)
      chosen.append(r)
  for r in requests:
    if len(chosen) >= min_count:
      break
    if r not in chosen:
      chosen.append(r)
  return sorted(chosen, key=requests.index)


def _resolve_max_model_len(cfg: EvalConfig, prompts, prompt_ids, context: int,
                           new_tokens: int | None = None) -> int:
  """``cfg.max_model_len`` checked against the prompts, or the fitted default.

  ``context`` is the target's ``max_position_embeddings``: no sequence may exceed it.
  ``new_tokens``: the most new tokens of a request (default ``cfg.max_new_tokens``).
  """
  longest = max(len(ids) for ids in prompt_ids)
  new_tokens = cfg.max_new_tokens if new_tokens is None else new_tokens
  if cfg.max_model_len is None:
    need = longest + new_tokens
    if need > context:
      p = prompts[max(range(len(prompts)), key=lambda i: len(prompt_ids[i]))]
      raise ValueError(
          f"prompt {p.id!r} has {longest} tokens: with max_new_tokens={new_tokens} it "
          f"needs {need} positions, more than the target's context ({context}); choose "
          "other prompts (seed, categories) or fewer new tokens"
      )
    return min(-(-need // cfg.page_size) * cfg.page_size, context)
  if cfg.max_model_len > context:
    raise ValueError(f"max_model_len={cfg.max_model_len} must be <= the target's context "
                     f"({context} positions)")
  for p, ids in zip(prompts, prompt_ids):
    if len(ids) >= cfg.max_model_len:
      raise ValueError(
          f"prompt {p.id!r} has {len(ids)} tokens; max_model_len={cfg.max_model_len} must be "
          f"larger (leave it unset to fit the longest prompt, {longest} tokens, plus "
          f"max_new_tokens={new_tokens})"
      )
  return cfg.max_model_len


@dataclasses.dataclass(frozen=True)
class _Loaded:
  """What the load phase (``_load``) hands the later phases.

  Attributes:
    methods: method name (``NAME[@LABEL]``) -> constructed method, ``"ar"`` first.
    needs_draft: the names of ``methods`` that run on the draft model.
    replay: ``harness.traces.parse_replay(cfg.acceptance)`` (file, method), or None for
      real acceptance.
    records: the replay file's records, or None.
    prompts: the data set's text prompts (read before the models load, so a bad
      dataset or category fails fast), or None for random or replayed workloads.
    target, draft: the loaded models (``load_model``); ``draft`` None when no method
      needs one.
    target_split, draft_split: ``specjax.steps.split_model`` of each.
  """

  methods: dict[str, Any]
  needs_draft: tuple[str, ...]
  replay: tuple[str, str | None] | None
  records: list[dict] | None
  prompts: list[Prompt] | None
  target: Any
  draft: Any
  target_split: Any
  draft_split: Any


@dataclasses.dataclass(frozen=True)
class _Workload:
  """The requests phase's result (``_build_requests``): the same for every engine.

  Attributes:
    prompts: one ``Prompt`` per request, in request order.
    requests: the measured requests (arrival seconds, ``max_tokens``, replayed
      acceptance where replayed); per-repeat seeds are set later (``_repeat_requests``).
    max_model_len: tokens per sequence every engine is built for.
    new_tokens: the most new tokens of one request (``cfg.max_new_tokens``, or the
      records' longest output when replayed).
    ignore_eos: what the requests carry (True for replayed ones), for the result rows.
  """

  prompts: list[Prompt]
  requests: list[Request]
  max_model_len: int
  new_tokens: int
  ignore_eos: bool


@dataclasses.dataclass
class _Passes:
  """What the passes phase (``_run_passes``) records: result rows (one per method,
  batch size and repeat, before column ordering), one output record per request of each
  of those rows, and the warm-up and measured wall seconds."""

  rows: list[dict] = dataclasses.field(default_factory=list)
  output_records: list[dict] = dataclasses.field(default_factory=list)
  warmup_s: float = 0.0
  measure_s: float = 0.0


def run_evaluation(cfg: EvalConfig, *, progress: bool = True, verbose: bool = True
                   ) -> pd.DataFrame:
  """Runs ``cfg`` and returns one row per (method, batch size, repeat).

  The phases, each its own function: load (``_load``), requests (``_build_requests``),
  warm-up requests (``_warmup_requests``), warm-up and measured passes with their rows
  (``_run_passes``: ``_warmup_pass``, ``_measured_pass``, ``_pass_rows``), the results
  frame (``_results_frame``), the peer (``_run_peer``), write (``_write``) and report
  (``_print_report``).

  Args:
    cfg: the evaluation.
    progress: show a tqdm bar (output tokens over all passes).
    verbose: print the summary table, timings and output paths.

  Returns:
    The results ``DataFrame`` (also written to ``output_dir/results.csv``).

  Raises:
    ValueError: unknown method, dataset, category or attention implementation; a
      method that needs ``draft`` without one; draft/target vocabulary mismatch; a
      prompt that does not fit ``max_model_len`` or the target's context; a target
      without a tokenizer and a text dataset.
  """
  t_start = time.perf_counter()
  loaded = _load(cfg)
  workload = _build_requests(cfg, loaded.prompts, loaded.target.tokenizer,
                             loaded.target.config.vocab_size,
                             loaded.target.config.max_position_embeddings,
                             records=loaded.records, replay=loaded.replay)
  t_loaded = time.perf_counter()
  mesh = None if cfg.mesh == "none" else sharding.make_mesh(cfg.mesh)
  static = _static_columns(cfg, workload, loaded.target_split, mesh)
  warm_requests = _warmup_requests(cfg, workload)
  passes = _run_passes(cfg, loaded, workload, warm_requests, static, mesh, progress)
  df = _results_frame(passes.rows, cfg.num_speculative_tokens)
  peer_df = _run_peer(cfg, df, workload.requests, passes.output_records)
  total_s = time.perf_counter() - t_start
  categories = category_table(passes.output_records, df)
  if cfg.output_dir is not None:
    _write(cfg, df, passes.output_records, categories, peer_df)
  if verbose:
    _print_report(cfg, df, peer_df, static, len(workload.requests),
                  {"load+tokenize": t_loaded - t_start, "warm-up": passes.warmup_s,
                   "measured": passes.measure_s, "total": total_s})
  return df


def _load(cfg: EvalConfig) -> _Loaded:
  """Load phase: the methods, the data set's text prompts and the models.

  Checks what can be checked before the models load (device profile backend, method
  options, a draft model for the methods that need one, the attention implementation,
  the data set and categories), turns on the persistent compilation cache, loads the
  target (and the draft when a method needs it) with ``load_model`` and splits them
  (``cfg.layer_execution``).

  Raises:
    ValueError: ``device_profile`` on a CPU backend; bad method options; a method that
      needs ``draft`` without one; an unknown attention implementation, dataset or
      category; a text dataset on a target without a tokenizer; draft and target
      vocabulary sizes that differ.
  """
  if cfg.device_profile and jax.default_backend() == "cpu":
    raise ValueError("device_profile=True needs a GPU or TPU backend; JAX's backend is 'cpu' "
                     "(a CPU trace has no device track)")
  if cfg.compilation_cache:
    enable_compilation_cache()
  k = cfg.num_speculative_tokens
  methods = {name: build_method(name, k, cfg.method_options.get(name, {}))
             for name in cfg.methods}
  needs_draft = tuple(n for n, m in methods.items() if m.capabilities().needs_draft_model)
  if needs_draft and cfg.draft is None:
    raise ValueError(f"methods {list(needs_draft)} need a draft model, but draft=None")
  resolve_implementation(cfg.attention_implementation)
  replay = None if cfg.acceptance == "real" else parse_replay(cfg.acceptance)
  records = None if replay is None else read_jsonl(replay[0])
  synthetic = cfg.dataset == RANDOM_DATASET and replay is None
  # Random prompts need the target's vocabulary size; text prompts are read (and checked)
  # before the model loads.
  prompts = (None if synthetic or replay else
             load_prompts(cfg.dataset, cfg.num_prompts, cfg.categories, cfg.seed))
  if cfg.draft is not None and not needs_draft:
    logging.warning("draft=%r is not loaded: none of %s uses a draft model", cfg.draft,
                    list(methods))
  target = load_model(cfg.target, cfg.dtype)
  draft = load_model(cfg.draft, cfg.dtype) if needs_draft else None
  # A target without a tokenizer (random weights) has no text, no chat template and no
  # EOS: prompts are token ids, outputs are compared as ids and run to max_new_tokens.
  if target.tokenizer is None and not synthetic and replay is None:
    raise ValueError(f"target={cfg.target!r} has no tokenizer: dataset={cfg.dataset!r} must "
                     f"be {RANDOM_DATASET!r} (token-id prompts)")
  if draft is not None and draft.config.vocab_size != target.config.vocab_size:
    raise ValueError(f"draft={cfg.draft!r} vocab_size={draft.config.vocab_size} must equal "
                     f"target={cfg.target!r} vocab_size={target.config.vocab_size}")
  unroll = cfg.layer_execution == "unrolled"
  return _Loaded(
      methods=methods, needs_draft=needs_draft, replay=replay, records=records,
      prompts=prompts, target=target, draft=draft,
      target_split=split_model(target.model, unroll_layers=unroll),
      draft_split=split_model(draft.model, unroll_layers=unroll) if draft is not None else None,
  )


def _build_requests(cfg: EvalConfig, prompts: Sequence[Prompt] | None, tokenizer,
                    vocab_size: int, context: int, *, records: list[dict] | None = None,
                    replay: tuple[str, str | None] | None = None) -> _Workload:
  """Requests phase: the prompts as token ids, ``max_model_len`` and the requests.

  Args:
    cfg: the evaluation.
    prompts: the data set's prompts (``_load``), or None: ``dataset="random"`` draws
      ``cfg.num_prompts`` prompts of ``cfg.input_len`` ids in ``[0, vocab_size)``, and a
      replay takes the first ``cfg.num_prompts`` of ``records``.
    tokenizer: the target's (``tokenize_prompts``), or None for token-id prompts.
    vocab_size: V of the target.
    context: the target's ``max_position_embeddings`` (no sequence may exceed it).
    records: the replay file's records (with ``replay``), else None.
    replay: ``parse_replay(cfg.acceptance)`` (file, method), or None.

  Returns:
    A ``_Workload``: request ``i`` is prompt ``i`` with ``cfg.max_new_tokens`` new tokens
    (replayed: the record's output length and acceptance, EOS ignored), ``ignore_eos``
    from ``cfg`` (None: True iff ``tokenizer`` is None), arrival seconds from
    ``poisson_arrivals(n, cfg.request_rate, cfg.seed)`` online and 0 offline.

  Raises:
    ValueError: a prompt that tokenizes to nothing, a text prompt without a tokenizer, or
      one that does not fit ``max_model_len`` or ``context``.
  """
  replayed = None
  if replay is not None:
    replayed = replay_requests(records, replay[1], vocab_size=vocab_size, seed=cfg.seed,
                               num_requests=cfg.num_prompts)
    prompts = [Prompt(str(r.request_id), "replay", "replay", "replay", "",
                      token_ids=r.prompt_token_ids) for r in replayed]
  elif prompts is None:
    prompts = random_prompts(cfg.num_prompts, cfg.input_len, vocab_size, cfg.seed)
  prompts = list(prompts)
  prompt_ids = tokenize_prompts(prompts, tokenizer, chat_template=cfg.chat_template)
  new_tokens = (cfg.max_new_tokens if replayed is None
                else max(r.sampling.max_tokens for r in replayed))
  max_model_len = _resolve_max_model_len(cfg, prompts, prompt_ids, context, new_tokens)
  ignore_eos = tokenizer is None if cfg.ignore_eos is None else cfg.ignore_eos
  requests = _make_requests(cfg, prompt_ids, prompts, ignore_eos)
  if replayed is not None:  # the records' output lengths and acceptance, EOS ignored
    requests = [dataclasses.replace(r, sampling=dataclasses.replace(
        r.sampling, max_tokens=t.sampling.max_tokens, ignore_eos=True),
        replay_acc_len=t.replay_acc_len) for r, t in zip(requests, replayed)]
  return _Workload(prompts=prompts, requests=requests, max_model_len=max_model_len,
                   new_tokens=new_tokens, ignore_eos=ignore_eos if replayed is None else True)


def _static_columns(cfg: EvalConfig, workload: _Workload, target_split, mesh) -> dict:
  """The columns every result row of this run shares: model, workload, sampling,
  engine shape, device, backend, JAX version, mesh and layer execution."""
  return {
      "model": cfg.target,
      "dataset": cfg.dataset,
      "categories": ",".join(cfg.categories) if cfg.categories else "all",
      "num_prompts": cfg.num_prompts,
      "max_new_tokens": cfg.max_new_tokens,
      "temperature": cfg.temperature,
      "request_rate": cfg.request_rate,
      "max_model_len": workload.max_model_len,
      "page_size": cfg.page_size,
      "dtype": cfg.dtype,
      "device": jax.devices()[0].device_kind,
      "backend": jax.default_backend(),
      "attention_implementation": (",".join(cfg.attention_implementation)
                                   if isinstance(cfg.attention_implementation, tuple)
                                   else cfg.attention_implementation),
      "jax_version": jax.__version__,
      **sharding.describe(mesh, cfg.draft_sharding, target_split.config),
      "layer_execution": cfg.layer_execution,
      "matmul_precision": cfg.matmul_precision or "default",
      "input_len": cfg.input_len,
      "ignore_eos": workload.ignore_eos,
      "acceptance": cfg.acceptance,
  }


def _warmup_requests(cfg: EvalConfig, workload: _Workload) -> list[Request]:
  """Warm-up phase's requests, each capped at ``cfg.warmup_tokens`` new tokens (None:
  uncapped). With ``cfg.precompile`` every prefill, decode and verify shape is compiled
  before this pass, which only has what is left to compile (slot admission): a batch of
  the largest batch size of the shortest prompts (``_shortest``). Without it,
  ``_warmup_subset`` (one request per prefill-length bucket, then up to a batch of the
  largest batch size) compiles the prefill shapes too."""
  warm_tokens = min(workload.new_tokens, cfg.warmup_tokens or workload.new_tokens)
  if cfg.precompile:
    chosen = _shortest(workload.requests, max(cfg.batch_sizes))
  else:
    chosen = _warmup_subset(workload.requests, max(cfg.batch_sizes),
                            EngineConfig.min_prefill_bucket, workload.max_model_len)
  return [
      dataclasses.replace(r, sampling=dataclasses.replace(
          r.sampling, max_tokens=min(warm_tokens, r.sampling.max_tokens)))
      for r in chosen
  ]


def _shortest(requests: Sequence[Request], count: int) -> list[Request]:
  """The ``count`` requests with the shortest prompts (ties: first in order), in
  workload order. E.g. prompt lengths [40, 41, 700, 45, 1300], count 2 -> the 40 and
  41 ones."""
  order = sorted(range(len(requests)), key=lambda i: (len(requests[i].prompt_token_ids), i))
  return [requests[i] for i in sorted(order[:count])]


def _run_passes(cfg: EvalConfig, loaded: _Loaded, workload: _Workload,
                warm_requests: Sequence[Request], static: Mapping[str, Any], mesh,
                progress: bool) -> _Passes:
  """Warm-up and measured passes phase: per batch size and repeat, fresh engines
  (``_engines``), the warm-up pass on the first repeat (``_warmup_pass``), one measured
  pass per method (``_measured_pass``) and its rows (``_pass_rows``); the device
  profile pass after the last repeat when asked. With ``cfg.method_by_method`` each
  method (AR first) runs its warm-up and repeats before the next, its rows against AR's
  pass of the same repeat. After each measured pass the rows so far are written
  (``_write`` without figures), so a run cut off early keeps them. Runs under
  ``cfg.matmul_precision``, with one progress bar over every pass (in output tokens)."""
  budget = sum(r.sampling.max_tokens for r in workload.requests)
  warm_budget = sum(r.sampling.max_tokens for r in warm_requests)
  passes_tokens = len(cfg.batch_sizes) * len(loaded.methods) * (
      (cfg.repeats + int(cfg.device_profile)) * budget + int(cfg.warmup) * warm_budget)
  groups = ([[name] for name in loaded.methods] if cfg.method_by_method
            else [list(loaded.methods)])
  out = _Passes()
  precision = (jax.default_matmul_precision(cfg.matmul_precision) if cfg.matmul_precision
               else contextlib.nullcontext())
  with precision, contextlib.closing(_Progress(passes_tokens, progress)) as bar:
    for batch in cfg.batch_sizes:
      ar_passes = {}  # repeat -> AR's (outputs, metrics) and KV bytes per token
      warm_s = {}  # method -> its warm-up's wall seconds at this batch size
      for names in groups:
        for rep in range(cfg.repeats):
          engines = _engines(cfg, loaded, workload, batch, rep, mesh, names)
          if cfg.warmup and rep == 0:
            warm_s.update(_warmup_pass(cfg, engines, workload.requests, warm_requests,
                                       batch, bar))
          rep_requests = _repeat_requests(workload.requests, cfg.seed, rep)
          t0 = time.perf_counter()
          results = _measured_pass(engines, rep_requests, batch, rep, budget, bar)
          out.measure_s += time.perf_counter() - t0
          kv_bytes = {name: method_kv_bytes_per_token(loaded.methods[name], engine.runtime)
                      for name, engine in engines.items()}
          if "ar" in results:
            ar_passes[rep] = (results["ar"], kv_bytes["ar"])
          results = {"ar": ar_passes[rep][0], **results}
          kv_bytes = {"ar": ar_passes[rep][1], **kv_bytes}
          rows, records = _pass_rows(
              cfg, loaded.methods, results, workload.prompts, static, batch=batch, rep=rep,
              needs_draft=loaded.needs_draft, kv_bytes=kv_bytes,
              check_lossless=cfg.temperature == 0 and loaded.replay is None,
              target_split=loaded.target_split)
          out.rows.extend({**r, "warmup_s": warm_s.get(r["method"])}
                          for r in rows if r["method"] in engines)
          out.output_records.extend(r for r in records if r["method"] in engines)
          if cfg.device_profile and rep == cfg.repeats - 1:
            bar.start(f"device profile b={batch}", budget * len(engines))
            _device_profile(engines, rep_requests, out.rows, batch, cfg.output_dir, bar)
            bar.finish()
          del engines
          if cfg.output_dir is not None:
            df = _results_frame(out.rows, cfg.num_speculative_tokens)
            _write(cfg, df, out.output_records, category_table(out.output_records, df), None,
                   figures=False)
        if jax.default_backend() == "cpu":
          # Each held XLA:CPU executable keeps ~6 memory mappings: every method at every
          # batch size in one process reached vm.max_map_count (65,530) and segfaulted in
          # a persistent-cache write (4 methods, batch 1 and 4, SmolLM2: 54,168 mappings
          # after batch 1). The next batch size (or method) compiles its own shapes (or
          # loads them from the persistent cache) in its warm-up, so its measured passes
          # are unaffected.
          jax.clear_caches()
      out.warmup_s += sum(warm_s.values())
  return out


def _engines(cfg: EvalConfig, loaded: _Loaded, workload: _Workload, batch: int, rep: int,
             mesh, names: Sequence[str]) -> dict[str, Engine]:
  """One ``Engine`` per method of ``names`` for one (batch size, repeat):
  ``max_num_seqs=batch``, sampling seed ``cfg.seed + rep``. A fresh engine per repeat
  (same jitted executables, new KV pool and state); SD methods replay acceptance when
  ``cfg.acceptance`` says so."""
  engine_cfg = EngineConfig(
      max_num_seqs=batch, max_model_len=workload.max_model_len, page_size=cfg.page_size,
      attention_implementation=cfg.attention_implementation,
      verify_implementation=cfg.verify_implementation, seed=cfg.seed + rep,
      max_num_batched_tokens=cfg.max_num_batched_tokens, mesh=mesh,
      draft_sharding=cfg.draft_sharding, steps_per_dispatch=cfg.steps_per_dispatch,
  )
  tokenizer = loaded.target.tokenizer
  return {
      name: Engine(loaded.target_split, loaded.methods[name],
                   engine_cfg.replace(acceptance_replay=loaded.replay is not None
                                      and name != "ar"),
                   draft=loaded.draft_split if name in loaded.needs_draft else None,
                   eos_token_ids=() if tokenizer is None else tokenizer.eos_token_ids,
                   decode=None if tokenizer is None else tokenizer.decode)
      for name in names
  }


def _warmup_pass(cfg: EvalConfig, engines: Mapping[str, Engine], requests: Sequence[Request],
                 warm_requests: Sequence[Request], batch: int, bar) -> dict[str, float]:
  """Warm-up phase, untimed: per engine, precompile every step shape the measured
  passes can meet (``cfg.precompile``, in ``cfg.precompile_threads`` threads), then run
  ``warm_requests`` (compiling what is left: slot admission), or the whole workload for a
  method with host-called jitted functions (``_engine_warmup_requests``), then clear the
  method's cross-request cache. Returns each engine's wall seconds."""
  seconds = {}
  for name, engine in engines.items():
    t0 = time.perf_counter()
    warm = _engine_warmup_requests(engine, requests, warm_requests)
    bar.start(f"warm-up {name} b={batch}", sum(r.sampling.max_tokens for r in warm))
    if cfg.precompile:
      engine.precompile(_fit(engine, requests), num_threads=cfg.precompile_threads)
    engine.generate(_fit(engine, warm), progress=bar)
    bar.finish()
    # Cross-request caches (suffix decoding's global tree, adaptive's estimates)
    # must not carry the warm-up's responses into the measured pass.
    engine.runtime.method_cache.clear()
    seconds[name] = time.perf_counter() - t0
  return seconds


def _engine_warmup_requests(engine: Engine, requests: Sequence[Request],
                            warm_requests: Sequence[Request]) -> Sequence[Request]:
  """The warm-up pass's requests for ``engine``: ``warm_requests``, or the whole
  measured workload ``requests`` for a method whose ``propose`` calls its own jitted
  functions (``Capabilities.runs_on == "device"``: learned heads and draft models on the
  host-called path, adaptive with such a member). Their shapes follow the prompts' prefill
  chunks and the batch's rows, which ``Engine.precompile`` cannot enumerate, so only the
  same workload compiles them all; a compile left to the measured pass would drop its
  step from the timings and its requests from the latencies."""
  return requests if engine.caps.runs_on == "device" else warm_requests


def _measured_pass(engines: Mapping[str, Engine], requests: Sequence[Request], batch: int,
                   rep: int, budget: int, bar) -> dict[str, tuple[list, Any]]:
  """Measured passes phase, one repeat: every engine generates ``requests`` in turn.

  Returns:
    method name -> (``RequestOutput`` s in request order, ``RunMetrics``).
  """
  results = {}
  for name, engine in engines.items():
    bar.start(f"{name} b={batch} r={rep}", budget)
    results[name] = engine.generate(_fit(engine, requests), progress=bar)
    bar.finish()
  return results


def _pass_rows(cfg: EvalConfig, methods: Mapping[str, Any],
               results: Mapping[str, tuple[Sequence, Any]], prompts: Sequence[Prompt],
               static: Mapping[str, Any], *, batch: int, rep: int,
               needs_draft: Sequence[str], kv_bytes: Mapping[str, int],
               check_lossless: bool, target_split) -> tuple[list[dict], list[dict]]:
  """Rows phase: the result rows and output records of one measured pass.

  Args:
    cfg: the evaluation.
    methods: name -> method, as ``results`` (``"ar"`` among them: the reference).
    results: name -> (outputs in request order, ``RunMetrics``), from ``_measured_pass``.
    prompts: the requests' prompts, in request order (categories of the records).
    static: ``_static_columns`` (leading columns of every row).
    batch, rep: the batch size and repeat of the pass.
    needs_draft: names of the methods that ran on ``cfg.draft``.
    kv_bytes: name -> device KV bytes per context token (``kv_bytes_per_token``).
    check_lossless: compare each SD method's outputs with AR's (greedy, real acceptance):
      sets ``lossless``, ``num_mismatched`` and the divergence columns, which need
      ``target_split`` (``harness.divergence``) where outputs differ.
    target_split: the target model, for the divergence margins.

  Returns:
    (one row per method in ``results`` order, one output record per request and method).

  Raises:
    KeyError: ``results`` without ``"ar"``.
  """
  ar_outs, ar_metrics = results["ar"]
  rows, records = [], []
  for name, (outs, met) in results.items():
    row, diverged = _row(name, methods[name], outs, met, ar_outs, ar_metrics,
                         check_lossless, target_split, cfg)
    rows.append({**static, "draft": cfg.draft if name in needs_draft else None,
                 "batch_size": batch, "repeat": rep, **row,
                 "kv_bytes_per_token": kv_bytes[name]})
    records.extend(
        _output_record(name, batch, rep, o, p, diverged, a)
        for o, p, a in zip(outs, prompts, compile_affected(outs, met.compile_windows))
    )
  return rows, records


def _results_frame(rows: Sequence[dict], k: int) -> pd.DataFrame:
  """Rows phase, whole run: the rows as a frame in column order (``_LEADING``, then
  per-position acceptance up to ``k``), plus what actually ran in this process: the
  paged-attention and verify backends and the small full-f32 matmul setting."""
  df = _order_columns(pd.DataFrame(list(rows)), k)
  # What actually ran (the requested list can fall through, e.g. pallas_gpu -> reference
  # for f32): every paged-attention backend traced in this process up to now.
  df["attention_backends_used"] = ",".join(implementations_used())
  # Fused-sampler backends traced in this process; the jnp sampler (or greedy argmax,
  # which every choice shares) when none was.
  df["verify_backends_used"] = ",".join(verify_implementations_used()) or "jnp_rejection_sample"
  # How full-f32 GPU projections of few rows ran (models.layers.set_small_f32_matmul).
  impl, max_rows = small_f32_matmul()
  df["small_f32_matmul"] = f"{impl}:{max_rows}" + (
      f" ({','.join(small_matmul_backends())})" if small_matmul_backends() else "")
  return df


def _run_peer(cfg: EvalConfig, df: pd.DataFrame, requests: Sequence[Request],
              output_records: list[dict]) -> pd.DataFrame | None:
  """``cfg.peer="hf"``: Hugging Face transformers on the same prompt ids, with
  specjax's rows of the smallest batch size beside them; None without a peer (or when
  torch/transformers are absent)."""
  if cfg.peer != "hf":
    return None
  from harness import hf_peer  # noqa: PLC0415

  peer_df = hf_peer.run_peer(cfg, requests, output_records)
  if peer_df is None:
    return None
  b = min(cfg.batch_sizes)  # specjax's rows of the same batch beside HF's
  mine = df[df["batch_size"] == b].groupby("method", sort=False)["tokens_per_s"].mean()
  return pd.concat([pd.DataFrame({"peer": [f"specjax_{m}" for m in mine.index],
                                  "batch_size": b, "tokens_per_s": mine.to_numpy()}),
                    peer_df], ignore_index=True)


def _print_report(cfg: EvalConfig, df: pd.DataFrame, peer_df: pd.DataFrame | None,
                  static: Mapping[str, Any], num_requests: int,
                  times_s: Mapping[str, float]) -> None:
  """Report phase: prints the summary table, the peer's rows, each row's notes, the
  run's workload and phase times in seconds (``times_s``: load+tokenize, warm-up,
  measured, total), compiles in measured passes and the files written."""
  compiles = int(df["num_compiles"].sum())
  print(summary_table(df).to_string(index=False))
  if peer_df is not None and len(peer_df):
    print("\npeer (same prompt ids):")
    print(peer_df.to_string(index=False, float_format=lambda x: f"{x:.3f}"))
  notes = df[df["notes"].astype(bool)]
  for _, r in notes.iterrows():
    print(f"notes {r['method']} b={r['batch_size']} r={r['repeat']}: {r['notes']}")
  rate = f", {cfg.request_rate:g} requests/s (Poisson)" if cfg.request_rate else ", offline"
  workload = (f"{cfg.dataset} x{cfg.num_prompts}, {cfg.max_new_tokens} new tokens"
              if cfg.acceptance == "real" else f"{cfg.acceptance} x{num_requests} (the "
              "records' lengths; acceptance replayed, not verified)")
  times = ", ".join(f"{name} {s:.1f}s" for name, s in times_s.items())
  print(f"\n{cfg.target} on {static['device']} ({static['backend']}), {workload}, "
        f"T={cfg.temperature}{rate}, "
        f"{cfg.repeats} repeats (mean ± std); time: {times}; "
        f"compiles in measured passes: {compiles}")
  if compiles and cfg.warmup:
    print("note: measured passes compiled; their compiled steps are left out of decode "
          "times and the requests alive meanwhile out of latencies")
  if cfg.output_dir is not None:
    print(f"wrote {cfg.output_dir}/: results.csv, results.json, categories.csv, "
          "outputs.jsonl" + (", figures (*.png)" if cfg.plots else ""))


def _device_profile(engines: Mapping[str, Engine], requests, rows: list[dict], batch: int,
                    output_dir: str | None, progress) -> None:
  """``EvalConfig.device_profile``: one more pass per method under ``jax.profiler``;
  sets ``device_ms`` (device busy ms per engine step, the pass's prefill wall time
  subtracted, as ``benchmarks.engine_loop`` does) and ``c_device`` (over AR's) on this
  batch size's rows, and writes ``ops_{method}_b{batch}.csv`` (every device op: ms and
  calls per step, and the HLO module and instruction it ran, where the trace says) under
  ``output_dir``."""
  device_ms = {}
  for name, engine in engines.items():
    engine.runtime.method_cache.clear()  # as after the warm-up: no carried responses
    with tempfile.TemporaryDirectory() as trace_dir:
      with jax.profiler.trace(trace_dir):
        _, met = engine.generate(_fit(engine, requests), progress=progress)
      steps = max(1, len(met.steps))
      device_ms[name] = 1e3 * (device_busy_seconds(trace_dir) - met.prefill_s) / steps
      if output_dir is not None:
        os.makedirs(output_dir, exist_ok=True)
        pd.DataFrame(ops_table(trace_dir, steps)).to_csv(os.path.join(output_dir, f"ops_{name}_b{batch}.csv"), index=False)
  for row in rows:
    if row["batch_size"] == batch and row["method"] in device_ms:
      row["device_ms"] = device_ms[row["method"]]
      row["c_device"] = device_ms[row["method"]] / device_ms["ar"]


def _fit(engine: Engine, requests: Sequence[Request]) -> Sequence[Request]:
  """``requests`` without their replayed acceptance for an engine that does not replay
  it (AR beside replayed SD methods)."""
  if engine.config.acceptance_replay:
    return requests
  return [dataclasses.replace(r, replay_acc_len=None) if r.replay_acc_len is not None else r
          for r in requests]


def _repeat_requests(requests: Sequence[Request], seed: int, rep: int) -> list[Request]:
  """``requests`` with per-request sampling seeds drawn from ``(seed, rep)``: every
  method of one repeat samples with the same keys, other repeats with other keys, and
  the same ``seed`` reproduces a repeat exactly (seeded requests do not depend on their
  batch partners)."""
  seeds = np.random.SeedSequence([seed, rep]).generate_state(len(requests)) % (2**31)
  return [dataclasses.replace(r, sampling=dataclasses.replace(r.sampling, seed=int(s)))
          for r, s in zip(requests, seeds)]


def _row(name, method, outs, met, ar_outs, ar_metrics, greedy, target, cfg
         ) -> tuple[dict, dict]:
  k = method.num_speculative_tokens
  s = summarize(met, outs, k, slo_ttft_s=cfg.slo_ttft_s, slo_tpot_s=cfg.slo_tpot_s)
  sp = speedups(met, ar_metrics, s["tau"], s["num_latency_excluded"])
  decode_s = sum(st.step_s for st in met.steady_steps())
  diverged: dict = {}
  lossless = None
  if greedy and name != "ar":
    for o, ref in zip(outs, ar_outs):
      d = divergence(target, ref.prompt_token_ids, ref.output_token_ids, o.output_token_ids)
      if d is not None:
        diverged[o.request_id] = d
    lossless = not diverged
  margins = [d.margin for d in diverged.values()]
  row = {
      "method": name,
      "method_config": json.dumps(method.describe(), sort_keys=True, default=str),
      "k": k,
      "tau": s["tau"],
      "acceptance_rate": s["acceptance_rate"],
      **{key: sp[key] for key in ("c", "share_matched", "S_pred", "measured_speedup",
                                  "e2e_speedup")},
      "wall_speedup": _ratio(ar_metrics.wall_s - ar_metrics.compile_s,
                             met.wall_s - met.compile_s),
      # end to end: output tokens / (steady decode steps + prefill)
      "tokens_per_s": _ratio(s["num_output_tokens"], decode_s + met.prefill_s),
      "decode_s": decode_s,
      "lossless": lossless,
      "num_mismatched": len(diverged) if lossless is not None else None,
      "first_divergence": json.dumps({str(r): d.position for r, d in diverged.items()}),
      # the target's top-2 logit margin at each divergence (near 0: a rounding near-tie)
      "divergence_margins": json.dumps({str(r): round(d.margin, 6) for r, d in diverged.items()}),
      "max_divergence_margin": max(margins) if margins else None,
      "notes": sp["notes"],
      **{key: sp[key] for key in ("tau_steady", "mix_factor", "prefill_share")},
      **{key: v for key, v in s.items() if key not in ("tau", "acceptance_rate")},
  }
  return row, diverged


def _output_record(method, batch, rep, out, prompt, diverged, compile_affected_) -> dict:
  return {
      "method": method,
      "batch_size": batch,
      "repeat": rep,
      "request_id": out.request_id,
      "category": prompt.category,
      "subcategory": prompt.subcategory,
      "prompt_tokens": len(out.prompt_token_ids),
      "prompt_token_ids": list(out.prompt_token_ids),
      "output_token_ids": out.output_token_ids,
      "text": out.text,
      "finish_reason": out.finish_reason,
      "num_steps": out.num_steps,
      "num_draft_tokens": out.num_draft_tokens,
      "num_accepted_tokens": out.num_accepted_tokens,
      "ttft_s": out.ttft_s,
      "tpot_s": out.tpot_s,
      "latency_s": out.latency_s,
      "queue_s": out.queue_s,
      "compile_affected": bool(compile_affected_),
      **_divergence_record(diverged.get(out.request_id)),
  }


def _divergence_record(d) -> dict:
  if d is None:
    return {"first_divergence": None}
  return {"first_divergence": d.position, "divergence_margin": d.margin,
          "divergence_tokens": [d.reference_token, d.other_token],
          "target_top2": [d.top1_token, d.top2_token]}


_LEADING = [
    "model", "draft", "method", "method_config", "k", "batch_size", "repeat", "dataset",
    "categories", "num_prompts", "max_new_tokens", "temperature", "request_rate", "tau",
    "acceptance_rate", "c", "share_matched", "S_pred", "measured_speedup", "e2e_speedup",
    "wall_speedup", "tokens_per_s", "decode_s", "lossless", "num_mismatched",
    "first_divergence", "notes",
]


def _order_columns(df: pd.DataFrame, k: int) -> pd.DataFrame:
  pos_cols = [f"accept_rate_pos{j + 1}" for j in range(k)]
  for col in pos_cols:
    if col not in df:
      df[col] = float("nan")
  rest = [c for c in df.columns if c not in _LEADING and c not in pos_cols]
  return df[[c for c in _LEADING if c in df] + pos_cols + rest]


def summary_table(df: pd.DataFrame) -> pd.DataFrame:
  """The printed table: per (method, batch size) the mean ± std over repeats of the
  ``SUMMARY_COLUMNS`` (online runs add the rate and TTFT/TPOT/queueing p50 and p99, and
  goodput when an SLO was set), as strings.

  ``lossless`` is True only if every repeat was; None (AR, or sampling) stays empty.
  """
  def all_true(values):
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return all(values) if values else None

  columns = dict(SUMMARY_COLUMNS)
  columns.pop("lossless")
  online = "request_rate" in df and df["request_rate"].notna().any()
  if online:
    columns.update({"ttft_p50_s": "TTFT_p50_s", "ttft_p99_s": "TTFT_p99_s",
                    "tpot_p50_s": "TPOT_p50_s", "tpot_p99_s": "TPOT_p99_s",
                    "queue_p50_s": "queue_p50_s", "requests_per_s": "req/s"})
  if "goodput_rps" in df and df["goodput_rps"].notna().any():
    columns["goodput_rps"] = "goodput_rps"
  numeric = [c for c in columns if c not in ("method", "batch_size") and c in df]
  agg = aggregate(df, columns=numeric)
  out = pd.DataFrame({"method": agg["method"], "batch": agg["batch_size"]})
  if online:
    out.insert(2, "rate", df.groupby(["method", "batch_size"], sort=False)["request_rate"]
               .first().to_numpy())
  for c in numeric:
    digits = 1 if c in ("tokens_per_s",) else 3
    out[columns[c]] = [format_mean_std(m, sd, digits)
                       for m, sd in zip(agg[f"{c}_mean"], agg[f"{c}_std"])]
  lossless = df.groupby(["method", "batch_size"], sort=False)["lossless"].agg(all_true)
  out["lossless"] = [("" if v is None else str(bool(v))) for v in lossless.to_numpy()]
  out["n"] = agg["n_repeats"]
  return out


def category_table(records: list[dict], df: pd.DataFrame) -> pd.DataFrame:
  """Per (method, batch size, category), pooled over repeats: ``tau`` (output tokens /
  engine steps of the category's requests), ``S_pred`` (that tau over the row's c) and
  ``latency_speedup`` (AR's summed decode time of those requests, TPOT x (tokens - 1),
  over the method's; prefill and queueing excluded), over the requests that no compile
  touched in either run (``n_latency_pairs`` of them). Spec-Bench's per-category view."""
  if not records:
    return pd.DataFrame()
  out = pd.DataFrame(records)
  out["n_out"] = out["output_token_ids"].map(len)
  out["decode_time_s"] = out["tpot_s"] * (out["n_out"] - 1).clip(lower=0)
  if "compile_affected" not in out:
    out["compile_affected"] = False
  key = ["batch_size", "repeat", "request_id"]
  ar = out[out["method"] == "ar"][key + ["decode_time_s", "compile_affected"]]
  paired = out.merge(ar, on=key, suffixes=("", "_ar"))
  paired = paired[~(paired["compile_affected"].astype(bool)
                    | paired["compile_affected_ar"].astype(bool))]
  lat = paired.groupby(["method", "batch_size", "category"], sort=False).agg(
      n_latency_pairs=("request_id", "size"), sd_time=("decode_time_s", "sum"),
      ar_time=("decode_time_s_ar", "sum"))
  c = df.groupby(["method", "batch_size"])["c"].mean()
  g = out.groupby(["method", "batch_size", "category"], sort=False).agg(
      n_requests=("request_id", "size"), tokens=("n_out", "sum"), steps=("num_steps", "sum"))
  g = g.join(lat).reset_index()
  g["tau"] = g["tokens"] / g["steps"].where(g["steps"] > 0)
  g["S_pred"] = [t / c.get((m, b), float("nan"))
                 for t, m, b in zip(g["tau"], g["method"], g["batch_size"])]
  g["latency_speedup"] = g["ar_time"] / g["sd_time"].where(g["sd_time"] > 0)
  g["n_latency_pairs"] = g["n_latency_pairs"].fillna(0).astype(int)
  return g.drop(columns=["sd_time", "ar_time"])


def run_summary(cfg: EvalConfig, df: pd.DataFrame, categories: pd.DataFrame,
                peer: pd.DataFrame | None = None) -> dict:
  """The ``results.json`` summary: settings, per (method, batch) mean/std/95 % interval
  of the ``harness.stats.SPREAD_COLUMNS``, per-position acceptance, lossless, notes,
  per-category rows and the peer's rows."""
  agg = aggregate(df)
  pos_cols = sorted((c for c in df if c.startswith("accept_rate_pos")),
                    key=lambda c: int(c.removeprefix("accept_rate_pos")))
  cells = []
  for _, a in agg.iterrows():
    g = df[(df["method"] == a["method"]) & (df["batch_size"] == a["batch_size"])]
    cell = {k: (None if isinstance(v, float) and math.isnan(v) else v)
            for k, v in a.items()}
    cell["accept_rate_per_position"] = [
        None if math.isnan(v) else v for v in g[pos_cols].mean().to_numpy(float)]
    lossless = [v for v in g["lossless"] if isinstance(v, bool)]
    cell["lossless"] = all(lossless) if lossless else None
    cell["notes"] = [n for n in g["notes"] if n]
    cell["num_compiles"] = int(g["num_compiles"].sum())
    cell["num_latency_excluded"] = int(g["num_latency_excluded"].sum())
    cells.append(cell)
  first = df.iloc[0]
  env = {k: (first[k].item() if hasattr(first[k], "item") else first[k])
         for k in ("device", "backend", "jax_version", "max_model_len", "attention_backends_used",
                   "verify_backends_used", "small_f32_matmul") if k in df}
  return {
      "config": dataclasses.asdict(cfg),
      "environment": env,
      "cells": cells,
      "categories": json.loads(categories.to_json(orient="records")) if len(categories) else [],
      "peer": json.loads(peer.to_json(orient="records")) if peer is not None else None,
  }


def _write(cfg: EvalConfig, df: pd.DataFrame, records: list[dict], categories: pd.DataFrame,
           peer: pd.DataFrame | None, *, figures: bool | None = None) -> None:
  """Writes the results files into ``cfg.output_dir``, and the figures when ``figures``
  (None: ``cfg.plots``)."""
  os.makedirs(cfg.output_dir, exist_ok=True)
  df.to_csv(os.path.join(cfg.output_dir, "results.csv"), index=False)
  categories.to_csv(os.path.join(cfg.output_dir, "categories.csv"), index=False)
  if peer is not None:
    peer.to_csv(os.path.join(cfg.output_dir, "peer.csv"), index=False)
  with open(os.path.join(cfg.output_dir, "outputs.jsonl"), "w", encoding="utf-8") as f:
    for r in records:
      f.write(json.dumps(r, ensure_ascii=False, default=str) + "\n")
  with open(os.path.join(cfg.output_dir, "config.json"), "w", encoding="utf-8") as f:
    json.dump(dataclasses.asdict(cfg), f, indent=2)
  with open(os.path.join(cfg.output_dir, "results.json"), "w", encoding="utf-8") as f:
    json.dump(run_summary(cfg, df, categories, peer), f, indent=2, default=str)
  if cfg.plots if figures is None else figures:
    from harness import plots  # noqa: PLC0415

    plots.evaluation_figures(cfg.output_dir, df, categories, records)
