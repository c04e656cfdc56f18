"""The training-data generator emits the engine's greedy AR tokens (f32)."""

from __future__ import annotations

import numpy as np
import pytest

from methods.registry import make_method
from methods.training.data import regenerate
from methods.training.generate import greedy_generate
from models.testing import varied_model
from specjax.config import EngineConfig, SamplingParams
from specjax.engine import Engine
from specjax.request import Request
from specjax.steps import split_model

VOCAB = 96


@pytest.fixture(scope="module")
def target():
  model = varied_model()
  return split_model(model)


def _prompts(n, seed=0):
  rng = np.random.default_rng(seed)
  return [tuple(int(t) for t in rng.integers(0, VOCAB, size=int(rng.integers(1, 21))))
          for _ in range(n)]


def _engine_outputs(target, prompts, max_new, eos=()):
  engine = Engine(target, make_method("ar"), EngineConfig(
      max_num_seqs=4, max_model_len=64, page_size=8, min_prefill_bucket=32),
      eos_token_ids=eos)
  outs, _ = engine.generate([Request(i, p, SamplingParams(max_tokens=max_new))
                             for i, p in enumerate(prompts)])
  return [list(o.output_token_ids) for o in outs]


def test_matches_engine_greedy_with_eos_and_padding(target):
  prompts = _prompts(7)
  ref = _engine_outputs(target, prompts, 12)
  assert len({tuple(r) for r in ref}) > 1
  # An EOS id that some (not all) reference outputs emit mid-way.
  counts = np.bincount([t for r in ref for t in r[2:-1]], minlength=VOCAB)
  eos = int(np.argmax(counts))
  ref_eos = _engine_outputs(target, prompts, 12, eos=(eos,))
  assert any(len(r) < 12 for r in ref_eos)
  # batch 3 over 7 prompts: the last batch is padded.
  got = greedy_generate(target, prompts, max_new_tokens=12, eos_token_ids=(eos,), batch_size=3)
  assert got == ref_eos
  assert greedy_generate(target, prompts, max_new_tokens=12, batch_size=4) == ref


def test_regenerate_cuts_to_max_len_and_records_lengths(target):
  prompts = _prompts(3, seed=1)
  data = regenerate(target, prompts, max_new_tokens=12, max_len=24, batch_size=2)
  ref = _engine_outputs(target, prompts, 12)
  assert max(len(p) for p in prompts) + 12 > 24  # one row is cut
  for i, (p, r) in enumerate(zip(prompts, ref)):
    seq = (list(p) + r)[:24]
    assert data.lengths[i] == len(seq) and data.prompt_lengths[i] == len(p)
    assert data.tokens[i, : len(seq)].tolist() == seq
    assert not data.tokens[i, len(seq):].any()


def test_bad_arguments(target):
  with pytest.raises(ValueError, match="max_new_tokens=0"):
    greedy_generate(target, [(1, 2)], max_new_tokens=0)
  with pytest.raises(ValueError, match="at least one token"):
    greedy_generate(target, [(1, 2), ()], max_new_tokens=2)
  with pytest.raises(ValueError, match="prompt length 16"):
    regenerate(target, [tuple(range(16))], max_new_tokens=2, max_len=16)
