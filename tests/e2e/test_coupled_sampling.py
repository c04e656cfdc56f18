"""The coupled rule for drafts without probabilities (``specjax.verify``): a seeded
sampled request of an n-gram / suffix method (or a wrapper over them) emits exactly the
tokens of the same seeded AR request, whatever was drafted: alone, next to sampled and
greedy partners (whose responses fill suffix decoding's global tree and the wrappers'
shared estimates), and through a preemption.

Before the rule these methods accepted a one-hot draft with a uniform and drew the
recovered token from the residual, so the emitted tokens depended on the drafts, which
depend on the batch (issue "House in order", finding 1).
"""

import pytest
from e2e_lib import ENGINE_CONFIG, K, check_counters, make_requests

from methods.registry import make_method
from specjax.config import SamplingParams
from specjax.request import Request

PROMPT = (7, 21, 3, 7, 21, 3, 7, 21)  # repetitive; low temperatures: the tiny target repeats too
SEEDED = (  # top-p goes through rejection_sample, temperature only through the fused one
    Request("seeded_p", PROMPT, SamplingParams(temperature=0.3, top_p=0.9, seed=1,
                                               max_tokens=20)),
    Request("seeded_t", PROMPT[1:], SamplingParams(temperature=0.4, seed=2, max_tokens=20)),
)


@pytest.fixture(scope="module")
def ar_tokens(make_engine):
  outputs, _ = make_engine("ar").generate(list(SEEDED))
  return {o.request_id: o.output_token_ids for o in outputs}


def _method(name):
  if name == "suffix_tree":
    return make_method("suffix", K, tree=True)
  return make_method(name, K)


@pytest.mark.parametrize("name", [
    "ngram", "suffix",
    *[pytest.param(n, marks=pytest.mark.slow) for n in ("suffix_tree", "adaptive", "verify_skip")]])
def test_seeded_sd_request_emits_the_seeded_ar_tokens(make_engine, ar_tokens, name):
  engine = make_engine(_method(name))
  partners = [make_requests(5, 3, prefix="g"),  # greedy
              make_requests(6, 4, prefix="s", temperature=0.9, top_k=6, seed=7),
              make_requests(7, 5, prefix="u", temperature=1.0)]  # unseeded
  drafted = accepted = 0
  for batch in ([*SEEDED], [*partners[0], *SEEDED], [SEEDED[0], *partners[1], SEEDED[1]],
                [*SEEDED, *partners[2]]):
    outputs, metrics = engine.generate(batch)
    by_id = {o.request_id: o for o in outputs}
    for r in SEEDED:
      assert by_id[r.request_id].output_token_ids == ar_tokens[r.request_id], (name, r.request_id)
      drafted += by_id[r.request_id].num_draft_tokens
      accepted += by_id[r.request_id].num_accepted_tokens
    check_counters(metrics, outputs, K, tree=name == "suffix_tree")
  assert drafted > accepted > 0, (drafted, accepted)  # accepts and rejections both ran


@pytest.mark.slow
def test_seeded_sd_request_through_a_preemption(make_engine, ar_tokens):
  """Long partners in a 6-page pool preempt rows; the seeded rows still emit AR's tokens."""
  config = ENGINE_CONFIG.replace(num_pages=6)
  long = make_requests(8, 3, prompt_len=(6, 10), max_tokens=(14, 18), prefix="l",
                       temperature=1.0, seed=9)
  outputs, metrics = make_engine(_method("suffix"), config=config).generate([*long, *SEEDED])
  assert metrics.num_preemptions > 0
  by_id = {o.request_id: o for o in outputs}
  for r in SEEDED:
    assert by_id[r.request_id].output_token_ids == ar_tokens[r.request_id]
