"""SVIP around a learned head (EAGLE-3 chain with a random head): the entropy stop cuts
the head's draft count on the device, greedy output stays the AR output."""

import numpy as np
import pytest

from methods.registry import make_method
from models.testing import varied_model
from specjax.config import EngineConfig, SamplingParams
from specjax.engine import Engine
from specjax.request import Request
from specjax.steps import split_model

VOCAB, K, MAX_LEN = 96, 3, 32
ENGINE = EngineConfig(max_num_seqs=4, max_model_len=MAX_LEN, page_size=8, num_pages=16,
                      min_prefill_bucket=MAX_LEN)
OPTIONS = {"feature_layers": [1, 2, 2], "window": MAX_LEN}


@pytest.fixture(scope="module")
def target():
  model = varied_model()
  return split_model(model)


def _requests():
  rng = np.random.default_rng(12)
  return [Request(f"r{i}", tuple(int(t) for t in rng.integers(0, VOCAB, size=3 + 2 * i)),
                  SamplingParams(max_tokens=10 + i)) for i in range(3)]


@pytest.mark.slow  # ~60 s of compiles on the 2-core CI host; the stop itself is covered in CI
@pytest.mark.parametrize("h", [0.0, 1e6])
def test_svip_eagle3(target, h):
  requests = _requests()
  ar, _ = Engine(target, make_method("ar"), ENGINE).generate(requests)
  method = make_method("svip", K, h=h, drafter="eagle3", drafter_options=OPTIONS)
  outputs, metrics = Engine(target, method, ENGINE).generate(requests)
  assert [o.output_token_ids for o in outputs] == [o.output_token_ids for o in ar]
  steps = [(s.num_draft_tokens, s.num_accepted, s.num_emitted) for s in metrics.steps]
  if h == 0.0:  # every distribution has H > 0: one draft per drafting row
    assert all(s.num_draft_tokens <= s.num_rows for s in metrics.steps)
    assert sum(s.num_draft_tokens for s in metrics.steps) > 0
  else:  # never stops: the plain head's drafts
    _, plain_m = Engine(target, make_method("eagle3", K, **OPTIONS), ENGINE).generate(requests)
    assert steps == [(s.num_draft_tokens, s.num_accepted, s.num_emitted) for s in plain_m.steps]
