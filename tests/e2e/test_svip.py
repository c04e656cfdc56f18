"""SVIP (``methods.svip``): entropy-stopped drafting around the draft model.

The tiny draft's ``sqrt(0.15 H)`` lies around 0.55-0.65, so ``h = 0.6`` stops some rows
early and lets others draft k: draft lengths vary per row and step. Checked: the stop
rule itself (lengths recomputed from the uncached draft forward), greedy == AR, EOS /
stop ids inside accepted runs, counters, seeded partner independence, the target
distribution under sampling, and the ``h = inf`` / huge-h oracles (the plain drafter).
"""

import numpy as np
import pytest
from e2e_lib import K, check_counters, full_logits, make_requests

import methods.draft_model as draft_model_mod
from methods.registry import make_method
from specjax.config import SamplingParams
from specjax.request import Request

H = 0.62


def _entropy(logits):
  z = logits - logits.max(-1, keepdims=True)
  p = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
  return -(p * np.log(p)).sum(-1)


@pytest.fixture(scope="module")
def svip_engine(make_engine):
  return make_engine(make_method("svip", K, h=H))


def test_stop_rule_and_greedy_equals_ar(svip_engine, draft, reference, monkeypatch):
  """Each row drafts exactly ``min(budget, first t with sqrt(0.15 H_t) > h)`` tokens,
  with H_t from the uncached draft forward (numpy entropy): the stop is tested after
  emitting x_t."""
  seen = []
  real = draft_model_mod.DraftModel.propose

  def spy(self, state, ctx):
    state, d = real(self, state, ctx)
    seen.append(([np.array(t) for t in ctx.token_ids], ctx.budgets.copy(), d.tokens.copy(),
                 np.array(d.num_tokens)))
    return state, d

  monkeypatch.setattr(draft_model_mod.DraftModel, "propose", spy)
  for seed, n in ((3, 8),):
    requests = make_requests(seed, n)
    seen.clear()
    outputs, metrics = svip_engine.generate(requests)
    assert [o.output_token_ids for o in outputs] == reference(requests)
    check_counters(metrics, outputs, K)
    lengths = []
    for seqs, budgets, tokens, num in seen:
      for seq, b, toks, n_tok in zip(seqs, budgets, tokens, num):
        if b == 0:
          assert n_tok == 0
          continue
        ents = _entropy(full_logits(draft, [list(seq) + list(toks[:t]) for t in range(b)]))
        stops = np.flatnonzero(np.sqrt(0.15 * ents) > H)
        assert n_tok == (min(b, stops[0] + 1) if stops.size else b), (ents, n_tok, b)
        assert (toks[n_tok:] == -1).all()
        lengths.append(int(n_tok))
  assert min(lengths) < max(lengths) and min(lengths) < K, lengths  # ragged, and stops


@pytest.mark.slow  # compiles; CI keeps the stop-rule and oracle tests
def test_stops_inside_accepted_runs(svip_engine, reference):
  requests = make_requests(7, 6, prompt_len=(2, 8), max_tokens=(3, 12))
  expected = reference(requests)
  eos = tuple(sorted({o[len(o) // 2] for o in expected if len(o) > 2}))[:3]
  requests = [Request(r.request_id, r.prompt_token_ids,
                      SamplingParams(max_tokens=r.sampling.max_tokens, stop_token_ids=eos[:1]))
              for r in requests]
  outputs, metrics = svip_engine.generate(requests)
  want = reference(requests)
  assert [o.output_token_ids for o in outputs] == want
  assert any(o.finish_reason == "stop" for o in outputs)
  check_counters(metrics, outputs, K)
  svip_engine.eos_ids = frozenset(eos[1:])
  try:
    outputs, _ = svip_engine.generate(requests)
  finally:
    svip_engine.eos_ids = frozenset()
  assert [o.output_token_ids for o in outputs] == reference(requests, eos_ids=eos[1:])


SEEDED = Request("seeded", (7, 21, 3, 30, 12, 44, 8),
                 SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12))


@pytest.mark.slow  # compiles; CI keeps the stop-rule and oracle tests
def test_seeded_partner_independence(svip_engine):
  alone = svip_engine.generate([SEEDED])[0][0].output_token_ids
  partners = make_requests(11, 5, prefix="g") + make_requests(12, 2, temperature=0.8, top_k=5,
                                                               seed=3, prefix="s")
  for batch in ([*partners[:2], SEEDED], [SEEDED, *partners]):
    outputs, metrics = svip_engine.generate(batch)
    assert {o.request_id: o for o in outputs}["seeded"].output_token_ids == alone
    check_counters(metrics, outputs, K)


@pytest.mark.parametrize("h, sampled", [
    pytest.param(1e6, False, marks=pytest.mark.slow),
    pytest.param(1e6, True, marks=pytest.mark.slow),
    pytest.param(float("inf"), True, marks=pytest.mark.slow)])
def test_no_stop_is_the_plain_drafter(make_engine, h, sampled):
  """h = inf is the plain draft model's code path; h = 1e6 runs the while-loop path but
  never stops: both give the plain (host-called) drafter's drafts, counters and (seeded)
  samples, and the fused draft model's outputs (its steps are scheduled asynchronously,
  so its per-step rows can differ when requests join a step later)."""
  requests = make_requests(3, 8)
  if sampled:
    requests = requests[:4] + make_requests(4, 4, temperature=1.0, seed=5, prefix="s")
  plain_out, plain_m = make_engine(make_method("draft_model", K, fused=False)).generate(requests)
  fused_out, _ = make_engine(make_method("draft_model", K)).generate(requests)
  out, m = make_engine(make_method("svip", K, h=h)).generate(requests)
  assert [o.output_token_ids for o in out] == [o.output_token_ids for o in plain_out]
  assert [o.output_token_ids for o in out] == [o.output_token_ids for o in fused_out]
  assert [(s.num_draft_tokens, s.num_accepted, s.num_emitted) for s in m.steps] == [
      (s.num_draft_tokens, s.num_accepted, s.num_emitted) for s in plain_m.steps]


def test_bad_options():
  with pytest.raises(ValueError, match="h=-1"):
    make_method("svip", K, h=-1.0)
  with pytest.raises(ValueError, match="no entropy stop"):
    make_method("svip", K, drafter="ngram")
