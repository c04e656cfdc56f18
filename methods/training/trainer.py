"""Draft-head training loop: optax AdamW, orbax checkpoints, CSV metrics, tqdm.

Each step runs the (frozen) target over a batch of sequences to get its features and
greedy labels, unrolls the head ``depth`` steps (EAGLE-3's training-time test; MTP
modules; Medusa heads) and minimises the cross-entropy against the target's greedy
token (or, with ``soft_labels``, against the target's whole next-token distribution
over the head's vocabulary, as EAGLE-3 trains: Li et al. 2025), weighted ``0.8 ** u``
at depth u (EAGLE-1 adds its smooth-L1 feature loss with
the paper's 1 : 0.1 regression : classification weighting). The LayerSkip exit adapter
(``early_exit``) has depth 1: the CE of the target's greedy token at each position
through the target's final norm and LM head applied to the adapted layer-E state.

Optimiser: ``clip_by_global_norm`` then AdamW with linear warm-up and cosine decay
(to 10 % of the peak). Batches are a pure function of ``(seed, step)``
(``data.batch_indices``) and the train state is checkpointed with orbax, so a resumed
run reproduces the uninterrupted loss curve bit for bit on CPU.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm.auto import tqdm

from methods.training.data import TokenDataset, batch_indices, draft_vocabulary
from models.heads import HEAD_KINDS, HeadConfig, head_class, make_head, save_head
from models.llama import init_kv_caches
from pallas_kernels.paged_attention.metadata import AttentionMetadata
from specjax.steps import SplitModel, split_model

__all__ = ["TrainConfig", "TrainResult", "make_optimizer", "target_features", "train"]

_PAGE = 16


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
  """One head-training run.

  Attributes:
    kind: head kind (``models.heads.HEAD_KINDS``).
    steps: optimiser steps.
    batch_size: sequences per step.
    learning_rate: peak learning rate.
    warmup_steps: linear warm-up steps (then cosine decay to 10 % at ``steps``).
    weight_decay: AdamW decoupled weight decay.
    clip_norm: global gradient-norm clip.
    depth: unrolled draft depth trained per step (EAGLE-3 training-time test; MTP and
      Medusa train modules/heads 1..depth); None = 1 for EAGLE-1 and early_exit, 3 for
      EAGLE-3, ``num_modules`` for MTP and Medusa.
    num_modules: MTP modules / Medusa heads.
    window: head attention window (EAGLE, MTP).
    feature_layers: target taps; None = the kind's default (early_exit: ``(E,)``, the
      exit layer, default ``num_layers // 4``).
    draft_vocab_size: EAGLE-3 reduced vocabulary (most frequent ids of the training
      data) with the head's own LM head, which starts as the target LM head's columns
      of those ids (``DraftHead.init_from_target``); None = full vocabulary.
    soft_labels: distil the target's next-token distribution (softmax of its logits
      over the head's vocabulary) instead of its greedy token; the top-1 metrics still
      score the greedy token.
    seed: head init, batch order.
    eval_every: held-out evaluation period in steps (and at the last step).
    checkpoint_every: orbax checkpoint period in steps (and at the last step).
    output_dir: checkpoints, ``metrics.csv``, ``metrics.png``, the exported ``head/``.
    progress: show a tqdm bar.
  """

  kind: str
  steps: int = 100
  batch_size: int = 8
  learning_rate: float = 3e-4
  warmup_steps: int = 10
  weight_decay: float = 0.0
  clip_norm: float = 0.5
  depth: int | None = None
  num_modules: int = 4
  window: int = 64
  feature_layers: tuple[int, ...] | None = None
  draft_vocab_size: int | None = None
  soft_labels: bool = False
  seed: int = 0
  eval_every: int = 25
  checkpoint_every: int = 25
  output_dir: str = "draft_head"
  progress: bool = True

  def __post_init__(self):
    if self.kind not in HEAD_KINDS:
      raise ValueError(f"kind={self.kind!r} must be one of {HEAD_KINDS}")
    for name in ("steps", "batch_size", "eval_every", "checkpoint_every", "num_modules",
                 "window"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
    if not self.learning_rate > 0:
      raise ValueError(f"learning_rate={self.learning_rate} must be > 0")
    if self.warmup_steps < 0:
      raise ValueError(f"warmup_steps={self.warmup_steps} must be >= 0")
    if self.depth is not None and self.depth < 1:
      raise ValueError(f"depth={self.depth} must be >= 1")
    head = head_class(self.kind)
    if head.max_train_depth is not None and self.train_depth > head.max_train_depth:
      raise ValueError(f"depth={self.depth} must be <= {head.max_train_depth} (or None) for "
                       f"kind={self.kind!r}")
    if head.has_modules and self.train_depth > self.num_modules:
      raise ValueError(f"depth={self.depth} must be <= num_modules={self.num_modules}")
    if self.feature_layers is not None:
      object.__setattr__(self, "feature_layers", tuple(self.feature_layers))

  @property
  def train_depth(self) -> int:
    if self.depth is not None:
      return self.depth
    default = head_class(self.kind).train_depth
    return self.num_modules if default is None else default

  def head_config(self, target) -> HeadConfig:
    extra = {"num_modules": self.num_modules} if head_class(self.kind).has_modules else {}
    if self.feature_layers is not None:
      extra["feature_layers"] = self.feature_layers
    return HeadConfig.for_target(self.kind, target, window=self.window,
                                 draft_vocab_size=self.draft_vocab_size, **extra)


@dataclasses.dataclass
class TrainResult:
  """``head``: the trained module; ``losses``: ``f32[steps]`` train loss per step (this
  run's and the restored ones, read back from the CSV); ``head_dir``: the export."""

  head: nnx.Module
  losses: np.ndarray
  metrics_csv: str
  head_dir: str
  tokens_per_s: float


def _schedule(cfg: TrainConfig) -> optax.Schedule:
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=cfg.learning_rate, warmup_steps=cfg.warmup_steps,
      decay_steps=max(cfg.steps, cfg.warmup_steps + 1), end_value=0.1 * cfg.learning_rate)


@functools.lru_cache(maxsize=16)
def _optimizer(learning_rate, warmup_steps, steps, clip_norm, weight_decay):
  cfg = TrainConfig(kind="eagle", learning_rate=learning_rate, warmup_steps=warmup_steps,
                    steps=steps)
  return optax.chain(optax.clip_by_global_norm(clip_norm),
                     optax.adamw(_schedule(cfg), weight_decay=weight_decay))


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
  """Global-norm clipping, then AdamW with warm-up + cosine decay.

  The same optimiser fields give the same object (it is a static jit argument, so a
  resumed run reuses the compiled step).
  """
  return _optimizer(cfg.learning_rate, cfg.warmup_steps, cfg.steps, cfg.clip_norm,
                    cfg.weight_decay)


def target_features(target, tokens, lengths, feature_layers: tuple[int, ...],
                    return_logits: bool = False):
  """Full (uncached) target forward over dense rows.

  Args:
    target: the target ``Transformer``.
    tokens: ``i32[B, T]`` with T a multiple of 16.
    lengths: ``i32[B]``.
    feature_layers: HF ``hidden_states`` indices, concatenated into F.
    return_logits: also return the target's logits.

  Returns:
    ``(feats f32[B, T, F], labels i32[B, T])``: ``labels[:, p]`` is the target's greedy
    token after position p; with ``return_logits`` a third entry, ``f32[B, T, V]``
    (no gradient).
  """
  batch, width = tokens.shape
  pages = width // _PAGE
  caches = init_kv_caches(target.cfg, batch * pages, _PAGE)
  table = jnp.arange(batch * pages, dtype=jnp.int32).reshape(batch, pages)
  meta = AttentionMetadata(table, lengths, lengths)
  _, out = target(caches, tokens, meta, hidden_layers=feature_layers)
  feats = jnp.concatenate([h.astype(jnp.float32) for h in out.hidden], -1)
  labels = jnp.argmax(out.logits, -1).astype(jnp.int32)
  if return_logits:
    return jax.lax.stop_gradient(feats), labels, jax.lax.stop_gradient(out.logits)
  return jax.lax.stop_gradient(feats), labels


def _loss(params, rest, head_graphdef, target, tokens, lengths, prompt_lengths, depth,
          soft_labels):
  """Returns ``(loss, (hits, valid, response))``, each ``bool[U, B, T]``: depth u's top-1
  agreement at output q, whether q has a label, and whether that label is a response
  token a row of the data drafts: token index in [prompt length, length - 1] (the
  engine's prefill is KV only, so the first decode step already drafts the first
  response token; the label after the last token is never drafted). With
  ``soft_labels`` the cross-entropy is against ``softmax`` of the target's logits over
  the head's vocabulary at the label's position (EAGLE-3's loss)."""
  head = nnx.merge(head_graphdef, params, rest)
  cfg = head.cfg
  feats, labels, tlogits = target_features(target, tokens, lengths, cfg.feature_layers,
                                           return_logits=True)
  soft = jax.nn.softmax(head.from_target_logits(tlogits), -1) if soft_labels else None
  outs = head.unrolled(target, tokens, feats, lengths, depth)
  b, t = tokens.shape
  q = jnp.arange(t)[None]
  total, norm = 0.0, 0.0
  hits, valids, responses = [], [], []
  for u, g in enumerate(outs):
    shift, first = head.label_offset(u)
    lab = jnp.concatenate([labels[:, shift:], jnp.zeros((b, shift), jnp.int32)], 1)
    valid = (q >= first) & (q + shift <= lengths[:, None] - 1)
    lab_d = head.draft_ids(lab)
    in_vocab = valid & (lab_d >= 0)
    logits = head.train_logits(target, g, u)
    logp = jax.nn.log_softmax(logits, -1)
    if soft is None:
      nll = -jnp.take_along_axis(logp, jnp.maximum(lab_d, 0)[..., None], -1)[..., 0]
    else:
      p = jnp.concatenate([soft[:, shift:], jnp.zeros_like(soft[:, :shift])], 1)
      nll = -jnp.sum(p * logp, -1)
    count = jnp.maximum(valid.sum(), 1)
    ce = jnp.sum(jnp.where(in_vocab, nll, 0.0)) / count
    w = 0.8**u
    if type(head).regresses_features:  # regress the next feature f_{q+1}
      nxt = jnp.concatenate([feats[:, 1:], jnp.zeros_like(feats[:, :1])], 1)
      reg = jnp.sum(jnp.where(valid[..., None], optax.huber_loss(g, nxt), 0.0)) / count
      total = total + w * (reg + 0.1 * ce)
    else:
      total = total + w * ce
    norm += w
    hits.append((jnp.argmax(logits, -1) == lab_d) & in_vocab)
    valids.append(valid)
    index = q + shift + 1  # the label's token index
    responses.append(valid & (index >= prompt_lengths[:, None])
                     & (index <= lengths[:, None] - 1))
  return total / norm, (jnp.stack(hits), jnp.stack(valids), jnp.stack(responses))


@functools.partial(jax.jit, static_argnames=("head_graphdef", "target_graphdef", "depth",
                                             "optimizer", "soft_labels"))
def _train_step(params, opt_state, rest, head_graphdef, target_graphdef, target_params, tokens,
                lengths, *, depth, optimizer, soft_labels=False):
  target = nnx.merge(target_graphdef, target_params)
  no_prompt = jnp.zeros_like(lengths)
  (loss, (hits, valid, _)), grads = jax.value_and_grad(_loss, has_aux=True)(
      params, rest, head_graphdef, target, tokens, lengths, no_prompt, depth, soft_labels)
  updates, opt_state = optimizer.update(grads, opt_state, params)
  params = optax.apply_updates(params, updates)
  acc = hits.sum((1, 2)) / jnp.maximum(valid.sum((1, 2)), 1)
  return params, opt_state, loss, optax.tree.norm(grads), acc


@functools.partial(jax.jit, static_argnames=("head_graphdef", "target_graphdef", "depth",
                                             "soft_labels"))
def _eval_step(params, rest, head_graphdef, target_graphdef, target_params, tokens, lengths,
               prompt_lengths, *, depth, soft_labels=False):
  """``(loss, per-depth f32[4, U]: hits, labels, response hits, response labels)``."""
  target = nnx.merge(target_graphdef, target_params)
  loss, (hits, valid, resp) = _loss(params, rest, head_graphdef, target, tokens, lengths,
                                    prompt_lengths, depth, soft_labels)
  sums = [hits, valid, hits & resp, resp]
  return loss, jnp.stack([x.sum((1, 2)).astype(jnp.float32) for x in sums])


def _pad_width(data: TokenDataset) -> TokenDataset:
  width = _PAGE * math.ceil(data.tokens.shape[1] / _PAGE)
  if width == data.tokens.shape[1]:
    return data
  tokens = np.zeros((len(data), width), np.int32)
  tokens[:, : data.tokens.shape[1]] = data.tokens
  return TokenDataset(tokens, data.lengths, data.prompt_lengths)


def _csv_rows(path: str, upto: int) -> list[dict]:
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [r for r in csv.DictReader(f) if int(r["step"]) <= upto]


def train(cfg: TrainConfig, target, train_data: TokenDataset, held_out: TokenDataset, *,
          stop_after: int | None = None) -> TrainResult:
  """Trains (or resumes training) a head for ``target``.

  Args:
    cfg: the run.
    target: the target ``Transformer`` or ``SplitModel`` (frozen).
    train_data, held_out: sequences from ``methods.training.data``.
    stop_after: stop once this many steps are done in total (simulates an interruption;
      the state is checkpointed there). None runs to ``cfg.steps``.

  Returns:
    ``TrainResult``.

  Raises:
    ValueError: empty data, or a head that does not fit ``target``.
  """
  import orbax.checkpoint as ocp  # noqa: PLC0415

  if len(train_data) == 0 or len(held_out) == 0:
    raise ValueError("train_data and held_out must be non-empty")
  target = target if isinstance(target, SplitModel) else split_model(target)
  train_data, held_out = _pad_width(train_data), _pad_width(held_out)
  head_cfg = cfg.head_config(target.config)
  head_cfg.check_target(target.config)
  d2t = None
  if head_cfg.draft_vocab_size is not None:
    d2t = draft_vocabulary(train_data, head_cfg.draft_vocab_size, head_cfg.vocab_size)
  head = make_head(head_cfg, cfg.seed, d2t)
  head.init_from_target(nnx.merge(target.graphdef, target.params))
  graphdef, params, rest = nnx.split(head, nnx.Param, ...)
  optimizer = make_optimizer(cfg)
  opt_state = optimizer.init(params)
  depth = cfg.train_depth

  out_dir = os.path.abspath(cfg.output_dir)
  os.makedirs(out_dir, exist_ok=True)
  manager = ocp.CheckpointManager(
      os.path.join(out_dir, "checkpoints"),
      options=ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=False))
  start = 0
  if manager.latest_step() is not None:
    start = int(manager.latest_step())
    restored = manager.restore(start, args=ocp.args.StandardRestore(
        {"params": params, "opt_state": opt_state}))
    # Host round trip: restored arrays come back committed to a device, which would
    # give the jitted step a new cache key (a recompile); values are unchanged.
    restored = jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), restored)
    params, opt_state = restored["params"], restored["opt_state"]
  csv_path = os.path.join(out_dir, "metrics.csv")
  fields = (["step", "loss", "learning_rate", "grad_norm", "tokens_per_s", "held_out_loss"]
            + [f"held_out_top1_pos{u + 1}" for u in range(depth)]
            + [f"held_out_response_top1_pos{u + 1}" for u in range(depth)])
  rows = _csv_rows(csv_path, start)
  schedule_lr = _schedule(cfg)

  def write_csv():
    with open(csv_path, "w", newline="") as f:
      w = csv.DictWriter(f, fieldnames=fields)
      w.writeheader()
      w.writerows(rows)

  end = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
  bar = tqdm(total=cfg.steps, initial=start, disable=not cfg.progress, desc=f"train {cfg.kind}")
  num_tokens, t_run = 0, 0.0
  for step in range(start, end):
    idx = batch_indices(step, cfg.batch_size, len(train_data), cfg.seed)
    batch = train_data.take(idx)
    t0 = time.perf_counter()
    params, opt_state, loss, gnorm, _ = _train_step(
        params, opt_state, rest, graphdef, target.graphdef, target.params, batch.tokens,
        batch.lengths, depth=depth, optimizer=optimizer, soft_labels=cfg.soft_labels)
    loss = float(loss)
    dt = time.perf_counter() - t0
    if step > start:  # the first step of a run includes compilation
      num_tokens += int(batch.lengths.sum())
      t_run += dt
    row = {"step": step + 1, "loss": repr(loss), "learning_rate": repr(float(schedule_lr(step))),
           "grad_norm": repr(float(gnorm)), "tokens_per_s": f"{batch.lengths.sum() / dt:.1f}"}
    if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
      ev = _evaluate(params, rest, graphdef, target, held_out, cfg.batch_size, depth,
                     cfg.soft_labels)
      row["held_out_loss"] = repr(ev[0])
      for u, (a, r) in enumerate(zip(ev[1], ev[2])):
        row[f"held_out_top1_pos{u + 1}"] = f"{a:.6f}"
        row[f"held_out_response_top1_pos{u + 1}"] = f"{r:.6f}"
      bar.set_postfix(loss=f"{loss:.3f}", top1=" ".join(f"{a:.2f}" for a in ev[1]),
                      response_top1=" ".join(f"{a:.2f}" for a in ev[2]))
    rows.append(row)
    bar.update(1)
    if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == end:
      manager.save(step + 1, args=ocp.args.StandardSave({"params": params,
                                                         "opt_state": opt_state}))
      write_csv()
  bar.close()
  manager.wait_until_finished()
  write_csv()
  nnx.update(head, params)
  head_dir = os.path.join(out_dir, "head")
  if end == cfg.steps:
    save_head(head_dir, head)
    _plot(rows, depth, os.path.join(out_dir, "metrics.png"))
  losses = np.asarray([float(r["loss"]) for r in rows], np.float64)
  return TrainResult(head, losses, csv_path, head_dir,
                     num_tokens / t_run if t_run > 0 else float("nan"))


def _evaluate(params, rest, graphdef, target, data: TokenDataset, batch_size: int, depth: int,
              soft_labels: bool = False):
  """Held-out ``(mean loss, per-depth top-1 agreement f32[U], the same over drafted
  response tokens only f32[U])`` over fixed batches (nan where a depth has no label).

  The second is what the engine's per-position acceptance rate estimates (greedy, on this
  data's distribution); the first also counts prompt positions.
  """
  sums = np.zeros((4, depth))
  losses = []
  n = len(data)
  for s in range(0, n, batch_size):
    idx = np.arange(s, s + batch_size) % n  # the last batch wraps (fixed shapes)
    b = data.take(idx)
    loss, part = _eval_step(params, rest, graphdef, target.graphdef, target.params,
                            b.tokens, b.lengths, b.prompt_lengths, depth=depth,
                            soft_labels=soft_labels)
    losses.append(float(loss))
    sums += np.asarray(part)
  with np.errstate(invalid="ignore"):  # nan where no (response) label exists
    return float(np.mean(losses)), sums[0] / sums[1], sums[2] / sums[3]


def _plot(rows: list[dict], depth: int, path: str) -> None:
  import matplotlib  # noqa: PLC0415

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(10, 4))
  ax0.plot([int(r["step"]) for r in rows], [float(r["loss"]) for r in rows], label="train")
  ev = [r for r in rows if r.get("held_out_loss")]
  ax0.plot([int(r["step"]) for r in ev], [float(r["held_out_loss"]) for r in ev], "o-",
           label="held-out")
  ax0.set_xlabel("step")
  ax0.set_ylabel("loss")
  ax0.legend()
  for u in range(depth):
    line, = ax1.plot([int(r["step"]) for r in ev],
                     [float(r[f"held_out_top1_pos{u + 1}"]) for r in ev], "o-",
                     label=f"position {u + 1}")
    resp = [r for r in ev if r.get(f"held_out_response_top1_pos{u + 1}")]
    ax1.plot([int(r["step"]) for r in resp],
             [float(r[f"held_out_response_top1_pos{u + 1}"]) for r in resp], "x--",
             color=line.get_color(), label=f"position {u + 1}, response tokens")
  ax1.set_xlabel("step")
  ax1.set_ylabel("held-out top-1 agreement")
  ax1.legend()
  fig.tight_layout()
  fig.savefig(path)
  plt.close(fig)
