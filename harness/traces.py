"""Per-position acceptance traces: what a step starting at each output position would
commit with each method, teacher-forced on the target's own greedy output.

Definition (the seed paper's, SpecDecode-Bench/simulator; methods_reference.md 1.7): for
a request with prompt p and greedy output g (n tokens), ``acc_len[i]`` (0 <= i < n) is
the number of tokens a step whose context is ``p + g[:i]`` commits: the accepted drafts
plus the one recovered/bonus token. Under greedy verification the target's argmax after
``p + g[:j]`` is g[j], so with draft d the step commits ``1 + LCP(d, g[i:])``, capped at
``n - i`` (the engine's budget: ``max_tokens - i - 1`` drafts). Position 0 is the
prefill's token (no engine step starts there); the simulator starts at i = 1.

Method-agnostic: the method's own ``propose`` runs on the teacher-forced context of every
position (all requests as rows of one batch), then ``observe`` sees the one token g[i]
committed there, as plain decoding would feed it. Host drafters (n-gram, suffix) and
device drafters with their own KV (draft model: its paged KV is given one page table per
request) work unchanged; methods that read target hidden states are refused (the trace
does not run the target forward per position).

Signals per position (pre-token: known before g[i] is seen):
  * record level ``signals.match_len[i]``: the longest n <= ``MATCH_CAP`` such that the
    context's last n tokens occur earlier in it (what prompt lookup / suffix matching
    keys on);
  * per method ``draft_len[i]``: drafts it proposed (at ``k_max``);
  * methods that emit draft probabilities: ``margin[i]`` (top-2 log-probability gap of the
    draft's first-token distribution at temperature 1 = its top-2 logit margin, nats)
    and ``entropy[i]`` (nats), from one extra one-token propose at temperature 1.

File format: JSONL, one request a line: ``id``, ``prompt_token_ids``,
``generated_token_ids``, ``acc_<method>: {"acc_len": [...], "draft_len": [...], ...}``,
``signals``, ``meta``. The seed's files (``acc_eagle``, ``acc_ngram``) read as methods
``eagle`` and ``ngram``.
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np

__all__ = ["MATCH_CAP", "MethodTrace", "TraceConfig", "TraceRecord", "build_traces",
           "match_lengths", "method_traces", "parse_replay", "replay_requests", "run_traces",
           "read_jsonl", "target_greedy_outputs", "write_jsonl"]

MATCH_CAP = 32


@dataclasses.dataclass
class MethodTrace:
  """One method on one request: ``acc_len i64[n]`` and ``extras`` name -> array[n]."""

  acc_len: np.ndarray
  extras: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class TraceRecord:
  """One request's trace: ids, per-method traces, context signals and metadata."""

  request_id: str
  prompt_token_ids: list
  generated_token_ids: list
  methods: dict
  signals: dict = dataclasses.field(default_factory=dict)
  meta: dict = dataclasses.field(default_factory=dict)

  def to_json(self) -> dict:
    d = {"id": str(self.request_id), "prompt_token_ids": [int(t) for t in self.prompt_token_ids],
         "generated_token_ids": [int(t) for t in self.generated_token_ids]}
    for name, t in self.methods.items():
      d[f"acc_{name}"] = {"acc_len": _list(t.acc_len), **{k: _list(v) for k, v in t.extras.items()}}
    if self.signals:
      d["signals"] = {k: _list(v) for k, v in self.signals.items()}
    if self.meta:
      d["meta"] = self.meta
    return d

  @classmethod
  def from_json(cls, d: dict) -> TraceRecord:
    """Reads this module's records and the seed simulator's.

    A method's ``acc_len`` may be shorter or longer than ``generated_token_ids``: its
    length is that method's output length (the seed's EAGLE-3 runs generated other
    continuation lengths than ``generated_token_ids``, its n-gram runs not).

    Raises:
      ValueError: missing ids, no ``acc_*`` entry, or an ``acc_len`` that is not a flat
        list or has a value < 1.
    """
    for key in ("id", "prompt_token_ids", "generated_token_ids"):
      if key not in d:
        raise ValueError(f"trace record lacks {key!r}; keys: {sorted(d)}")
    methods = {}
    for key, value in d.items():
      if key.startswith("acc_") and isinstance(value, dict) and "acc_len" in value:
        name = key[len("acc_"):]
        acc = np.asarray(value["acc_len"], np.int64)
        if acc.ndim != 1:
          raise ValueError(f"request {d['id']!r} {key}.acc_len must be a list of ints, got "
                           f"shape {acc.shape}")
        if not acc.size and d["generated_token_ids"]:
          raise ValueError(f"request {d['id']!r} {key}.acc_len is empty but the request has "
                           f"{len(d['generated_token_ids'])} generated tokens")
        if acc.size and acc.min() < 1:
          raise ValueError(f"request {d['id']!r} {key}.acc_len has value {int(acc.min())} at "
                           f"position {int(acc.argmin())}; every entry must be >= 1")
        extras = {k: np.asarray(v) for k, v in value.items() if k != "acc_len"}
        methods[name] = MethodTrace(acc, extras)
    if not methods:
      raise ValueError(f"request {d['id']!r} has no acc_<method> entry with acc_len")
    signals = {k: np.asarray(v) for k, v in d.get("signals", {}).items()}
    return cls(str(d["id"]), list(d["prompt_token_ids"]), list(d["generated_token_ids"]),
               methods, signals, d.get("meta", {}))


def _list(a) -> list:
  a = np.asarray(a)
  if np.issubdtype(a.dtype, np.floating):
    return [float(x) for x in a]
  return [int(x) for x in a]


def write_jsonl(path: str, records) -> None:
  with open(path, "w") as f:
    for r in records:
      f.write(json.dumps(r.to_json()) + "\n")


def read_jsonl(path: str) -> list[TraceRecord]:
  """All records of a JSONL trace file (ours or the seed's)."""
  with open(path) as f:
    return [TraceRecord.from_json(json.loads(line)) for line in f if line.strip()]


# ---------------------------------------------------------------------- replaying traces
def parse_replay(spec: str) -> tuple[str, str | None]:
  """``"replay:FILE[:METHOD]"`` -> ``(FILE, METHOD or None)``.

  Raises:
    ValueError: another form.
  """
  if not spec.startswith("replay:") or len(spec) == len("replay:"):
    raise ValueError(f"acceptance={spec!r} must look like replay:FILE[:METHOD]")
  body = spec[len("replay:"):]
  path, _, method = body.partition(":")
  return path, method or None


def replay_requests(records, method: str | None, *, vocab_size: int, seed: int = 0,
                    num_requests: int | None = None):
  """Requests that replay ``records``' acceptance (``EngineConfig.acceptance_replay``).

  Each request takes its record's prompt length and the method's output length
  (``max_tokens`` = len(acc_len), EOS ignored) and carries the method's ``acc_len`` as
  ``Request.replay_acc_len``; the prompt is the record's ids when they fit
  ``vocab_size``, else seeded random ids of the same length (e.g. Llama-3 ids on a
  smaller random-weight shape). Records without output are skipped.

  Args:
    records: ``TraceRecord`` list (``read_jsonl``).
    method: the trace method (``acc_<method>``); None: the records' only method.
    vocab_size: the target's vocabulary.
    seed: random prompt ids' seed.
    num_requests: the first this many usable records (None: all).

  Returns:
    ``list[specjax.request.Request]``, ids the records' ids.

  Raises:
    ValueError: no method given while a record has several, a record without it, or no
      usable record.
  """
  from specjax.request import Request, SamplingParams  # noqa: PLC0415

  rng = np.random.default_rng(seed)
  out = []
  for r in records:
    name = method
    if name is None:
      if len(r.methods) != 1:
        raise ValueError(f"request {r.request_id!r} has traces {sorted(r.methods)}: name one "
                         "(replay:FILE:METHOD)")
      (name,) = r.methods
    if name not in r.methods:
      raise ValueError(f"request {r.request_id!r} has no trace for method {name!r}; it has "
                       f"{sorted(r.methods)}")
    acc = r.methods[name].acc_len
    prompt = [int(t) for t in r.prompt_token_ids]
    if not prompt or not acc.size:
      continue
    if min(prompt) < 0 or max(prompt) >= vocab_size:
      prompt = [int(t) for t in rng.integers(0, vocab_size, len(prompt))]
    out.append(Request(r.request_id, tuple(prompt),
                       SamplingParams(max_tokens=int(acc.size), ignore_eos=True),
                       replay_acc_len=tuple(int(a) for a in acc)))
    if num_requests is not None and len(out) == num_requests:
      break
  if not out:
    raise ValueError("no trace record has a prompt and output to replay")
  return out


# ---------------------------------------------------------------------- building traces
def match_lengths(prompt, generated, cap: int = MATCH_CAP) -> np.ndarray:
  """``i64[n]``: for context ``prompt + generated[:i]``, the longest n <= ``cap`` whose
  last-n-token suffix also occurs earlier (0: even the last token is new).

  Example: prompt ``[5, 6, 7]``, generated ``[5, 6]``: i = 0 context [5, 6, 7] -> 0;
  i = 1 [5, 6, 7, 5] -> 1 ([5] at 0); i = 2 [5, 6, 7, 5, 6] -> 2 ([5, 6] at 0).
  """
  seq = np.asarray(list(prompt) + list(generated), np.int64)
  p = len(prompt)
  out = np.zeros(len(generated), np.int64)
  for i in range(len(generated)):
    ctx = seq[: p + i]
    best = 0
    for n in range(1, min(cap, len(ctx) - 1) + 1):
      windows = np.lib.stride_tricks.sliding_window_view(ctx[:-1], n)
      if not np.any(np.all(windows == ctx[-n:], axis=1)):
        break  # a longer suffix cannot occur if this one does not
      best = n
    out[i] = best
  return out


def target_greedy_outputs(target, requests, engine_config, eos_token_ids=()
                          ) -> list[list[int]]:
  """The target's greedy output ids per request (an AR ``specjax.engine.Engine`` run).

  Raises:
    ValueError: a request that is not greedy.
  """
  from methods.ar import AutoRegressive  # noqa: PLC0415
  from specjax.engine import Engine  # noqa: PLC0415

  for r in requests:
    if not r.sampling.greedy:
      raise ValueError(f"request {r.request_id!r} has temperature={r.sampling.temperature}; "
                       "traces are of greedy outputs (temperature 0)")
  outs, _ = Engine(target, AutoRegressive(), engine_config,
                   eos_token_ids=eos_token_ids).generate(list(requests))
  return [list(o.output_token_ids) for o in outs]


def _signals_from_probs(probs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(margin, entropy) in nats of ``f32[R, V]`` distributions."""
  top2 = -np.sort(-probs, axis=-1)[:, :2]
  with np.errstate(divide="ignore"):
    margin = np.log(top2[:, 0]) - np.log(np.maximum(top2[:, 1], 1e-30))
    logp = np.where(probs > 0, np.log(np.where(probs > 0, probs, 1.0)), 0.0)
  return margin, -np.sum(probs * logp, axis=-1)


def method_traces(method, runtime_models, prompts, outputs, *, k_max: int = 16,
                  page_size: int = 16, attention_implementation="reference",
                  seed: int = 0) -> list[MethodTrace]:
  """Teacher-forced trace of ``method`` (built with k = ``k_max``) for every request.

  Args:
    method: a ``specjax.method.Method`` whose ``num_speculative_tokens`` >= ``k_max``.
    runtime_models: ``(target, draft)`` split models (``specjax.steps.SplitModel``); the
      draft may be None for methods without one.
    prompts, outputs: per request, prompt ids and the target's greedy output ids.

  Returns:
    One ``MethodTrace`` per request (``acc_len``, ``draft_len``; ``margin`` and
    ``entropy`` when the method emits draft probabilities).

  Raises:
    ValueError: the method reads target hidden states, or its k is below ``k_max``.
  """
  from specjax.method import ProposeContext, RuntimeInfo, VerifyResult  # noqa: PLC0415
  from specjax.sampling import request_key  # noqa: PLC0415

  caps = method.capabilities()
  if caps.target_hidden_layers:
    raise ValueError(f"method {method.name!r} reads target hidden states "
                     f"{caps.target_hidden_layers}; teacher-forced traces run no target "
                     "forward per position, so such methods are not supported")
  if method.num_speculative_tokens < k_max:
    raise ValueError(f"method {method.name!r} has k={method.num_speculative_tokens}, must be "
                     f">= {k_max=}")
  num = len(prompts)
  longest = max(len(p) + len(o) for p, o in zip(prompts, outputs))
  pages_per_seq = math.ceil((longest + k_max + 2) / page_size)
  target, draft = runtime_models
  runtime = RuntimeInfo(target=target, draft=draft, num_pages=num * pages_per_seq,
                        page_size=page_size, max_model_len=pages_per_seq * page_size,
                        attention_implementation=attention_implementation)
  tables = np.arange(num * pages_per_seq, dtype=np.int32).reshape(num, pages_per_seq)
  keys = np.stack([np.asarray(request_key(seed + r), np.uint32) for r in range(num)])
  rids = [f"trace{r}" for r in range(num)]
  acc = [np.ones(len(o), np.int64) for o in outputs]
  draft_len = [np.zeros(len(o), np.int64) for o in outputs]
  with_probs = caps.emits_draft_probs
  margin = [np.full(len(o), np.nan) for o in outputs]
  entropy = [np.full(len(o), np.nan) for o in outputs]
  state = method.init_state(runtime)
  seen: set = set()
  for i in range(max((len(o) for o in outputs), default=0)):
    active = [r for r in range(num) if i < len(outputs[r])]
    rows = len(active)

    def context(temperature, budget, active=active, rows=rows, i=i):
      table = np.full((num, pages_per_seq), -1, np.int32)
      table[:rows] = tables[active]
      pad = np.zeros((num, 2), np.uint32)
      pad[:rows] = keys[active]
      ids = [rids[r] for r in active]
      return ProposeContext(
          request_ids=ids,
          token_ids=[np.asarray(list(prompts[r]) + list(outputs[r][:i]), np.int32)
                     for r in active],
          budgets=np.full(rows, budget, np.int32), page_indices=table,
          temperature=np.full(num, temperature, np.float32), top_k=np.zeros(num, np.int32),
          top_p=np.ones(num, np.float32), keys=pad,
          new_requests=frozenset(x for x in ids if x not in seen))

    if with_probs:
      state, d = method.propose(state, context(1.0, 1))
      seen.update(rids[r] for r in active)
      if d.probs is not None:
        m, e = _signals_from_probs(np.asarray(d.probs, np.float32)[:rows, 0])
        for j, r in enumerate(active):
          margin[r][i], entropy[r][i] = m[j], e[j]
    state, d = method.propose(state, context(0.0, k_max))
    seen.update(rids[r] for r in active)
    tokens = np.asarray(d.tokens)
    counts = np.minimum(np.asarray(d.num_tokens)[:rows], k_max)
    for j, r in enumerate(active):
      proposal = tokens[j, : counts[j]]
      truth = np.asarray(outputs[r][i: i + len(proposal)])
      match = proposal[: len(truth)] == truth
      lcp = len(match) if match.all() else int(np.argmin(match))
      acc[r][i] = min(1 + lcp, len(outputs[r]) - i)
      draft_len[r][i] = counts[j]
    state = method.observe(state, VerifyResult(
        request_ids=[rids[r] for r in active], num_accepted=np.zeros(rows, np.int32),
        emitted=[[int(outputs[r][i])] for r in active],
        finished=frozenset(rids[r] for r in active if i == len(outputs[r]) - 1)))
  out = []
  for r in range(num):
    extras = {"draft_len": draft_len[r]}
    if with_probs and not np.all(np.isnan(margin[r])):
      extras.update(margin=margin[r], entropy=entropy[r])
    out.append(MethodTrace(acc[r], extras))
  return out


def build_traces(target, draft, requests, methods: dict, engine_config, *, k_max: int = 16,
                 seed: int = 0, meta: dict | None = None, eos_token_ids=()
                 ) -> list[TraceRecord]:
  """Greedy outputs of ``target`` for ``requests`` and every method's trace.

  Args:
    target, draft: split models (``draft`` None if no method needs one).
    requests: greedy ``specjax.request.Request`` objects.
    methods: label -> method (built with k >= ``k_max``); the label names ``acc_<label>``.
    engine_config: the AR run's ``specjax.config.EngineConfig``.
    eos_token_ids: the target's EOS ids (end the greedy outputs as in the engine).
  """
  outputs = target_greedy_outputs(target, requests, engine_config, eos_token_ids)
  prompts = [list(r.prompt_token_ids) for r in requests]
  per_method = {label: method_traces(m, (target, draft), prompts, outputs, k_max=k_max,
                                     page_size=engine_config.page_size,
                                     attention_implementation=
                                     engine_config.attention_implementation, seed=seed)
                for label, m in methods.items()}
  return [TraceRecord(r.request_id, prompts[i], outputs[i],
                      {label: per_method[label][i] for label in methods},
                      {"match_len": match_lengths(prompts[i], outputs[i])},
                      {"k_max": k_max, **(meta or {})})
          for i, r in enumerate(requests)]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TraceConfig:
  """One trace file: a target, a workload and methods (``experiments/trace_acceptance``).

  Attributes:
    target, draft: ``models.zoo`` names or paths (``draft`` only if a method needs it).
    methods: ``methods.registry`` names, each built with k = ``k_max``.
    method_options: name -> extra config fields (as ``harness.evaluation``).
    dataset, num_prompts, categories, input_len, seed: the workload
      (``harness.workloads``; ``input_len`` for ``dataset="random"``).
    max_new_tokens: output tokens per request (EOS may end it earlier).
    k_max: the most drafts per traced step.
    batch_size: rows of the AR run that makes the greedy outputs.
    dtype, chat_template, page_size, attention_implementation: as the evaluation's.
    output_dir: the JSONL goes to ``output_dir/traces_<target>_<dataset>.jsonl``.
  """

  target: str
  draft: str | None = None
  methods: tuple[str, ...] = ("ngram",)
  method_options: dict = dataclasses.field(default_factory=dict)
  dataset: str = "spec_bench"
  num_prompts: int = 24
  categories: tuple[str, ...] | None = None
  input_len: int = 0
  seed: int = 0
  max_new_tokens: int = 256
  k_max: int = 16
  batch_size: int = 8
  dtype: str = "bfloat16"
  chat_template: bool = True
  page_size: int = 16
  attention_implementation: str = "reference"
  output_dir: str = "results/traces"

  def __post_init__(self):
    if self.k_max < 1:
      raise ValueError(f"k_max={self.k_max} must be >= 1")
    if not self.methods:
      raise ValueError("methods must name at least one method")
    if "ar" in self.methods:
      raise ValueError("methods must not include 'ar' (it drafts nothing)")
    if self.num_prompts < 1 or self.max_new_tokens < 1 or self.batch_size < 1:
      raise ValueError(f"num_prompts={self.num_prompts}, max_new_tokens="
                       f"{self.max_new_tokens}, batch_size={self.batch_size} must be >= 1")


def run_traces(cfg: TraceConfig) -> str:
  """Builds and writes the trace file of ``cfg``; returns its path."""
  import os  # noqa: PLC0415

  import jax  # noqa: PLC0415

  from harness.build import build_method, load_model  # noqa: PLC0415
  from harness.workloads import load_prompts, random_prompts, tokenize_prompts  # noqa: PLC0415
  from specjax.config import EngineConfig, SamplingParams  # noqa: PLC0415
  from specjax.request import Request  # noqa: PLC0415
  from specjax.steps import split_model  # noqa: PLC0415

  methods = {name: build_method(name, cfg.k_max, cfg.method_options.get(name, {}))
             for name in cfg.methods}
  needs_draft = [n for n, m in methods.items() if m.capabilities().needs_draft_model]
  if needs_draft and cfg.draft is None:
    raise ValueError(f"methods {needs_draft} need a draft model, but draft=None")
  target = load_model(cfg.target, cfg.dtype)
  draft = load_model(cfg.draft, cfg.dtype) if needs_draft else None
  tokenizer = target.tokenizer
  if cfg.dataset == "random":
    prompts = random_prompts(cfg.num_prompts, cfg.input_len, target.config.vocab_size, cfg.seed)
  else:
    prompts = load_prompts(cfg.dataset, cfg.num_prompts, cfg.categories, cfg.seed)
  prompt_ids = tokenize_prompts(prompts, tokenizer, chat_template=cfg.chat_template)
  sampling = SamplingParams(max_tokens=cfg.max_new_tokens, ignore_eos=tokenizer is None)
  requests = [Request(p.id, ids, sampling) for p, ids in zip(prompts, prompt_ids)]
  longest = max(len(ids) for ids in prompt_ids) + cfg.max_new_tokens + cfg.k_max + 2
  engine_cfg = EngineConfig(max_num_seqs=cfg.batch_size, max_model_len=longest,
                            page_size=cfg.page_size,
                            attention_implementation=cfg.attention_implementation)
  eos = () if tokenizer is None else tokenizer.eos_token_ids
  target_split = split_model(target.model)
  draft_split = split_model(draft.model) if draft is not None else None
  meta = {"target": cfg.target, "draft": cfg.draft, "dataset": cfg.dataset, "dtype": cfg.dtype,
          "device": jax.devices()[0].device_kind, "jax_version": jax.__version__,
          "methods": {n: m.describe() for n, m in methods.items()}}
  records = build_traces(target_split, draft_split, requests, methods, engine_cfg,
                         k_max=cfg.k_max, seed=cfg.seed, meta=meta, eos_token_ids=eos)
  os.makedirs(cfg.output_dir, exist_ok=True)
  name = os.path.basename(cfg.target.rstrip("/")).replace(":", "-")
  path = os.path.join(cfg.output_dir, f"traces_{name}_{cfg.dataset}.jsonl")
  write_jsonl(path, records)
  return path
