"""Learned draft heads (EAGLE, EAGLE-3, MTP, Medusa): heads, methods, training.

Tiny f32 models at highest matmul precision (tests/conftest.py). One engine config for
every engine test (one prefill bucket, one page-table width) keeps compiles shared.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from methods.eagle3 import Eagle3
from methods.registry import make_method
from methods.training.data import TokenDataset, batch_indices, draft_vocabulary
from methods.training.trainer import (
    TrainConfig,
    _evaluate,
    _loss,
    _pad_width,
    _train_step,
    make_optimizer,
    target_features,
    train,
)
from models.heads import (
    EagleHead,
    HeadConfig,
    load_head,
    make_head,
    save_head,
    validate_vocab_map,
)
from models.layers import rms_norm
from models.testing import full_forward, varied_model
from specjax.config import EngineConfig, SamplingParams
from specjax.engine import Engine
from specjax.request import Request
from specjax.steps import split_model

jax.config.update("jax_default_matmul_precision", "highest")

VOCAB = 96
K = 3
MAX_LEN = 32
ENGINE = EngineConfig(max_num_seqs=4, max_model_len=MAX_LEN, page_size=8, num_pages=16,
                      min_prefill_bucket=MAX_LEN)
LAYERS = {"eagle": (2,), "eagle3": (1, 2, 2), "mtp": (2,), "medusa": (2,)}
KINDS = tuple(LAYERS)


@pytest.fixture(scope="module")
def target():
  """Tiny Llama with attention output and LM head scaled up (varied greedy text)."""
  model = varied_model()
  return split_model(model)


def _requests(seed: int, n: int, temperature: float = 0.0) -> list[Request]:
  """Mixed prompt lengths (2..10) and max_tokens; token 1 differs between requests."""
  rng = np.random.default_rng(seed)
  out = []
  for i in range(n):
    p = int(rng.integers(2, 11))
    prompt = [int(t) for t in rng.integers(0, VOCAB, size=p)]
    prompt[1] = 10 + i
    out.append(Request(f"r{i}", tuple(prompt), SamplingParams(
        max_tokens=int(rng.integers(6, MAX_LEN - p)), temperature=temperature, seed=i)))
  return out


WORKLOADS = {"batch1": (11, 1), "batch3": (12, 3)}


@pytest.fixture(scope="module")
def ar_outputs(target):
  cache = {}

  def get(workload):
    if workload not in cache:
      outs, _ = Engine(target, make_method("ar"), ENGINE).generate(_requests(*WORKLOADS[workload]))
      cache[workload] = [o.output_token_ids for o in outs]
    return cache[workload]

  return get


def _method(kind, **kw):
  return make_method(kind, K, feature_layers=LAYERS[kind], window=MAX_LEN, **kw)


# ---------------------------------------------------------------- heads
def _head(kind, target_cfg, window=MAX_LEN, **kw):
  extra = {"num_modules": K} if kind in ("mtp", "medusa") else {}
  cfg = HeadConfig.for_target(kind, target_cfg, feature_layers=LAYERS[kind], window=window,
                              **extra, **kw)
  d2t = None
  if cfg.draft_vocab_size is not None:
    d2t = np.sort(np.random.default_rng(0).permutation(VOCAB)[: cfg.draft_vocab_size])
  return make_head(cfg, seed=1, draft_to_target=d2t)


def _features(target, seq, layers):
  """``f32[len(seq), F]`` target features by an uncached forward (padded: one compile)."""
  model = nnx.merge(target.graphdef, target.params)
  tokens = np.zeros((1, MAX_LEN), np.int32)
  tokens[0, : len(seq)] = seq
  out = full_forward(model, tokens, lengths=[len(seq)], hidden_layers=layers)
  return np.concatenate([np.asarray(h) for h in out.hidden], -1)[0, : len(seq)]


@pytest.mark.parametrize("kind,window,reduced", [
    ("eagle", MAX_LEN, False), ("eagle3", MAX_LEN, True), ("eagle3", 4, False),
    ("mtp", MAX_LEN, False), ("medusa", MAX_LEN, False)])
def test_draft_matches_training_unroll(target, kind, window, reduced):
  """Draft step j == the training unroll at depth j on the drafted sequence.

  Catches feature/position shift bugs between drafting and training at every depth
  (window 4 < sequence checks that both cut the attention window the same way).
  """
  head = _head(kind, target.config, window, draft_vocab_size=40 if reduced else None)
  tmodel = nnx.merge(target.graphdef, target.params)
  rng = np.random.default_rng(5)
  m = 9  # committed tokens x_0 .. x_8; features f_0 .. f_7; pending x_8
  seq = [int(t) for t in rng.integers(0, VOCAB, size=m)]
  feats = _features(target, seq, LAYERS[kind])[: m - 1]
  n = min(window, m - 1)
  tokens = np.asarray([seq[m - n:]], np.int32)
  win = feats[None, m - 1 - n:]
  if n < window:  # left-pad to the window
    tokens = np.pad(tokens, ((0, 0), (window - n, 0)))
    win = np.pad(win, ((0, 0), (window - n, 0), (0, 0)))

  def pick(logits, j):
    return jnp.argmax(logits, -1).astype(jnp.int32), logits

  drafted, logits = jax.jit(lambda: head.draft(
      tmodel, jnp.asarray(tokens), jnp.asarray(win), jnp.asarray([n]), jnp.asarray([m - 2]),
      K, pick))()
  drafted, logits = np.asarray(drafted)[0], np.asarray(logits)[0]
  full = np.asarray(seq + [int(t) for t in drafted], np.int32)
  pad = np.zeros((len(full), feats.shape[1]), np.float32)
  pad[: m - 1] = feats
  outs = jax.jit(lambda: head.unrolled(tmodel, jnp.asarray(full[None]), jnp.asarray(pad[None]),
                                       jnp.asarray([len(full)]), K))()
  for j in range(K):
    shift, first = head.label_offset(j)
    q = m + j - 1 - shift  # the output predicting token index m + j (draft j + 1)
    assert q >= first
    ref = np.asarray(head.to_target_logits(head.train_logits(tmodel, outs[j], j)))[0, q]
    finite = np.isfinite(ref)
    np.testing.assert_array_equal(finite, np.isfinite(logits[j]))
    np.testing.assert_allclose(logits[j][finite], ref[finite], atol=2e-4, rtol=2e-4)
    assert int(np.argmax(ref)) == drafted[j]
  if reduced:
    assert set(drafted.tolist()) <= set(np.asarray(head.d2t[...]).tolist())


def _slow_unless(fast, values):
  """Parameters; those not in ``fast`` are marked slow (compiles dominate these tests)."""
  return [v if v in fast else pytest.param(v, marks=pytest.mark.slow) for v in values]


@pytest.mark.parametrize("kind", _slow_unless(("eagle",), KINDS))
def test_train_step_runs(target, kind):
  head = _head(kind, target.config, draft_vocab_size=40 if kind == "eagle3" else None)
  # Default depths: EAGLE-3 unrolls 3 steps (training-time test), MTP/Medusa train all K.
  cfg = TrainConfig(kind=kind, steps=10, learning_rate=1e-2, warmup_steps=1, num_modules=K)
  graphdef, params, rest = nnx.split(head, nnx.Param, ...)
  opt = make_optimizer(cfg)
  opt_state = opt.init(params)
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, VOCAB, size=(2, 16)).astype(np.int32)
  lengths = np.asarray([16, 11], np.int32)
  before = jax.tree.map(np.asarray, params)
  new = params
  for _ in range(2):  # the warm-up's first learning rate is 0
    new, opt_state, loss, gnorm, acc = _train_step(
        new, opt_state, rest, graphdef, target.graphdef, target.params, tokens, lengths,
        depth=cfg.train_depth, optimizer=opt)
  assert np.isfinite(float(loss)) and float(loss) > 0 and float(gnorm) > 0
  assert acc.shape == (cfg.train_depth,)
  changed = jax.tree.map(lambda a, b: bool(np.any(np.asarray(a) != b)), new, before)
  assert any(jax.tree.leaves(changed))


def test_reduced_vocab_head_starts_as_the_target_lm_head_columns(target):
  """``init_from_target``: the own LM head is the target's columns of the draft ids, so
  the draft logits equal the target LM head's logits there (-inf elsewhere)."""
  head = _head("eagle3", target.config, draft_vocab_size=40)
  model = nnx.merge(target.graphdef, target.params)
  head.init_from_target(model)
  d2t = np.asarray(head.d2t[...])
  np.testing.assert_array_equal(np.asarray(head.lm_head[...]),
                                np.asarray(model.lm_weight())[:, d2t])
  h = jnp.asarray(np.random.default_rng(2).standard_normal((3, target.config.hidden_size)),
                  jnp.float32)
  mine = np.asarray(head.to_target_logits(head.draft_logits(model, h)))
  normed = rms_norm(h, head.out_norm[...], head.cfg.rms_norm_eps, False)
  theirs = np.asarray(model.lm_logits(normed))
  np.testing.assert_allclose(mine[:, d2t], theirs[:, d2t], rtol=1e-5, atol=1e-5)
  assert np.all(np.isneginf(np.delete(mine, d2t, axis=1)))
  np.testing.assert_array_equal(np.asarray(head.from_target_logits(jnp.asarray(theirs))),
                                theirs[:, d2t])
  full = _head("eagle3", target.config)  # the target's LM head itself: nothing to copy
  before = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(full, nnx.Param)))
  full.init_from_target(model)
  after = nnx.to_pure_dict(nnx.state(full, nnx.Param))
  assert all(jax.tree.leaves(jax.tree.map(lambda a, b: np.array_equal(a, b), before, after)))


@pytest.mark.parametrize("reduced", [False, True], ids=["full_vocab", "reduced_vocab"])
def test_soft_label_loss_is_cross_entropy_to_the_target_distribution(target, reduced):
  """``soft_labels``: depth 1's loss is ``-sum p log q`` with p the softmax of the
  target's logits (over the head's vocabulary) at the label's position, recomputed here
  from the target and head directly; the top-1 hits are still the greedy ones."""
  head = _head("eagle3", target.config, draft_vocab_size=40 if reduced else None)
  graphdef, params, rest = nnx.split(head, nnx.Param, ...)
  model = nnx.merge(target.graphdef, target.params)
  data = _pad_width(_tiny_data(n=2, width=32))
  zeros = jnp.zeros(2, jnp.int32)
  hard_loss, (hits, valid, _) = _loss(params, rest, graphdef, model, data.tokens,
                                      data.lengths, zeros, 1, False)
  soft_loss, (soft_hits, soft_valid, _) = _loss(params, rest, graphdef, model, data.tokens,
                                                data.lengths, zeros, 1, True)
  np.testing.assert_array_equal(np.asarray(hits), np.asarray(soft_hits))
  np.testing.assert_array_equal(np.asarray(valid), np.asarray(soft_valid))
  feats, labels, logits = target_features(model, data.tokens, data.lengths,
                                          head.cfg.feature_layers, return_logits=True)
  (g,) = head.unrolled(model, data.tokens, feats, data.lengths, 1)
  logq = np.asarray(jax.nn.log_softmax(head.draft_logits(model, g), -1))
  p = np.asarray(jax.nn.softmax(head.from_target_logits(logits), -1))
  lab_d = np.asarray(head.draft_ids(labels))
  t = data.tokens.shape[1]
  soft_sum = hard_sum = 0.0
  count = 0
  for b in range(2):
    for q in range(t - 1):  # depth 1: output q predicts the label after q + 1
      if q + 1 > data.lengths[b] - 1:
        continue
      count += 1
      if lab_d[b, q + 1] < 0:
        continue  # a label outside the draft vocabulary is not trained on
      soft_sum += -np.sum(p[b, q + 1] * logq[b, q])
      hard_sum += -logq[b, q, lab_d[b, q + 1]]
  np.testing.assert_allclose(float(soft_loss), soft_sum / count, rtol=1e-4)
  np.testing.assert_allclose(float(hard_loss), hard_sum / count, rtol=1e-4)
  assert abs(float(soft_loss) - float(hard_loss)) > 1e-3  # the two losses differ here


# ---------------------------------------------------------------- oracle
class OracleHead(nnx.Module):
  """Knows each request's true greedy continuation and true target features.

  It proposes the true continuation only if the window it is handed is exactly right:
  tokens ``x_{p+1}`` and features ``f_p`` at the positions the interface promises
  (slot ``W - 1`` is position ``positions[b]``). Any shift in how the method stores or
  sends features/tokens makes it propose wrong tokens, so acceptance drops below 1.
  """

  def __init__(self, cfg, seqs, feats):
    self.cfg = cfg
    self.seqs = nnx.Variable(jnp.asarray(seqs))  # i32[R, MAX_LEN + 1]
    self.feats = nnx.Variable(jnp.asarray(feats))  # f32[R, MAX_LEN + 1, F]

  def draft(self, target, tokens, feats, num_valid, positions, num_steps, pick):
    seqs, table = self.seqs[...], self.feats[...]
    last = seqs.shape[1] - 1
    width = tokens.shape[1]
    pos = positions[:, None] - (width - 1) + jnp.arange(width)[None]
    valid = jnp.arange(width)[None] >= width - num_valid[:, None]
    tok_match = jnp.all((seqs[:, jnp.clip(pos + 1, 0, last)] == tokens[None]) | ~valid[None], -1)
    row = jnp.argmax(tok_match, 0)
    true = table[row[:, None], jnp.clip(pos, 0, last)]
    feat_ok = jnp.all((jnp.abs(feats - true) < 1e-3) | ~valid[..., None], (1, 2))
    ok = jnp.any(tok_match, 0) & feat_ok
    want = seqs[row[:, None], jnp.clip(positions[:, None] + 2 + jnp.arange(num_steps), 0, last)]
    want = jnp.where(ok[:, None], want, (want + 1) % VOCAB)
    toks, probs = [], []
    for j in range(num_steps):
      t, p = pick(30.0 * jax.nn.one_hot(want[:, j], VOCAB), j)
      toks.append(t)
      probs.append(p)
    # ``pick`` returns any pytree of [B, ...] arrays (SVIP adds a stop flag): stack leaves.
    return jnp.stack(toks, 1), jax.tree.map(lambda *xs: jnp.stack(xs, 1), *probs)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OracleEagle3(Eagle3):
  table: object = dataclasses.field(default=None, compare=False, hash=False, repr=False)

  def build_head(self, runtime):
    cfg = self.head_config(runtime.target.config)
    return OracleHead(cfg, *self.table)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "host"])
@pytest.mark.parametrize("workload", _slow_unless(("batch3",), list(WORKLOADS)))
def test_oracle_head_accepts_everything(target, ar_outputs, workload, fused):
  """Fused: the device feature pool (prefill and per-iteration writes, the window
  gather) hands the head exactly the host path's window, or acceptance drops."""
  requests = _requests(*WORKLOADS[workload])
  expected = ar_outputs(workload)
  seqs = np.zeros((len(requests), MAX_LEN + 1), np.int32)
  feats = np.zeros((len(requests), MAX_LEN + 1, 3 * target.config.hidden_size), np.float32)
  for i, (r, out) in enumerate(zip(requests, expected)):
    full = list(r.prompt_token_ids) + out
    seqs[i, : len(full)] = full
    feats[i, : len(full)] = _features(target, full, LAYERS["eagle3"])
  method = OracleEagle3(k=K, feature_layers=LAYERS["eagle3"], window=MAX_LEN,
                        table=(seqs, feats), fused=fused)
  engine = Engine(target, method, ENGINE)
  assert engine.fused == fused
  outputs, metrics = engine.generate(requests)
  assert [o.output_token_ids for o in outputs] == expected
  drafted = sum(s.drafted_per_position for s in metrics.steps)
  accepted = sum(s.accepted_per_position for s in metrics.steps)
  assert drafted[K - 1] > 0, "the workload must reach the last draft position"
  np.testing.assert_array_equal(accepted, drafted)  # acceptance 1.0 at every position


# ---------------------------------------------------------------- losslessness
@pytest.mark.parametrize("kind,workload", [
    ("eagle3", "batch3"), ("medusa", "batch3"),
    *[pytest.param(k, w, marks=pytest.mark.slow) for k in KINDS for w in WORKLOADS
      if (k, w) not in (("eagle3", "batch3"), ("medusa", "batch3"))]])
def test_greedy_sd_equals_ar(target, ar_outputs, kind, workload):
  requests = _requests(*WORKLOADS[workload])
  outputs, metrics = Engine(target, _method(kind), ENGINE).generate(requests)
  assert [o.output_token_ids for o in outputs] == ar_outputs(workload)
  assert sum(s.num_draft_tokens for s in metrics.steps) > 0


def test_random_reduced_vocab_eagle3_head(target, ar_outputs):
  """A random EAGLE-3 head with ``draft_vocab_size`` (the drafting cost of a trained
  reduced-vocabulary head) drafts ids below that size and stays lossless."""
  method = _method("eagle3", draft_vocab_size=VOCAB // 4)
  engine = Engine(target, method, ENGINE)
  head = method.build_head(engine.runtime)
  assert head.lm_head[...].shape == (target.config.hidden_size, VOCAB // 4)
  requests = _requests(*WORKLOADS["batch3"])
  outputs, metrics = engine.generate(requests)
  assert [o.output_token_ids for o in outputs] == ar_outputs("batch3")
  assert sum(s.num_draft_tokens for s in metrics.steps) > 0
  with pytest.raises(ValueError, match="draft_vocab_size=8 is only for kind"):
    Engine(target, _method("eagle", draft_vocab_size=8), ENGINE).generate(requests[:1])


def _step_counters(metrics):
  return [(s.num_rows, s.num_draft_tokens, s.num_accepted, s.num_emitted) for s in metrics.steps]


@pytest.mark.parametrize("kind,temperature", [
    ("eagle3", 0.0), ("medusa", 1.0),
    *[pytest.param(k, t, marks=pytest.mark.slow) for k in KINDS for t in (0.0, 1.0)
      if (k, t) not in (("eagle3", 0.0), ("medusa", 1.0))]])
def test_fused_head_equals_host_head(target, kind, temperature):
  """The fused proposer drafts what the host-called one drafts: same outputs and
  per-request counters (seeded sampling included: same draft keys and q), and, one
  synchronous iteration per call, the same per-step counters."""
  requests = _requests(14, 3, temperature=temperature)
  host_out, host_met = Engine(target, _method(kind, fused=False), ENGINE).generate(requests)
  sync = ENGINE.replace(steps_per_dispatch=1, async_scheduling=False)
  for config in (ENGINE, sync):
    engine = Engine(target, _method(kind), config)
    assert engine.fused
    out, met = engine.generate(requests)
    assert [o.output_token_ids for o in out] == [o.output_token_ids for o in host_out]
    assert [(o.num_steps, o.num_draft_tokens, o.num_accepted_tokens) for o in out] == [
        (o.num_steps, o.num_draft_tokens, o.num_accepted_tokens) for o in host_out]
    if config is sync:
      assert _step_counters(met) == _step_counters(host_met)
  assert sum(o.num_draft_tokens for o in host_out) > 0


@pytest.mark.parametrize("kind", _slow_unless(("medusa",), KINDS))
def test_stochastic_path_runs(target, kind):
  requests = _requests(13, 2, temperature=1.0)
  outputs, metrics = Engine(target, _method(kind), ENGINE).generate(requests)
  for o, r in zip(outputs, requests):
    assert len(o.output_token_ids) == r.sampling.max_tokens
    assert all(0 <= t < VOCAB for t in o.output_token_ids)
  assert sum(s.num_draft_tokens for s in metrics.steps) > 0
  again, _ = Engine(target, _method(kind), ENGINE).generate(requests)
  assert [o.output_token_ids for o in again] == [o.output_token_ids for o in outputs]


# ---------------------------------------------------------------- training
def _tiny_data(n=12, width=24, seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, VOCAB, size=(n, width)).astype(np.int32)
  lengths = rng.integers(12, width + 1, size=n).astype(np.int32)
  for row, ln in zip(tokens, lengths):
    row[ln:] = 0
  return TokenDataset(tokens, lengths, np.full(n, 4, np.int32))


def test_held_out_response_agreement_counts_only_drafted_response_tokens(target):
  """All-position vs response-only top-1, checked against an independent recount."""
  head = _head("eagle", target.config)
  graphdef, params, rest = nnx.split(head, nnx.Param, ...)
  data = _pad_width(_tiny_data(n=4, width=32))
  plen = np.asarray([3, 8, 12, 20], np.int32)
  model = nnx.merge(target.graphdef, target.params)
  feats, labels = target_features(model, data.tokens, data.lengths, head.cfg.feature_layers)
  (g,) = head.unrolled(model, data.tokens, feats, data.lengths, 1)
  pred = np.asarray(jnp.argmax(head.draft_logits(model, g), -1))
  labels = np.asarray(labels)
  q = np.arange(data.tokens.shape[1])[None]
  valid = q + 1 <= data.lengths[:, None] - 1  # depth 1 predicts the label after q + 1
  hit = pred[:, :-1] == labels[:, 1:]
  index = q[:, :-1] + 2  # token index of the label at q

  def response_mask(prompt_lengths):  # labels a row drafts: indices prompt .. length - 1
    return (valid[:, :-1] & (index >= prompt_lengths[:, None])
            & (index <= data.lengths[:, None] - 1))

  for prompt_lengths in (np.zeros(4, np.int32), plen):
    expect = hit[response_mask(prompt_lengths)].mean()
    d = TokenDataset(data.tokens, data.lengths, prompt_lengths)
    _, all_pos, response = _evaluate(params, rest, graphdef, target, d, 4, 1)
    np.testing.assert_allclose(all_pos[0], hit[valid[:, :-1]].mean(), rtol=1e-6)
    np.testing.assert_allclose(response[0], expect, rtol=1e-6)
  d = TokenDataset(data.tokens, data.lengths, data.lengths)  # no response token at all
  assert np.isnan(_evaluate(params, rest, graphdef, target, d, 4, 1)[2][0])


def test_batch_indices_are_a_function_of_step():
  a = [batch_indices(s, 4, 10, 7) for s in range(6)]
  b = [batch_indices(s, 4, 10, 7) for s in range(6)]
  np.testing.assert_array_equal(np.stack(a), np.stack(b))
  epoch0 = np.concatenate(a)[:10]
  assert sorted(epoch0.tolist()) == list(range(10))


def test_resume_reproduces_loss_curve_and_head_roundtrips(target, tmp_path):
  data = _tiny_data()
  train_data, held = data.split(2)
  # Medusa (cheapest compile; the mechanics are kind-independent), 2 heads.
  cfg = TrainConfig(kind="medusa", steps=4, batch_size=2, learning_rate=1e-2, warmup_steps=1,
                    num_modules=2, feature_layers=LAYERS["medusa"], eval_every=2,
                    checkpoint_every=1, progress=False, output_dir=str(tmp_path / "full"))
  full = train(cfg, target, train_data, held)
  cfg2 = dataclasses.replace(cfg, output_dir=str(tmp_path / "resumed"))
  part = train(cfg2, target, train_data, held, stop_after=2)
  assert len(part.losses) == 2
  resumed = train(cfg2, target, train_data, held)
  assert full.losses.tobytes() == resumed.losses.tobytes()  # bit for bit
  p_full = jax.tree.leaves(nnx.state(full.head, nnx.Param))
  p_res = jax.tree.leaves(nnx.state(resumed.head, nnx.Param))
  assert all(np.array_equal(a, b) for a, b in zip(p_full, p_res))
  assert os.path.exists(tmp_path / "full" / "metrics.png")
  # Export / load is bit-exact and keeps the vocabulary map.
  loaded = load_head(full.head_dir, target.config)
  for a, b in zip(p_full, jax.tree.leaves(nnx.state(loaded, nnx.Param))):
    assert np.array_equal(a, b)
  method = make_method("medusa", 2, head_path=full.head_dir)
  assert method.capabilities().target_hidden_layers == LAYERS["medusa"]


@pytest.mark.slow
def test_eagle3_training_exports_vocab_map(target, tmp_path):
  data = _tiny_data()
  train_data, held = data.split(2)
  cfg = TrainConfig(kind="eagle3", steps=2, batch_size=2, depth=2, window=16,
                    feature_layers=LAYERS["eagle3"], draft_vocab_size=48, soft_labels=True,
                    progress=False, output_dir=str(tmp_path / "e3"))
  result = train(cfg, target, train_data, held)
  assert np.all(np.isfinite(result.losses))
  loaded = load_head(result.head_dir, target.config)
  np.testing.assert_array_equal(loaded.d2t[...], draft_vocabulary(train_data, 48, VOCAB))
  outputs, _ = Engine(target, make_method("eagle3", K, head_path=result.head_dir),
                      ENGINE).generate(_requests(12, 3))
  assert all(o.output_token_ids for o in outputs)


def test_vocab_map_missing_or_inconsistent_is_a_load_error(target, tmp_path):
  head = _head("eagle3", target.config, draft_vocab_size=40)
  path = str(tmp_path / "head")
  save_head(path, head)
  load_head(path, target.config)  # valid
  np.save(os.path.join(path, "vocab_map.npy"), np.arange(39, dtype=np.int32))
  with pytest.raises(ValueError, match="shape"):
    load_head(path)
  np.save(os.path.join(path, "vocab_map.npy"), np.zeros(40, np.int32))
  with pytest.raises(ValueError, match="repeat"):
    load_head(path)
  np.save(os.path.join(path, "vocab_map.npy"), np.arange(60, 100, dtype=np.int32))
  with pytest.raises(ValueError, match="must be in"):
    load_head(path)
  os.remove(os.path.join(path, "vocab_map.npy"))
  with pytest.raises(ValueError, match="no draft -> target map"):
    load_head(path)
  with pytest.raises(ValueError, match="draft_to_target must be given"):
    make_head(HeadConfig.for_target("eagle3", target.config, draft_vocab_size=40))
  with pytest.raises(ValueError):
    validate_vocab_map(np.arange(4.0), 4, VOCAB)


def test_method_config_errors(target, tmp_path):
  with pytest.raises(ValueError, match="head_path"):
    make_method("eagle3", K)
  with pytest.raises(ValueError, match="head directory"):
    make_method("eagle", K, head_path=str(tmp_path / "nope"))
  path = str(tmp_path / "mtp")
  save_head(path, _head("mtp", target.config))
  with pytest.raises(ValueError, match="kind"):
    make_method("medusa", K, head_path=path)
  with pytest.raises(ValueError, match="draft_vocab_size=8 is for a random head"):
    make_method("mtp", K, head_path=path, draft_vocab_size=8)
  engine = Engine(target, make_method("mtp", K + 1, head_path=path), ENGINE)
  with pytest.raises(ValueError, match="num_modules"):
    engine.generate(_requests(1, 1))


@pytest.mark.slow
def test_preemption_keeps_outputs(target, ar_outputs):
  """A pool too small for the batch preempts (recompute): features are rebuilt from the
  re-prefill and outputs do not change."""
  small = dataclasses.replace(ENGINE, num_pages=6)
  outputs, metrics = Engine(target, _method("eagle3"), small).generate(
      _requests(*WORKLOADS["batch3"]))
  assert metrics.num_preemptions > 0
  assert [o.output_token_ids for o in outputs] == ar_outputs("batch3")


@pytest.mark.parametrize("tree_nodes", [0, 6], ids=["chain", "tree"])
def test_heads_draft_at_most_the_budget(target, monkeypatch, tree_nodes):
  """Near max_model_len a step where every budget is < k runs at most max(budget) head
  steps (chain length / tree depth), a step with no budget runs no head, and greedy SD
  still equals AR."""
  import methods.learned as learned_mod  # noqa: PLC0415

  calls, budgets = [], []
  real = {n: getattr(learned_mod, n) for n in ("head_draft_step", "head_tree_step")}

  def spy(name, key):
    def step(*args, **kw):
      calls[-1] = kw[key]
      return real[name](*args, **kw)
    return step

  real_propose = learned_mod.LearnedHeadMethod.propose

  def propose(self, state, ctx):
    budgets.append(int(max(ctx.budgets, default=0)))
    calls.append(0)
    return real_propose(self, state, ctx)

  monkeypatch.setattr(learned_mod, "head_draft_step", spy("head_draft_step", "num_steps"))
  monkeypatch.setattr(learned_mod, "head_tree_step", spy("head_tree_step", "depth"))
  monkeypatch.setattr(learned_mod.LearnedHeadMethod, "propose", propose)
  requests = [Request("edge", tuple(range(1, MAX_LEN - 5)), SamplingParams(max_tokens=40))]
  # The host-called path (fused trees and chains draft inside the device step).
  kw = {"tree_nodes": tree_nodes, "tree_branching": 2} if tree_nodes else {}
  kw["fused"] = False
  outputs, _ = Engine(target, _method("eagle", **kw), ENGINE).generate(requests)
  ar, _ = Engine(target, make_method("ar"), ENGINE).generate(requests)
  assert outputs[0].output_token_ids == ar[0].output_token_ids
  assert min(budgets) < K
  assert calls == [min(b, K) for b in budgets], (calls, budgets)


def test_fused_tree_near_max_model_len_equals_ar(target):
  """A fused tree keeps each row's first budget nodes near max_model_len (a prefix of a
  parents-first tree is a tree): greedy SD still equals AR and the request ends at the
  same length."""
  requests = [Request("edge", tuple(range(1, MAX_LEN - 5)), SamplingParams(max_tokens=40))]
  method = _method("eagle", tree_nodes=6, tree_branching=2)
  assert method.capabilities().runs_on == "fused"
  outputs, metrics = Engine(target, method, ENGINE).generate(requests)
  ar, _ = Engine(target, make_method("ar"), ENGINE).generate(requests)
  assert outputs[0].output_token_ids == ar[0].output_token_ids
  assert sum(s.num_draft_tokens for s in metrics.steps) > 0


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "host"])
def test_head_matmul_precision_applies_to_the_head_only(target, ar_outputs, monkeypatch, fused):
  """``matmul_precision`` is the context of the head's drafting (fused and host-called)
  and not of the target's verify; outputs stay AR's."""
  seen = []
  draft = EagleHead.draft

  def spy(self, *args, **kw):
    seen.append(jax.config.jax_default_matmul_precision)
    return draft(self, *args, **kw)

  monkeypatch.setattr(EagleHead, "draft", spy)
  requests = _requests(*WORKLOADS["batch3"])
  method = _method("eagle3", matmul_precision="bfloat16", fused=fused)
  outputs, _ = Engine(target, method, ENGINE).generate(requests)
  assert [o.output_token_ids for o in outputs] == ar_outputs("batch3")
  assert seen and set(seen) == {"bfloat16"}
  assert jax.config.jax_default_matmul_precision == "highest"


def test_window_option_overrides_a_trained_heads_window(target, tmp_path):
  path = str(tmp_path / "eagle3")
  save_head(path, _head("eagle3", target.config, window=MAX_LEN))
  runtime = Engine(target, make_method("eagle3", K, head_path=path), ENGINE).runtime
  assert make_method("eagle3", K, head_path=path).init_device(runtime)[0].window == MAX_LEN
  assert make_method("eagle3", K, head_path=path, window=4).init_device(runtime)[0].window == 4
  with pytest.raises(ValueError, match=r"window=0 must be None \(the head's\) or an int >= 1"):
    make_method("eagle3", K, head_path=path, window=0)
  with pytest.raises(ValueError, match=r"matmul_precision='fast' must be None"):
    make_method("eagle3", K, head_path=path, matmul_precision="fast")
