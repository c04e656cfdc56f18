"""Shared pieces of the engine tests: tiny models, an uncached greedy reference,
scripted chain and tree drafters, count simulators and the counter checks.

Compile time dominates these tests, so every engine test uses the same target and
draft graph (same ``ModelConfig``: the draft is the target with its layer weights
perturbed) and the same ``ENGINE_CONFIG``: one KV pool shape, a page-table width that
is always 4 pages (``max_model_len`` 32 / ``page_size`` 8), one prefill bucket (32)
and chain length ``K`` = 4. The jitted steps are then compiled once per batch bucket
(1, 2, 4, 8) and shared by every engine of the session.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import string

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.config import ModelConfig
from models.llama import Transformer, init_kv_caches
from pallas_kernels.paged_attention.metadata import AttentionMetadata
from specjax.config import EngineConfig, SamplingParams
from specjax.method import Capabilities, DeviceDraft, Draft, Method
from specjax.request import Request
from specjax.steps import SplitModel, split_model
from specjax.tree import chain_parents

__all__ = [
    "ALPHABET", "DIST_PROMPT", "DIST_TEMPERATURE", "DIST_TOP_K", "ENGINE_CONFIG", "K", "MAX_MODEL_LEN", "PAGE_SIZE", "ChainAsTree",
    "ScriptedDeviceDrafter", "ScriptedDrafter", "ScriptedTreeDrafter", "TableDrafter", "VOCAB", "assert_target_law", "build_model", "check_counters",
    "decode", "expected_counts", "full_logits", "top_k_joint", "greedy_reference", "law_requests", "make_requests",
    "model_config", "scripted_device_drafter", "scripted_drafter", "scripted_tree", "walk_tree",
]

VOCAB = 48
K = 4
MAX_MODEL_LEN = 32
PAGE_SIZE = 8
# 16 pages: 8 sequences of up to 16 positions fit (no preemption); longer ones preempt.
ENGINE_CONFIG = EngineConfig(max_num_seqs=8, max_model_len=MAX_MODEL_LEN, page_size=PAGE_SIZE,
                             num_pages=16, min_prefill_bucket=32)
ALPHABET = (string.ascii_letters + string.digits)[:VOCAB]  # one distinct char per token


def decode(ids) -> str:
  """Token ids -> text, one character per token (so stop strings map to token runs)."""
  return "".join(ALPHABET[int(i)] for i in ids)


def model_config(**overrides) -> ModelConfig:
  """2-layer Llama config, V=48, D=16, N=2, K=1, H=8, untied head."""
  base = dict(family="llama", vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
              num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8, tie_word_embeddings=False)
  return ModelConfig(**{**base, **overrides})


# Attention output and LM head scaled up: with plain 1/sqrt(fan_in) weights the tiny
# model falls into a one-token loop; these give varied, context-dependent outputs.
_GAIN = {"o": 3.0, "lm_head": 2.0}


def _fan_in(cfg: ModelConfig, name: str) -> int:
  return {"o": cfg.num_heads * cfg.head_dim, "down": cfg.intermediate_size}.get(
      name, cfg.hidden_size)


def build_model(cfg: ModelConfig, seed: int = 0, perturb: float = 0.0) -> SplitModel:
  """A split ``Transformer`` with O(1)-scaled random weights (numpy init: no compiles).

  Matrices are ``N(0, gain^2 / fan_in)``, embeddings ``N(0, 1)``, norm scales
  ``1 + N(0, 0.01)``, biases 0. ``perturb`` > 0 adds ``perturb``-scaled noise to every
  decoder-layer matrix, so the same ``seed`` gives a draft that agrees with the target
  only partly (and has the same graph, so it shares the target's compiled steps).
  Written against parameter names only, so it does not depend on the layer layout.
  """
  model = nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0)))
  rng, noise_rng = np.random.default_rng(seed), np.random.default_rng(10_000 + seed)
  new = {}
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    shape, dtype = var.get_value().shape, var.get_value().dtype
    name = str(path[-1])
    z = rng.standard_normal(shape)
    if name == "embed":
      value = z
    elif name.endswith("norm"):
      value = 1.0 + 0.1 * z
    elif name.endswith("bias"):
      value = np.zeros(shape)
    else:
      std = _GAIN.get(name, 1.0) / math.sqrt(_fan_in(cfg, name))
      value = std * z
      if perturb and name != "lm_head":
        value = value + perturb * std * noise_rng.standard_normal(shape)
    new[path] = var.replace(jnp.asarray(value, dtype))
  nnx.update(model, nnx.from_flat_state(new))
  return split_model(model)


def make_requests(rng_seed: int, n: int, *, prompt_len=(1, 12), max_tokens=None, prefix="r",
                  **sampling) -> list[Request]:
  """``n`` requests with random prompts of ``prompt_len`` (inclusive range) tokens.

  ``max_tokens`` is an inclusive range; None draws it so that prompt + output <= 17
  positions (with k = 4 every such request needs at most 2 pages of 8, so 8 of them
  fit the 16-page pool of ``ENGINE_CONFIG`` without preemption).
  """
  rng = np.random.default_rng(rng_seed)
  out = []
  for i in range(n):
    p = int(rng.integers(prompt_len[0], prompt_len[1] + 1))
    lo, hi = max_tokens if max_tokens is not None else (1, 17 - p)
    m = int(rng.integers(lo, max(lo, hi) + 1))
    prompt = tuple(int(t) for t in rng.integers(0, VOCAB, size=p))
    out.append(Request(f"{prefix}{i}", prompt, SamplingParams(max_tokens=m, **sampling)))
  return out


# ---------------------------------------------------------------- uncached reference
_REF_ROWS = 16


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _last_logits(graphdef, params, tokens, lengths):
  """Full (uncached) forward of each row into a fresh cache; logits at ``lengths - 1``."""
  model = nnx.merge(graphdef, params)
  batch, width = tokens.shape
  pages = width // PAGE_SIZE
  caches = init_kv_caches(model.cfg, batch * pages, PAGE_SIZE)
  table = jnp.arange(batch * pages, dtype=jnp.int32).reshape(batch, pages)
  meta = AttentionMetadata(table, lengths, lengths)
  _, out = model(caches, tokens, meta, logits_indices=jnp.maximum(lengths - 1, 0)[:, None])
  return out.logits[:, 0]


def full_logits(model: SplitModel, sequences) -> np.ndarray:
  """``f32[len(sequences), V]``: next-token logits after each sequence (uncached)."""
  res = []
  for start in range(0, len(sequences), _REF_ROWS):
    chunk = sequences[start: start + _REF_ROWS]
    tokens = np.zeros((_REF_ROWS, MAX_MODEL_LEN), np.int32)
    lengths = np.ones(_REF_ROWS, np.int32)
    for i, s in enumerate(chunk):
      tokens[i, : len(s)] = s
      lengths[i] = len(s)
    res.append(np.asarray(_last_logits(model.graphdef, model.params, tokens, lengths))[: len(chunk)])
  return np.concatenate(res)


def top_k_joint(model: SplitModel, prompt, temperature: float, top_k: int,
                num_tokens: int) -> dict:
  """``{tokens tuple: p}`` over the top-k support of the first ``num_tokens`` sampled
  tokens after ``prompt`` (temperature, then top-k; exact, from the uncached forward)."""
  def probs(logits):
    z = logits / temperature
    kth = np.sort(z, axis=-1)[..., -top_k][..., None]
    z = np.where(z >= kth, z, -np.inf)
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)

  joint = {(): 1.0}
  for _ in range(num_tokens):
    prefixes = list(joint)
    rows = probs(full_logits(model, [[*prompt, *c] for c in prefixes]))
    joint = {(*c, int(t)): joint[c] * row[t] for c, row in zip(prefixes, rows)
             for t in np.flatnonzero(row)}
  return joint


# The distribution tests' defaults: a short prompt, temperature 1.5 then top-3.
DIST_PROMPT = (7, 21, 3, 30, 12)
DIST_TEMPERATURE, DIST_TOP_K = 1.5, 3


def law_requests(num_samples: int, num_tokens: int, prompt=DIST_PROMPT, *, prefix: str = "d",
                 temperature: float = DIST_TEMPERATURE, top_k: int = DIST_TOP_K) -> list:
  """``num_samples`` requests for ``num_tokens`` sampled tokens after ``prompt``, seeds
  0 .. n-1 (ids ``{prefix}{i}``)."""
  return [Request(f"{prefix}{i}", tuple(prompt), SamplingParams(
      temperature=temperature, top_k=top_k, seed=i, max_tokens=num_tokens))
      for i in range(num_samples)]


def assert_target_law(model: SplitModel, outputs, num_tokens: int, prompt=DIST_PROMPT, *,
                      temperature: float = DIST_TEMPERATURE, top_k: int = DIST_TOP_K,
                      p_threshold: float = 1e-3) -> None:
  """The first ``num_tokens`` tokens of ``outputs`` (one per request of ``law_requests``)
  follow the target's exact joint law (``top_k_joint``): none outside its support, and a
  chi-square goodness-of-fit p-value above ``p_threshold`` (``chi_square_pvalue``)."""
  from models.testing import chi_square_pvalue  # noqa: PLC0415

  expected = top_k_joint(model, prompt, temperature, top_k, num_tokens)
  cells = sorted(expected)
  index = {cell: i for i, cell in enumerate(cells)}
  counts = np.zeros(len(cells))
  for o in outputs:
    cell = tuple(o.output_token_ids[:num_tokens])
    assert cell in index, cell  # nothing outside the target's top-k support
    counts[index[cell]] += 1
  probs = np.array([expected[cell] for cell in cells])
  assert abs(probs.sum() - 1.0) < 1e-5
  p_value = chi_square_pvalue(counts, probs, len(outputs))
  assert p_value > p_threshold, (p_value, counts, probs * len(outputs))


def greedy_reference(model: SplitModel, requests, eos_ids=()) -> list[list[int]]:
  """Greedy outputs by re-running the full forward per token (no KV reuse, no engine).

  Applies EOS / stop token ids, ``max_tokens`` and ``max_model_len`` (no stop strings).
  """
  seqs = [list(r.prompt_token_ids) for r in requests]
  outs: list[list[int]] = [[] for _ in requests]
  live = list(range(len(requests)))
  while live:
    logits = full_logits(model, [seqs[i] for i in live])
    still = []
    for i, row in zip(live, logits):
      tok = int(np.argmax(row))
      sp = requests[i].sampling
      seqs[i].append(tok)
      outs[i].append(tok)
      stop = (tok in eos_ids and not sp.ignore_eos) or tok in sp.stop_token_ids
      if not (stop or len(outs[i]) >= sp.max_tokens or len(seqs[i]) >= MAX_MODEL_LEN):
        still.append(i)
    live = still
  return outs


# ---------------------------------------------------------------- scripted drafter
@dataclasses.dataclass(frozen=True, kw_only=True)
class _Scripted(Method):
  """The options of the scripted drafters (host and fused)."""

  k: int = K
  script: tuple = ()
  num_right: int | None = None

  @property
  def num_speculative_tokens(self) -> int:
    return self.k


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScriptedDrafter(_Scripted):
  """Test-only drafter that replays a known greedy continuation.

  Attributes:
    k: draft length.
    script: ``((request_id, prompt_len, continuation), ...)``: the greedy AR output of
      each request, long enough to reach ``max_model_len``.
    num_right: None proposes the continuation (always right); j proposes its first j
      tokens and then wrong ones (j = 0: always wrong).
  """

  name = "scripted"

  def propose(self, state, context):
    table = {rid: (p, cont) for rid, p, cont in self.script}
    rows = len(context.request_ids)
    tokens = np.full((rows, self.k), -1, np.int32)
    num = np.zeros(rows, np.int32)
    for i, (rid, seq) in enumerate(zip(context.request_ids, context.token_ids)):
      prompt_len, cont = table[rid]
      done = len(seq) - prompt_len
      assert tuple(int(t) for t in seq[prompt_len:]) == tuple(cont[:done]), "off script"
      budget = int(context.budgets[i])
      right = budget if self.num_right is None else min(self.num_right, budget)
      draft = list(cont[done: done + right])
      draft += [(cont[done + j] + 1) % VOCAB for j in range(right, budget)]
      tokens[i, :budget] = draft
      num[i] = budget
    return state, Draft(tokens, num)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TableDrafter(Method):
  """Host M1 proposing fixed continuations of known contexts (none elsewhere)."""

  name = "table"
  k: int = K
  table: tuple = ()  # ((context tuple, tokens tuple), ...)

  @property
  def num_speculative_tokens(self):
    return self.k

  def propose(self, state, ctx):
    lookup = dict(self.table)
    rows = len(ctx.request_ids)
    tokens = np.full((rows, self.k), -1, np.int32)
    num = np.zeros(rows, np.int32)
    for i, seq in enumerate(ctx.token_ids):
      d = lookup.get(tuple(int(t) for t in seq), ())[: int(ctx.budgets[i])]
      tokens[i, : len(d)], num[i] = d, len(d)
    return state, Draft(tokens, num)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScriptedDeviceDrafter(_Scripted):
  """``ScriptedDrafter`` as a fused proposer (pure jnp): a row whose tokens are the first
  n of a script's prompt + continuation drafts the next ``budget`` tokens of it, right
  for the first ``num_right`` (None: all) and ``(right + 1) % VOCAB`` after; a row
  matching no script drafts nothing. The scripts are the ``init_device`` params.

  Attributes:
    k, num_right: as ``ScriptedDrafter``.
    script: ``((request_id, prompt tuple, continuation), ...)``
      (``scripted_device_drafter``).
  """

  name = "scripted_device"

  def capabilities(self):
    return Capabilities(runs_on="fused")

  def propose(self, state, context):
    raise NotImplementedError("ScriptedDeviceDrafter drafts in the fused step only")

  def init_device(self, runtime):
    seqs = np.full((len(self.script), MAX_MODEL_LEN + self.k), -2, np.int32)  # -2: no token
    for i, (_, prompt, cont) in enumerate(self.script):
      full = [*prompt, *cont][: seqs.shape[1]]
      seqs[i, : len(full)] = full
    return jnp.asarray(seqs), ()

  def propose_device(self, params, state, rows, *, all_greedy):
    seqs = params  # [R, M + k]
    width = rows.tokens.shape[1]
    known = jnp.arange(width)[None, None] < rows.num_tokens[:, None, None]  # [B, 1, M]
    match = jnp.all((seqs[None, :, :width] == rows.tokens[:, None]) | ~known, axis=-1)
    found = jnp.any(match, axis=-1) & rows.active  # [B]
    script = seqs[jnp.argmax(match, axis=-1)]  # [B, M + k]
    j = jnp.arange(self.k)[None]
    right = jnp.take_along_axis(
        script, jnp.minimum(rows.num_tokens[:, None] + j, seqs.shape[1] - 1), axis=1)
    tokens = right if self.num_right is None else jnp.where(j < self.num_right, right,
                                                            (right + 1) % VOCAB)
    num = jnp.where(found, jnp.minimum(rows.budgets, self.k), 0).astype(jnp.int32)
    tokens = jnp.where(j < num[:, None], jnp.maximum(tokens, 0), -1).astype(jnp.int32)
    return state, DeviceDraft(tokens, num)


def scripted_device_drafter(requests, reference,
                            num_right: int | None = None) -> ScriptedDeviceDrafter:
  """A ``ScriptedDeviceDrafter`` replaying ``reference`` for ``requests``."""
  conts = {rid: cont for rid, _, cont in _script_table(requests, reference)}
  script = tuple((r.request_id, tuple(r.prompt_token_ids), conts[r.request_id])
                 for r in requests)
  return ScriptedDeviceDrafter(k=K, script=script, num_right=num_right)


def scripted_drafter(requests, reference, num_right: int | None = None) -> ScriptedDrafter:
  """A ``ScriptedDrafter`` replaying ``reference`` (requests -> greedy outputs) for
  ``requests``, continued to ``max_model_len`` (no stops)."""
  return ScriptedDrafter(k=K, script=_script_table(requests, reference), num_right=num_right)


def _script_table(requests, reference):
  full = [Request(r.request_id, r.prompt_token_ids,
                  SamplingParams(max_tokens=MAX_MODEL_LEN, ignore_eos=True)) for r in requests]
  return tuple((r.request_id, len(r.prompt_token_ids), tuple(c))
               for r, c in zip(requests, reference(full)))


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScriptedTreeDrafter(Method):
  """Test-only tree drafter around a known greedy continuation.

  Level d (d = 1, 2, ..) gives the on-path node (the root for d = 1) ``branching``
  children: the right token at sibling rank ``right_rank`` and wrong tokens elsewhere;
  the first wrong child also gets a decoy child carrying the right token of depth
  d + 1 (under a wrong parent, so it must never be accepted). Nodes are listed level
  by level (decoys after their level), so a budget keeps the shallow levels.

  Attributes:
    k: most nodes per tree.
    script: as ``ScriptedDrafter``.
    branching: children of each on-path node (>= 1).
    right_rank: sibling rank of the right child (< branching).
    num_right: None: right at every depth; j: right for the first j depths only.
  """

  name = "scripted_tree"
  k: int = 12
  script: tuple = ()
  branching: int = 2
  right_rank: int = 1
  num_right: int | None = None

  @property
  def num_speculative_tokens(self) -> int:
    return self.k

  def build(self, cont, done: int, budget: int):
    """``(tokens, parents)`` lists of the tree after ``done`` output tokens."""
    tok_at = lambda i: cont[i] if i < len(cont) else 0
    tokens, parents = [], []
    on_path, depth = -1, 1
    while len(tokens) < budget:
      right = tok_at(done + depth - 1)
      first_wrong = None
      level_right = None
      for r in range(self.branching):
        ok = r == self.right_rank and (self.num_right is None or depth <= self.num_right)
        tokens.append(right if ok else (right + 1 + r) % VOCAB)
        parents.append(on_path)
        if r == self.right_rank:
          level_right = len(tokens) - 1
        elif first_wrong is None:
          first_wrong = len(tokens) - 1
      if first_wrong is not None:
        tokens.append(tok_at(done + depth))
        parents.append(first_wrong)
      on_path, depth = level_right, depth + 1
    return tokens[:budget], parents[:budget]

  def propose(self, state, context):
    table = {rid: (p, cont) for rid, p, cont in self.script}
    rows = len(context.request_ids)
    tokens = np.full((rows, self.k), -1, np.int32)
    parents = np.full((rows, self.k), -1, np.int32)
    num = np.zeros(rows, np.int32)
    for i, (rid, seq) in enumerate(zip(context.request_ids, context.token_ids)):
      prompt_len, cont = table[rid]
      done = len(seq) - prompt_len
      assert tuple(int(t) for t in seq[prompt_len:]) == tuple(cont[:done]), "off script"
      toks, pars = self.build(cont, done, int(context.budgets[i]))
      tokens[i, : len(toks)], parents[i, : len(pars)], num[i] = toks, pars, len(toks)
    return state, Draft(tokens, num, parents=parents)


def scripted_tree(requests, reference, **options) -> ScriptedTreeDrafter:
  """A ``ScriptedTreeDrafter`` replaying ``reference`` for ``requests``."""
  return ScriptedTreeDrafter(script=_script_table(requests, reference), **options)


def walk_tree(tokens, parents, truth) -> int:
  """Accepted path length of a greedy walk: from the root, take the first child whose
  token is ``truth[depth]`` (plain Python, independent of ``specjax.verify``)."""
  cur, depth = -1, 0
  for j, (t, p) in enumerate(zip(tokens, parents)):
    if p == cur and depth < len(truth) and t == truth[depth]:
      cur, depth = j, depth + 1
  return depth


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChainAsTree(Method):
  """Wraps a chain method and hands its drafts to the engine as one-branch trees."""

  name = "chain_as_tree"
  inner: Method

  @property
  def num_speculative_tokens(self) -> int:
    return self.inner.num_speculative_tokens

  def capabilities(self):
    return dataclasses.replace(self.inner.host_capabilities(), tree=True)

  def init_state(self, runtime):
    return self.inner.init_state(runtime)

  def propose(self, state, context):
    state, d = self.inner.propose(state, context)
    parents = chain_parents(*d.tokens.shape)
    return state, Draft(d.tokens, d.num_tokens, probs=d.probs, parents=parents)

  def observe(self, state, result):
    return self.inner.observe(state, result)

  def observe_prefill(self, state, result):
    return self.inner.observe_prefill(state, result)


def expected_counts(prompt_len: int, num_output: int, max_tokens: int, *, k: int = K,
                    num_right: int | None = None, max_model_len: int = MAX_MODEL_LEN):
  """Per-step ``(drafted, accepted, emitted)`` of one greedy request fed by
  ``ScriptedDrafter`` that ends after ``num_output`` tokens.

  Example (k = 4, always right, 7 outputs, max_tokens 26): step 1 drafts 4, accepts 4
  and emits 5 (4 drafts + bonus); step 2 drafts 4, accepts 4, but the request ends after
  2 more tokens, so it emits 2 and counts 2 accepted: ``[(4, 4, 5), (4, 2, 2)]``.
  """
  steps, done = [], 0
  while done < num_output:
    budget = max(0, min(k, max_model_len - (prompt_len + done), max_tokens - done - 1))
    accepted = budget if num_right is None else min(num_right, budget)
    emitted = min(accepted + 1, num_output - done)
    steps.append((budget, min(accepted, emitted), emitted))
    done += emitted
  return steps


# ---------------------------------------------------------------- counter checks
def check_counters(metrics, outputs, k: int, tree: bool = False) -> None:
  """G5: per-step and per-request counters are consistent with the outputs.

  ``tree``: drafts are trees, so draft tokens count nodes and ``drafted_per_position``
  counts rows reaching each depth (its sum is at most the node count).
  """
  for s in metrics.steps:
    assert 1 <= s.num_rows <= s.batch_bucket
    assert 0 <= s.num_accepted <= s.num_draft_tokens, s
    assert s.num_accepted <= s.num_emitted <= s.num_accepted + s.num_rows, s
    acc, drafted = np.asarray(s.accepted_per_position), np.asarray(s.drafted_per_position)
    assert acc.shape == drafted.shape == (k,)
    if k:
      assert np.all(acc >= 0) and np.all(acc <= drafted), s
      assert np.all(np.diff(acc) <= 0) and np.all(np.diff(drafted) <= 0), s
      assert acc.sum() == s.num_accepted, s
      if tree:
        assert drafted.sum() <= s.num_draft_tokens, s
      else:
        assert drafted.sum() == s.num_draft_tokens, s
    else:
      assert s.num_draft_tokens == 0 and s.num_emitted == s.num_rows
  total_out = sum(len(o.output_token_ids) for o in outputs)
  assert sum(s.num_emitted for s in metrics.steps) == total_out
  assert sum(s.num_accepted for s in metrics.steps) == sum(o.num_accepted_tokens for o in outputs)
  assert sum(s.num_draft_tokens for s in metrics.steps) == sum(o.num_draft_tokens for o in outputs)
  assert sum(s.num_rows for s in metrics.steps) == sum(o.num_steps for o in outputs)
  for o in outputs:
    # Every step commits accepted + 1 tokens, except a last step cut short by a stop.
    n = len(o.output_token_ids)
    assert n in (o.num_accepted_tokens + o.num_steps, o.num_accepted_tokens + o.num_steps - 1), o
    assert 0 <= o.num_accepted_tokens <= o.num_draft_tokens
