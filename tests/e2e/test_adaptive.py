"""The adaptive orchestrator (``methods.adaptive``) through the engine.

G1: whatever member drafts a row, greedy output equals greedy AR. The choice is
recorded per member; a prompt of heavy repetition goes to suffix decoding, one without
repetition to the draft model. G2 (slow): rows drafted by suffix (one-hot q) and by the
draft model (its own q) in the same sampled steps keep the target's law.
"""

import pytest
from e2e_lib import (
    ENGINE_CONFIG,
    K,
    assert_target_law,
    check_counters,
    law_requests,
    make_requests,
)

from methods.adaptive import Adaptive, counterfactual_acceptance
from methods.registry import make_method
from specjax.config import SamplingParams
from specjax.request import Request

ALL = ("suffix", "ngram", "draft_model")


def _chosen_rows(engine):
  stats = Adaptive.stats(engine.runtime)
  assert stats is engine.runtime.method_cache[engine.method]
  return stats.chosen


@pytest.mark.parametrize("drafters", [
    ("suffix", "ngram"),
    pytest.param(ALL, marks=pytest.mark.slow),  # ~100 s: the draft model's compiles
])
def test_greedy_adaptive_equals_ar(make_engine, reference, drafters):
  requests = make_requests(4, 12)  # a queue: rows join and finish at different steps
  engine = make_engine(make_method("adaptive", K, drafters=drafters))
  expected = reference(requests)
  for _ in range(2):  # the second pass also drafts from the global suffix cache
    outputs, metrics = engine.generate(requests)
    assert [o.output_token_ids for o in outputs] == expected
    check_counters(metrics, outputs, K)
    chosen = _chosen_rows(engine)
    assert sum(chosen.values()) == sum(s.num_rows for s in metrics.steps)
    stats = Adaptive.stats(engine.runtime)
    assert sum(stats.accepted.values()) == sum(s.num_accepted for s in metrics.steps)
  # The second pass finds whole earlier responses in the global tree: suffix drafts.
  assert chosen["suffix"] > 0 and ("draft_model" not in drafters or chosen["draft_model"] > 0)


def _first_choices(make_engine, reference, prompts):
  """One fresh engine, one sampled-free batch of ``prompts`` with max_tokens 2: each row
  drafts (budget 1) only in its first step, so the counters hold the first-step choices."""
  method = make_method("adaptive", K, drafters=("suffix", "draft_model"), prior=0.5)
  engine = make_engine(method)
  requests = [Request(f"r{i}", p, SamplingParams(max_tokens=2)) for i, p in enumerate(prompts)]
  outputs, _ = engine.generate(requests)
  assert [o.output_token_ids for o in outputs] == reference(requests)
  stats = Adaptive.stats(engine.runtime)
  for name, est in stats.estimates.items():  # learned from the rows each member drafted
    assert est.drafted[0] == stats.chosen[name] + stats.counterfactual[name]
    assert est.drafted[1:].sum() == 0
    assert est.accepted[0] == stats.accepted[name]
  return stats.chosen


def test_repetition_picks_suffix_and_none_picks_the_model(make_engine, reference):
  # Period-4 prompts: the suffix draft's first token has p = 3/4 > the model's prior 1/2.
  repetitive = [(5, 6, 7, 8) * 4, (9, 1, 2) * 5, (30, 31, 32, 33) * 3, (4, 40) * 6]
  chosen = _first_choices(make_engine, reference, repetitive)
  assert chosen["suffix"] == len(repetitive) and chosen["draft_model"] == 0, chosen
  # No token repeats: no suffix match (score 0), so the draft model drafts.
  plain = [tuple(range(10, 22)), (1, 2, 3), (44, 7, 19, 23, 0), (8,)]
  chosen = _first_choices(make_engine, reference, plain)
  assert chosen["draft_model"] == len(plain) and chosen["suffix"] == 0, chosen


@pytest.mark.parametrize("drafters, match", [
    (("suffix", "suffix"), "distinct"),
    ((), "non-empty"),
    (("suffix", "nope"), "'nope'"),
    (("suffix", "adaptive"), "'adaptive'"),
    (("ngram", "ar"), "refused: \\['ar'\\]"),
])
def test_bad_drafters_refused(drafters, match):
  with pytest.raises(ValueError, match=match) as info:
    make_method("adaptive", K, drafters=drafters)
  assert "\n" not in str(info.value)


@pytest.mark.parametrize("option, value", [("prior", 0.0), ("prior", 1.5),
                                           ("prior_weight", 0.0), ("k", 0)])
def test_bad_options_refused(option, value):
  with pytest.raises(ValueError, match=f"{option}={value}"):
    Adaptive(**{option: value})


def test_capabilities_are_the_union():
  host = make_method("adaptive", K, drafters="suffix,ngram")
  assert tuple(m.name for m in host.drafters) == ("suffix", "ngram")
  assert host.describe()["drafters"] == ("suffix", "ngram")
  assert host.capabilities().runs_on == "host"
  both = make_method("adaptive", K, drafters=ALL)
  caps = both.capabilities()
  assert caps.runs_on == "device" and caps.needs_draft_model and caps.emits_draft_probs
  hash(both)


# ---------------------------------------------------------------- G2
NUM_SAMPLES = 512


@pytest.mark.slow  # ~1 min on a 2-core CPU
def test_mixed_drafters_keep_the_target_law(make_engine, target):
  repetitive, plain = (9, 4, 9, 4, 9, 4, 9, 4, 9), (7, 21, 3, 30, 12)
  requests = [r for pair in zip(law_requests(NUM_SAMPLES, 2, repetitive, prefix="rep"),
                                law_requests(NUM_SAMPLES, 2, plain, prefix="plain"))
              for r in pair]
  method = make_method("adaptive", K, drafters=("suffix", "draft_model"), prior=0.5)
  engine = make_engine(method)
  outputs, metrics = engine.generate(requests)
  check_counters(metrics, outputs, K)
  chosen = _chosen_rows(engine)
  assert chosen["suffix"] > 0 and chosen["draft_model"] > 0, chosen
  for tag, prompt in (("rep", repetitive), ("plain", plain)):
    assert_target_law(target, [o for o in outputs if o.request_id.startswith(tag)], 2, prompt)


# ---------------------------------------------------------------- members with features
def _ngram_eagle3(**options):
  # A random EAGLE-3 head over the 2-layer target's low/mid/high states.
  return Adaptive(k=K, drafters=(make_method("ngram", K),
                                 make_method("eagle3", K, feature_layers=(1, 2, 2))), **options)


def test_greedy_adaptive_with_an_eagle3_member_equals_ar(make_engine, reference):
  method = _ngram_eagle3()
  assert method.capabilities().target_hidden_layers == (1, 2, 2)
  requests = make_requests(4, 12)
  engine = make_engine(method)
  outputs, metrics = engine.generate(requests)
  assert [o.output_token_ids for o in outputs] == reference(requests)
  check_counters(metrics, outputs, K)
  chosen = _chosen_rows(engine)
  assert chosen["eagle3"] > 0, chosen  # its features followed the rows n-gram drafted too


# ---------------------------------------------------------------- replayed acceptance
def test_each_row_replays_the_trace_of_the_member_that_drafted_it(make_engine):
  # Two replay sources per request: suffix (member 0) never accepted, n-gram (member 1)
  # always wholly accepted; swapped, the other way round. Repetitive prompts: both draft.
  prompts = [(5, 6, 7, 8) * 4, (9, 1, 2) * 5, (30, 31, 32, 33) * 3, (4, 40) * 6]
  config = ENGINE_CONFIG.replace(acceptance_replay=True, replay_sources=2)
  n = 20
  for never, always in (("suffix", "ngram"), ("ngram", "suffix")):
    traces = {never: (1,) * n, always: (K + 1,) * n}
    requests = [Request(f"r{i}", p, SamplingParams(max_tokens=n, ignore_eos=True),
                        replay_acc_len=traces["suffix"], replay_sources=(traces["ngram"],))
                for i, p in enumerate(prompts)]
    engine = make_engine(make_method("adaptive", K, drafters=("suffix", "ngram")), config)
    _, metrics = engine.generate(requests)
    stats = Adaptive.stats(engine.runtime)
    assert stats.chosen[never] > 0 and stats.chosen[always] > 0, stats.chosen
    assert stats.accepted[never] == 0
    assert stats.accepted[always] == stats.drafted[always] > 0
    assert sum(stats.accepted.values()) == sum(s.num_accepted for s in metrics.steps)


def test_replay_sources_are_checked(make_engine):
  sp = SamplingParams(max_tokens=4, ignore_eos=True)
  engine = make_engine(make_method("adaptive", K, drafters=("suffix", "ngram")),
                       ENGINE_CONFIG.replace(acceptance_replay=True, replay_sources=2))
  with pytest.raises(ValueError, match="0 replay_sources; the engine replays 2 sources"):
    engine.generate([Request("a", (1, 2), sp, replay_acc_len=(2,) * 4)])
  with pytest.raises(ValueError, match=r"replay_sources\[0\] must hold >= 4 entries"):
    engine.generate([Request("a", (1, 2), sp, replay_acc_len=(2,) * 4,
                             replay_sources=((2,) * 3,))])
  with pytest.raises(ValueError, match="replay_sources=2 needs acceptance_replay=True"):
    ENGINE_CONFIG.replace(replay_sources=2)


# ---------------------------------------------------------------- counterfactual observation
@pytest.mark.parametrize("draft, committed, expected", [
    ((7, 8, 9), (7, 5), (3, 1)),  # diverges at position 1, inside the known tokens: exact
    ((7, 8), (7, 8, 9), (2, 2)),  # ends inside them: exact, wholly accepted
    ((7, 8, 9, 4), (7, 8), (2, 2)),  # matches all 2 known tokens: censored at 2
    ((3,), (7, 8), (1, 0)),
    ((), (7,), (0, 0)),
    ((7, 8), (7,), (1, 1)),  # a stop cut the step to one token: censored at 1
])
def test_counterfactual_acceptance(draft, committed, expected):
  assert counterfactual_acceptance(draft, committed) == expected


def test_a_member_whose_first_rows_failed_is_chosen_again(make_engine):
  # n-gram's recorded drafts accept nothing at the first output positions, then all;
  # suffix accepts two drafts everywhere. After the bad start n-gram's estimate falls
  # below suffix's; only the counterfactual observation of the drafts it still makes for
  # the rows suffix drafts lets it be chosen again (otherwise the choice locks in).
  prompts = [(5, 6, 7, 8) * 4, (9, 1, 2) * 5, (30, 31, 32, 33) * 3, (4, 40) * 6]
  config = ENGINE_CONFIG.replace(acceptance_replay=True, replay_sources=2,
                                 max_model_len=96, num_pages=48)
  n, bad = 64, 4
  ngram_trace, suffix_trace = (1,) * bad + (K + 1,) * (n - bad), (3,) * n
  requests = [Request(f"r{i}", p, SamplingParams(max_tokens=n, ignore_eos=True),
                      replay_acc_len=ngram_trace, replay_sources=(suffix_trace,))
              for i, p in enumerate(prompts)]
  engine = make_engine(make_method("adaptive", K, drafters=("ngram", "suffix")), config)
  _, metrics = engine.generate(requests)
  stats = Adaptive.stats(engine.runtime)
  assert stats.chosen["suffix"] > 0 and stats.counterfactual["ngram"] > 0, stats
  # n-gram wins the rows back: most of its accepted drafts come after the bad start.
  assert stats.accepted["ngram"] > stats.accepted["suffix"], stats
  assert sum(stats.accepted.values()) == sum(s.num_accepted for s in metrics.steps)
