"""Tree drafts through the engine (G1, G4, G5 for trees).

``ScriptedTreeDrafter`` builds trees around the greedy reference continuation: at
every level the right token sits at a chosen sibling rank (not necessarily the first
child) and a decoy carrying the next right token hangs under a wrong sibling. Greedy
tree SD must then equal greedy AR token for token, accept exactly the path a plain
Python walk of the same tree predicts (every accepted node but the first child of the
root sits past its depth, so its KV is moved), and end requests at EOS / stop ids /
stop strings / max_tokens / max_model_len inside an accepted path exactly as AR does.
A chain handed over as a one-branch tree gives the chain's outputs and counters, greedy
and stochastic. G3: a seeded request with no draft does not depend on a partner's tree.
"""

import dataclasses

import numpy as np
import pytest
from e2e_lib import (
    MAX_MODEL_LEN,
    VOCAB,
    ChainAsTree,
    check_counters,
    decode,
    make_requests,
    scripted_drafter,
    scripted_tree,
    walk_tree,
)

from methods.registry import make_method
from specjax.config import SamplingParams
from specjax.method import Draft, Method
from specjax.request import Request

TREE_K = 12  # 4 levels of (wrong, right, decoy) with branching 2: depth 4 like K = 4
WORKLOADS = {"batch1": (1, 1), "batch3": (2, 3)}  # (seed, n): mixed prompts of 1..12
LAYOUTS = {
    "right_second": dict(branching=2, right_rank=1),
    "right_third_2_levels": dict(branching=3, right_rank=2, num_right=2),
    "right_first_1_level": dict(branching=2, right_rank=0, num_right=1),
}


def _expected_counts(drafter, request, output):
  """Per-step ``(nodes, accepted, emitted)`` of one greedy request, by walking the
  drafter's own trees with the known continuation."""
  cont = dict((rid, c) for rid, _, c in drafter.script)[request.request_id]
  p, max_tokens = len(request.prompt_token_ids), request.sampling.max_tokens
  steps, done = [], 0
  while done < len(output):
    budget = max(0, min(drafter.k, MAX_MODEL_LEN - (p + done), max_tokens - done - 1))
    tokens, parents = drafter.build(cont, done, budget)
    accepted = walk_tree(tokens, parents, cont[done:])
    emitted = min(accepted + 1, len(output) - done)
    steps.append((len(tokens), min(accepted, emitted), emitted))
    done += emitted
  return steps


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_greedy_tree_sd_equals_ar(make_engine, reference, workload, layout):
  requests = make_requests(*WORKLOADS[workload])
  drafter = scripted_tree(requests, reference, k=TREE_K, **LAYOUTS[layout])
  outputs, metrics = make_engine(drafter).generate(requests)
  expected = reference(requests)
  assert [o.output_token_ids for o in outputs] == expected
  check_counters(metrics, outputs, TREE_K, tree=True)
  all_steps = []
  for r, o, e in zip(requests, outputs, expected):
    steps = _expected_counts(drafter, r, e)
    assert o.num_steps == len(steps), r.request_id
    assert o.num_draft_tokens == sum(s[0] for s in steps), r.request_id
    assert o.num_accepted_tokens == sum(s[1] for s in steps), r.request_id
    all_steps += steps
  assert sum(s.num_accepted for s in metrics.steps) == sum(s[1] for s in all_steps)
  # Ragged speculation: the verify width is the bucket of the step's largest tree.
  assert all(s.query_bucket - 1 <= TREE_K for s in metrics.steps)
  assert all(s.query_bucket > 1 for s in metrics.steps if s.num_draft_tokens)
  best = max(s[1] for s in all_steps)
  want = {"right_second": 4, "right_third_2_levels": 2, "right_first_1_level": 1}[layout]
  assert best <= want
  if workload == "batch3":  # long enough: full paths through non-first children accepted
    assert best == want


def _steps(metrics):
  return [(s.num_rows, s.num_draft_tokens, s.num_accepted, s.num_emitted,
           tuple(s.accepted_per_position), tuple(s.drafted_per_position)) for s in metrics.steps]


@pytest.mark.parametrize("method", ["scripted_2", "draft_model_sampled"])
def test_chain_equals_one_branch_tree(make_engine, reference, method):
  requests = make_requests(2, 3)
  if method == "scripted_2":
    chain = scripted_drafter(requests, reference, num_right=2)
  else:
    chain = make_method("draft_model", 4)
    requests = make_requests(2, 3, prefix="s", temperature=0.8, top_k=5, seed=7)
  a_out, a_metrics = make_engine(chain).generate(requests)
  b_out, b_metrics = make_engine(ChainAsTree(inner=chain)).generate(requests)
  for a, b in zip(a_out, b_out):
    assert a.output_token_ids == b.output_token_ids, a.request_id
    assert (a.num_steps, a.num_draft_tokens, a.num_accepted_tokens) == (
        b.num_steps, b.num_draft_tokens, b.num_accepted_tokens), a.request_id
  assert _steps(a_metrics) == _steps(b_metrics)
  assert sum(s.num_accepted for s in b_metrics.steps) > 0


# ---------------------------------------------------------------- stops (G4)
PROMPT = (5, 17, 33, 2, 40, 9)
_RUN_INSIDE = (1, 2, 3, 6, 7, 8)  # output indices strictly inside an accepted 5-token run


@pytest.fixture(scope="module")
def continuation(reference):
  req = Request("c", PROMPT, SamplingParams(max_tokens=MAX_MODEL_LEN, ignore_eos=True))
  return reference([req])[0]


def _stop_requests(cont):
  firsts = [s for s in _RUN_INSIDE if cont[s] not in cont[:s]]
  assert len(firsts) >= 2, f"test model gives no usable stop positions in {cont}"
  reqs = [Request(f"stop_id@{s}", PROMPT, SamplingParams(max_tokens=26, stop_token_ids=(cont[s],)))
          for s in firsts]
  text = decode(cont)
  for s in _RUN_INSIDE:
    stop = decode(cont[s - 1: s + 1])
    if text.find(stop) == s - 1:
      reqs.append(Request(f"stop_str@{s}", PROMPT, SamplingParams(max_tokens=26, stop=(stop,))))
  reqs += [Request(f"max_tokens={m}", PROMPT, SamplingParams(max_tokens=m)) for m in (1, 3, 7)]
  reqs.append(Request("max_model_len", tuple(range(3, 23)), SamplingParams(max_tokens=40)))
  return reqs, firsts[-1]


def test_stops_inside_tree_path(make_engine, reference, continuation):
  requests, eos_at = _stop_requests(continuation)
  eos = continuation[eos_at]
  requests += [Request("eos", PROMPT, SamplingParams(max_tokens=26)),
               Request("ignore_eos", PROMPT, SamplingParams(max_tokens=26, ignore_eos=True))]
  requests = requests[:8]  # one batch (max_num_seqs)
  for batch in (requests[:4], requests[4:]):  # 4 rows x (17 + TREE_K) positions fit the pool
    drafter = scripted_tree(batch, reference, k=TREE_K, branching=2, right_rank=1)
    sd_out, sd_metrics = make_engine(drafter, eos_token_ids=(eos,)).generate(batch)
    ar_out, _ = make_engine(make_method("ar"), eos_token_ids=(eos,)).generate(batch)
    for r, s, a in zip(batch, sd_out, ar_out):
      assert s.output_token_ids == a.output_token_ids, r.request_id
      assert s.finish_reason == a.finish_reason, r.request_id
      assert s.text == a.text, r.request_id
    check_counters(sd_metrics, sd_out, TREE_K, tree=True)
    by_id = {o.request_id: o for o in sd_out}
    for rid, o in by_id.items():
      kind, _, arg = rid.partition("@")
      if kind == "stop_id":
        assert o.output_token_ids == continuation[: int(arg) + 1] and o.finish_reason == "stop"
      if rid == "eos":
        assert o.output_token_ids == continuation[: eos_at + 1] and o.finish_reason == "stop"


# ---------------------------------------------------------------- G3 for trees
@dataclasses.dataclass(frozen=True, kw_only=True)
class _PartnerTree(Method):
  """Drafts a small tree (two children of the root, one grandchild) for the request ids
  in ``drafting`` and nothing for the others (tokens need not be right: q is one-hot)."""

  name = "partner_tree"
  k: int = TREE_K
  drafting: frozenset = frozenset()

  @property
  def num_speculative_tokens(self) -> int:
    return self.k

  def propose(self, state, context):
    rows = len(context.request_ids)
    tokens = np.full((rows, self.k), -1, np.int32)
    parents = np.full((rows, self.k), -1, np.int32)
    num = np.zeros(rows, np.int32)
    for i, (rid, seq) in enumerate(zip(context.request_ids, context.token_ids)):
      n = min(3, int(context.budgets[i])) if rid in self.drafting else 0
      last = int(seq[-1])
      tokens[i, :n] = [(last + 1) % VOCAB, (last + 2) % VOCAB, (last + 3) % VOCAB][:n]
      parents[i, :n] = [-1, -1, 0][:n]
      num[i] = n
    return state, Draft(tokens, num, parents=parents)


def test_seeded_row_without_draft_ignores_tree_partner(make_engine):
  """A seeded sampled request that never drafts gets the same tokens alone (chain steps:
  the fused sampler under "auto") as next to a partner whose tree routes every step
  through the tree sampler."""
  solo = Request("solo", (7, 21, 3, 30, 12),
                 SamplingParams(temperature=1.0, seed=99, max_tokens=10))
  partner = Request("partner", (4, 4, 9), SamplingParams(temperature=0.9, seed=5, max_tokens=10))
  method = _PartnerTree(drafting=frozenset({"partner"}))
  alone = make_engine(method).generate([solo])[0][0].output_token_ids
  mixed, metrics = make_engine(method).generate([solo, partner])
  assert any(s.num_draft_tokens for s in metrics.steps)  # the partner drafted trees
  assert mixed[0].output_token_ids == alone
