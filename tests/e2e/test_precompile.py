"""``Engine.precompile``: after it, a run compiles no decode step (prefill shapes are
compiled by the run itself, so they are warmed up by one run of the same prompts)."""

import pytest
from e2e_lib import ENGINE_CONFIG, make_requests

from harness.synthetic import ConstantDrafter
from methods.ngram import NGram
from methods.registry import make_method

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.mark.parametrize("method", [
    make_method("ar"), NGram(k=4),
    pytest.param(NGram(k=4, device=False), marks=pytest.mark.slow),
    pytest.param(ConstantDrafter(k=2), marks=pytest.mark.slow)])
def test_no_decode_compiles_after_precompile(make_engine, reference, method):
  requests = make_requests(31, 6)
  cfg = ENGINE_CONFIG.replace(max_num_seqs=4)
  # Prefill shapes: one run of a single request per prompt warms them (batch bucket 1).
  warm = make_engine(method, cfg)
  for r in requests:
    warm.generate([r])
  engine = make_engine(method, cfg)
  assert engine.precompile(requests) > 0
  outputs, metrics = engine.generate(requests)
  decode_compiles = [s for s in metrics.steps if s.compiled]
  assert not decode_compiles, [(s.num_rows, s.pages_bucket, s.query_bucket)
                               for s in decode_compiles]
  if method.name != "constant":
    assert [o.output_token_ids for o in outputs] == reference(requests)
