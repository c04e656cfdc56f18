"""Drafters respect the rows' budgets (``ProposeContext.budgets``).

Near ``max_model_len`` (and at a request's last tokens) a row may take fewer than k
drafts: the host-called draft model (``fused=False``) must then run only
``max(budgets)`` draft forwards, none in a step where every budget is 0, and still give
greedy SD == greedy AR. (The fused draft model always runs k forwards with the rows past
their budget masked out: the host does not know the budgets when it dispatches; its
greedy equivalence near the limits is the second half of this test.)
"""

from e2e_lib import MAX_MODEL_LEN

import methods.draft_model as draft_model_mod
from methods.registry import make_method
from specjax.config import SamplingParams
from specjax.request import Request


def test_draft_model_runs_at_most_max_budget_forwards(make_engine, reference, monkeypatch):
  forwards, budgets = [], []
  real_step, real_propose = draft_model_mod.draft_tokens_step, draft_model_mod.DraftModel.propose

  def step(*args, **kw):
    forwards[-1] += kw.get("num_steps", kw["k"])  # 1 forward + a scan of num_steps - 1
    return real_step(*args, **kw)

  def propose(self, state, ctx):
    budgets.append(int(max(ctx.budgets, default=0)))
    forwards.append(0)
    return real_propose(self, state, ctx)

  monkeypatch.setattr(draft_model_mod, "draft_tokens_step", step)
  monkeypatch.setattr(draft_model_mod.DraftModel, "propose", propose)
  requests = [Request("edge", tuple(range(3, 3 + MAX_MODEL_LEN - 3)),
                      SamplingParams(max_tokens=40)),
              Request("short", (5, 17, 33), SamplingParams(max_tokens=3))]
  for batch in (requests[:1], requests):
    forwards.clear()
    budgets.clear()
    outputs, _ = make_engine(make_method("draft_model", 4, fused=False)).generate(batch)
    assert [o.output_token_ids for o in outputs] == reference(batch)
    assert min(budgets) < 4  # the limit was reached
    assert forwards == budgets, (forwards, budgets)
  monkeypatch.undo()
  for batch in (requests[:1], requests):
    outputs, _ = make_engine(make_method("draft_model", 4)).generate(batch)
    assert [o.output_token_ids for o in outputs] == reference(batch)
