"""Early exit: ``layer_range=(0, E)`` then ``(E, num_layers)`` equals the full forward.

Both layer executions (the scan over stacked weights and the unrolled per-layer weights)
and both kinds of attention layout (Llama: uniform layers; Gemma 3: local and global
layers, a traced layer index inside the scan). The split step is a verify-sized chunk
(T = 3) after a prefill, so the continued layers attend to cached context. KV pages start
NaN, so a layer that reads a slot nobody wrote shows up.
"""

import jax
import numpy as np
import pytest
from flax import nnx

from models import testing
from models.layers import rms_norm
from models.llama import unstack_layer_params

jax.config.update("jax_default_matmul_precision", "highest")

NUM_LAYERS = 4
PROMPT = [5, 3]   # prefill lengths of the two rows
CHUNK = [3, 2]    # the split step's q_lens (row 1 padded to T = 3)
ATOL = 1e-5


def _model(family, execution):
  model = testing.random_model(testing.tiny_config(family, num_layers=NUM_LAYERS), seed=3)
  if execution == "unrolled":
    graphdef, state = nnx.split(model)
    model = nnx.merge(graphdef, unstack_layer_params(state))
  return model


def _prefilled(model, rng):
  kv = testing.PagedKV(model.cfg, 2, 16, page_size=4, seed=2)
  kv.step(model, rng.integers(0, model.cfg.vocab_size, (2, max(PROMPT))), PROMPT)
  return kv


def _layer_pages(kv, layer):
  caches = np.asarray(kv.caches)
  return caches.reshape(NUM_LAYERS, -1, *caches.shape[1:])[layer]


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("execution", ["scan", "unrolled"])
def test_exit_then_continue_equals_full(family, execution):
  exit_layer = 1 if execution == "scan" else 3
  model = _model(family, execution)
  rng = np.random.default_rng(0)
  kv_full = _prefilled(model, rng)
  kv_split = _prefilled(model, np.random.default_rng(0))
  tokens = rng.integers(0, model.cfg.vocab_size, (2, max(CHUNK))).astype(np.int32)

  meta = kv_full.metadata(CHUNK)
  kv_full.caches, full = testing.run_step(model, kv_full.caches, tokens, meta,
                                          hidden_layers=(exit_layer,))

  meta = kv_split.metadata(CHUNK)
  before = np.asarray(kv_split.caches)
  kv_split.caches, draft = testing.run_step(model, kv_split.caches, tokens, meta,
                                            hidden_layers=(exit_layer,),
                                            layer_range=(0, exit_layer))
  # The draft pass wrote layers [0, E) only.
  after = np.asarray(kv_split.caches).reshape(NUM_LAYERS, -1, *before.shape[1:])
  np.testing.assert_array_equal(after[exit_layer:],
                                before.reshape(after.shape)[exit_layer:])
  # Its hidden state is the full pass's hidden_states[E]; its logits the LM head of it.
  for row, q in enumerate(CHUNK):
    np.testing.assert_allclose(np.asarray(draft.hidden[0])[row, :q],
                               np.asarray(full.hidden[0])[row, :q], rtol=0, atol=ATOL)
  h = draft.hidden[0]
  normed = rms_norm(h, model.final_norm[...], model.cfg.rms_norm_eps, model.cfg.norm_plus_one)
  np.testing.assert_allclose(np.asarray(draft.logits), np.asarray(model.lm_logits(normed)),
                             rtol=0, atol=ATOL)

  kv_split.caches, rest = testing.run_step(model, kv_split.caches, None, meta,
                                           layer_range=(exit_layer, NUM_LAYERS),
                                           hidden_states=h)
  for row, q in enumerate(CHUNK):
    np.testing.assert_allclose(np.asarray(rest.logits)[row, :q],
                               np.asarray(full.logits)[row, :q], rtol=0, atol=ATOL)
    assert np.isfinite(np.asarray(rest.logits)[row, :q]).all()
  # Equal up to f32 rounding (the split calls are other XLA programs than the full one,
  # and round differently by ~1e-6); unwritten slots are NaN in both.
  for layer in range(NUM_LAYERS):
    np.testing.assert_allclose(_layer_pages(kv_split, layer), _layer_pages(kv_full, layer),
                               rtol=0, atol=ATOL, equal_nan=True, err_msg=f"KV of layer {layer}")


@pytest.mark.parametrize("execution", ["scan", "unrolled"])
def test_full_range_is_bitwise_default(execution):
  model = _model("llama", execution)
  tokens = np.random.default_rng(1).integers(0, model.cfg.vocab_size, (2, 5)).astype(np.int32)
  outs = []
  for layer_range in (None, (0, NUM_LAYERS)):
    kv = testing.PagedKV(model.cfg, 2, 8, page_size=4, seed=2)
    meta = kv.metadata([5, 4])
    caches, out = testing.run_step(model, kv.caches, tokens, meta, hidden_layers=(0, 2, 4),
                                   layer_range=layer_range)
    outs.append((np.asarray(caches), np.asarray(out.logits), [np.asarray(x) for x in out.hidden]))
  (c0, l0, h0), (c1, l1, h1) = outs
  np.testing.assert_array_equal(c0, c1)
  np.testing.assert_array_equal(l0, l1)
  for a, b in zip(h0, h1):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("layer_range", [(0, 0), (2, 2), (3, 1), (-1, 2), (0, NUM_LAYERS + 1),
                                         [0, 2], (0.0, 2), (1,)])
def test_bad_layer_range(layer_range):
  model = _model("llama", "scan")
  kv = testing.PagedKV(model.cfg, 1, 4, page_size=4)
  meta = kv.metadata([2])
  with pytest.raises(ValueError, match=r"layer_range=.*must be a tuple \(start, stop\) of ints "
                                       r"with 0 <= start < stop <= num_layers=4"):
    model(kv.caches, np.zeros((1, 2), np.int32), meta, layer_range=layer_range)


def test_bad_continuation_arguments():
  model = _model("llama", "scan")
  kv = testing.PagedKV(model.cfg, 1, 4, page_size=4)
  meta = kv.metadata([2])
  tokens = np.zeros((1, 2), np.int32)
  with pytest.raises(ValueError, match=r"layer_range=\(2, 4\) starts after layer 0: pass "
                                       r"hidden_states \[B, T, 32\], the output of layer 1"):
    model(kv.caches, tokens, meta, layer_range=(2, 4))
  with pytest.raises(ValueError, match=r"hidden layer i=1 must be in \[2, 4\]"):
    model(kv.caches, tokens, meta, layer_range=(2, 4), hidden_layers=(1,),
          hidden_states=np.zeros((1, 2, 32), np.float32))
  with pytest.raises(ValueError, match=r"hidden_states must be \[B, T, 32\] with B, T = "
                                       r"\(1, 2\); got \(1, 3, 32\)"):
    model(kv.caches, tokens, meta, layer_range=(2, 4),
          hidden_states=np.zeros((1, 3, 32), np.float32))
  with pytest.raises(ValueError, match="hidden_states.dtype=float16 must be the model dtype"):
    model(kv.caches, tokens, meta, layer_range=(2, 4),
          hidden_states=np.zeros((1, 2, 32), np.float16))
