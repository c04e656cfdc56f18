"""Cached paged decode equals the uncached full forward, for every family.

Pages are drawn from a random permutation of the pool, every unwritten slot is NaN and
page_size is small, so the steps cross page boundaries and any read of a slot that was
never written (or a stale, rolled-back slot that is not masked) shows up as NaN or as a
logit mismatch. Tolerance: atol 1e-4, rtol 0 (f32, highest matmul precision).
"""

import jax
import numpy as np
import pytest

from models import testing

jax.config.update("jax_default_matmul_precision", "highest")

ATOL = 1e-4
HIDDEN = (0, 1, 2)  # embedding output, layer 0 output, final normed state (2 layers)


def _assert_close(got, want, what):
  got, want = np.asarray(got), np.asarray(want)
  assert np.isfinite(got).all(), f"{what}: non-finite values"
  np.testing.assert_allclose(got, want, rtol=0, atol=ATOL, err_msg=what)


# Per-row plans for a batch of B = 3 in a T = 4 bucket (verify with L = 3 drafts).
# Each entry is (real, junk): the step feeds `real` tokens of the sequence followed by
# `junk` random tokens (drafts that are then rejected), so q_len = real + junk; after the
# step the row is rolled back by `junk` (stale KV stays in the pages, masked by kv_lens).
# (0, 0) is a padding row with q_len 0.
_PLANS = (
    # row 0: prefill 4, then plain decode one token at a time (crosses pages 1, 2, 3).
    [(4, 0)] + [(1, 0)] * 10,
    # row 1: prefill 3, verify chunks of L + 1 = 4 with full or partial acceptance.
    [(3, 0), (4, 0), (1, 3), (2, 2), (4, 0), (0, 0), (1, 0)],
    # row 2: idle (padding) steps interleaved with chunks; rejection of all drafts.
    [(0, 0), (2, 0), (0, 0), (3, 1), (1, 3), (0, 0), (3, 0), (1, 0)],
)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma3"])
def test_mixed_batch_decode_matches_full_forward(family):
  cfg = testing.tiny_config(family)
  model = testing.random_model(cfg, seed=1)
  rng = np.random.default_rng(7)
  lengths = [sum(real for real, _ in plan) for plan in _PLANS]  # [14, 15, 10]
  max_len = max(lengths)
  seqs = rng.integers(0, cfg.vocab_size, (len(_PLANS), max_len)).astype(np.int32)
  ref = testing.full_forward(model, seqs, lengths=lengths, page_size=4, seed=11,
                             hidden_layers=HIDDEN)

  # max_len + 3 leaves room for rejected drafts written past the committed length.
  kv = testing.PagedKV(cfg, len(_PLANS), max_len + 3, page_size=4, seed=5)
  num_steps = max(len(plan) for plan in _PLANS)
  bucket = 4
  compared = 0
  for step in range(num_steps):
    tokens = rng.integers(0, cfg.vocab_size, (len(_PLANS), bucket)).astype(np.int32)
    q_lens, starts, reals = [], [], []
    for b, plan in enumerate(_PLANS):
      real, junk = plan[step] if step < len(plan) else (0, 0)
      start = int(kv.kv_lens[b])
      tokens[b, :real] = seqs[b, start:start + real]  # the rest of the row is junk/padding
      q_lens.append(real + junk)
      starts.append(start)
      reals.append(real)
    out = kv.step(model, tokens, q_lens, hidden_layers=HIDDEN)
    # Padding rows (q_len 0) and junk positions must be finite too: no NaN page leaks.
    assert np.isfinite(np.asarray(out.logits)).all(), f"{family} step {step}: non-finite logits"
    for b in range(len(_PLANS)):
      real, start = reals[b], starts[b]
      if not real:
        continue
      where = f"{family} step {step} row {b} positions {start}..{start + real - 1}"
      _assert_close(out.logits[b, :real], ref.logits[b, start:start + real], where)
      for i, layer in enumerate(HIDDEN):
        _assert_close(out.hidden[i][b, :real], ref.hidden[i][b, start:start + real],
                      f"{where} hidden_states[{layer}]")
      compared += real
      kv.truncate(b, start + real)  # reject the junk drafts
  assert compared == sum(lengths)
  np.testing.assert_array_equal(kv.kv_lens, lengths)


def test_exact_shape_prefill_decode_verify():
  """Unpadded shapes: prefill T = 5, decode T = 1, then verify chunks T = L + 1 = 4.

  Shapes (B = 3, cache for 18 tokens, reference T = 15) match the mixed-batch test so
  the T = 4 step and the reference forward reuse its compilations.
  """
  cfg = testing.tiny_config("llama")
  model = testing.random_model(cfg, seed=2)
  rng = np.random.default_rng(3)
  batch, length = 3, 15
  seqs = rng.integers(0, cfg.vocab_size, (batch, length)).astype(np.int32)
  ref = testing.full_forward(model, seqs, page_size=4, seed=4)
  kv = testing.PagedKV(cfg, batch, length + 3, page_size=4, seed=9)
  pos = 0
  for chunk in [5, 1, 1, 4, 4]:
    out = kv.step(model, seqs[:, pos:pos + chunk], [chunk] * batch)
    _assert_close(out.logits, ref.logits[:, pos:pos + chunk], f"positions {pos}..+{chunk}")
    pos += chunk
  assert pos == length
