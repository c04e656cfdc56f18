"""SV around a learned head (EAGLE-3 chain with a random head): the head's own state
sees the prefill's hidden states (SV's state wraps it), greedy output stays AR's."""

import numpy as np
import pytest

from methods import sv
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


def test_observe_prefill_reaches_the_drafters_state(monkeypatch):
  method = make_method("sv", K, drafter="eagle3", drafter_options=OPTIONS, companion="x")
  seen = []
  monkeypatch.setattr(type(method.inner), "observe_prefill",
                      lambda self, state, result: seen.append((state, result)) or "updated")
  state = sv._State("drafter state", *([None] * 8))
  assert method.observe_prefill(state, "prefill") is state
  assert seen == [("drafter state", "prefill")] and state.inner == "updated"


@pytest.mark.slow  # ~60 s of compiles on the 2-core CI host
def test_sv_eagle3_greedy_equals_ar():
  model = varied_model()
  target = split_model(model)
  rng = np.random.default_rng(12)
  requests = [Request(f"r{i}", tuple(int(t) for t in rng.integers(0, VOCAB, size=3 + 2 * i)),
                      SamplingParams(max_tokens=10 + i)) for i in range(3)]
  ar, _ = Engine(target, make_method("ar"), ENGINE).generate(requests)
  method = make_method("sv", K, drafter="eagle3", drafter_options=OPTIONS,
                       companion_model=target, cost_model="seed-llama8b-h100")
  outputs, metrics = Engine(target, method, ENGINE).generate(requests)
  assert [o.output_token_ids for o in outputs] == [o.output_token_ids for o in ar]
  assert sum(s.num_draft_tokens for s in metrics.steps) > 0
