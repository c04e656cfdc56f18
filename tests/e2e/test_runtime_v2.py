"""Runtime v2 invariants: ragged verify width, chunked batched prefill, the packed host
batch and the pure host commit (literal arrays)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

import specjax.engine as engine_mod
from specjax.batch import build_batch, unpack_batch
from specjax.commit import commit_rows
from specjax.config import EngineConfig, SamplingParams
from specjax.engine import Engine
from specjax.method import Capabilities, Draft, Method
from specjax.request import Request, RequestState
from tests.e2e.e2e_lib import ENGINE_CONFIG, VOCAB, greedy_reference

pytestmark = pytest.mark.filterwarnings("ignore")


@dataclasses.dataclass(frozen=True, kw_only=True)
class FixedCountDrafter(Method):
  """Drafts ``counts[request_id]`` tokens (token 1) per step, at most the budget."""

  name = "fixed_count"
  k: int = 8
  counts: tuple = ()

  @property
  def num_speculative_tokens(self):
    return self.k

  def capabilities(self):
    return Capabilities(runs_on="host")

  def propose(self, state, ctx):
    counts = dict(self.counts)
    rows = len(ctx.request_ids)
    num = np.array([min(counts[r], b) for r, b in zip(ctx.request_ids, ctx.budgets)], np.int32)
    return state, Draft(np.ones((rows, self.k), np.int32), num)


def _spy_lengths(monkeypatch):
  lengths = []
  real = engine_mod.engine_step

  def spy(*a, **kw):
    lengths.append(kw["plan"].length)
    return real(*a, **kw)

  monkeypatch.setattr(engine_mod, "engine_step", spy)
  return lengths


def test_verify_width_follows_longest_draft(target, monkeypatch):
  """k = 8, every row drafts 1 token: every verify step is L = 1 wide (not 8); a step with
  rows of 0 and of 8 drafts is 8 wide; greedy outputs equal the uncached reference."""
  cfg = dataclasses.replace(ENGINE_CONFIG)
  reqs = [Request(f"r{i}", (3 + i, 5, 7), SamplingParams(max_tokens=6)) for i in range(3)]
  lengths = _spy_lengths(monkeypatch)
  one = FixedCountDrafter(k=8, counts=tuple((r.request_id, 1) for r in reqs))
  outs, _ = Engine(target, one, cfg).generate(reqs)
  assert [o.output_token_ids for o in outs] == greedy_reference(target, reqs)
  assert 1 in lengths and set(lengths) <= {0, 1}  # 0: steps whose budgets are all 0
  lengths.clear()
  mixed = FixedCountDrafter(k=8, counts=(("r0", 0), ("r1", 8), ("r2", 0)))
  outs, _ = Engine(target, mixed, cfg).generate(reqs)
  assert [o.output_token_ids for o in outs] == greedy_reference(target, reqs)
  assert max(lengths) == 8 and lengths[0] == 8  # r1's budget is 5 at first: bucket(5) = 8


def test_chunked_prefill_interleaves_with_decode(target, monkeypatch):
  """A 120-token prompt under a 32-token budget is prefilled in chunks of <= 32 padded
  tokens, one prefill call between consecutive decode steps; outputs stay exact."""
  cfg = EngineConfig(max_num_seqs=4, max_model_len=160, page_size=8,
                     max_num_batched_tokens=32, min_prefill_bucket=8)
  events = []
  real_prefill, real_dispatch = Engine._prefill, Engine._dispatch
  monkeypatch.setattr(Engine, "_prefill", lambda self, chunks, *a: (
      events.append(("prefill", sum(e - s for _, s, e in chunks))), real_prefill(self, chunks, *a))[1])
  monkeypatch.setattr(Engine, "_dispatch", lambda self, *a, **kw: (
      events.append(("step", 0)), real_dispatch(self, *a, **kw))[1])
  rng = np.random.default_rng(0)
  long_prompt = tuple(int(t) for t in rng.integers(0, VOCAB, 120))
  reqs = [Request("short", (4, 9, 2), SamplingParams(max_tokens=20)),
          Request("long", long_prompt, SamplingParams(max_tokens=4))]
  from methods.ar import AutoRegressive

  outs, met = Engine(target, AutoRegressive(), cfg).generate(reqs)
  kinds = [k for k, _ in events]
  whole = Engine(target, AutoRegressive(), cfg.replace(max_num_batched_tokens=256))
  assert [o.output_token_ids for o in outs] == [
      o.output_token_ids for o in whole.generate(reqs)[0]]
  assert max(met.prefill_calls) <= 32 and sum(met.prefill_calls) == 2 + 119
  first_step = kinds.index("step")
  # After the short request starts decoding, no two prefill calls come back to back.
  tail = kinds[first_step:]
  assert all(not (a == b == "prefill") for a, b in zip(tail, tail[1:])), kinds
  assert tail.count("prefill") >= 3


def test_build_batch_roundtrip():
  sb = build_batch(batch=2, width=4, length=2, page_tables=[[7, 2]], slots=[3], num_draft=[1],
                   drafts=np.array([[42, -1]], np.int32))
  assert sb.ints[0].tolist() == [7, 2, -1, -1, 3, 1, 42, -1]
  assert sb.ints[1].tolist() == [-1, -1, -1, -1, -1, 0, -1, -1]
  b = jax.jit(unpack_batch, static_argnums=1)(sb.ints, 2)
  assert np.asarray(b.page_indices)[1].tolist() == [-1] * 4 and int(b.slots[1]) == -1
  assert int(b.slots[0]) == 3 and np.asarray(b.drafts)[0].tolist() == [42, -1]
  with pytest.raises(ValueError, match="num_draft"):
    build_batch(batch=1, width=4, length=1, page_tables=[[1]], slots=[0], num_draft=[2])
  # Ragged tables (empty rows too) land row by row; too many pages name the row.
  sb = build_batch(batch=4, width=3, length=0, page_tables=[[5], [], [1, 2, 3]],
                   slots=[0, 1, 2])
  assert sb.ints[:, :3].tolist() == [[5, -1, -1], [-1, -1, -1], [1, 2, 3], [-1, -1, -1]]
  with pytest.raises(ValueError, match=r"row 1 has 4 pages; the step's table holds width=3"):
    build_batch(batch=2, width=3, length=0, page_tables=[[1], [1, 2, 3, 4]], slots=[0, 1])
  assert build_batch(batch=2, width=3, length=0, page_tables=[], slots=[]).ints.tolist() == \
      [[-1, -1, -1, -1, 0]] * 2


def test_commit_rows_eos_inside_accepted_run():
  st = RequestState(Request("a", (1, 2), SamplingParams(max_tokens=10)), np.zeros(2, np.uint32),
                    [1, 2])
  res = commit_rows([st], np.array([[5, 9, 2, -1, 2]]), np.array([3]), k=3,
                    eos_ids=frozenset({9}), max_model_len=64, decode=None, now=1.0)
  assert res.emitted == [[5, 9]] and st.finish_reason.value == "stop"
  assert res.num_accepted == 2 and res.accepted_per_position.tolist() == [1, 1, 0]
  assert res.drafted_per_position.tolist() == [1, 1, 1] and res.finished == [st]


def test_bad_draft_is_refused(target):
  class Bad(FixedCountDrafter):
    def propose(self, state, ctx):
      rows = len(ctx.request_ids)
      return state, Draft(np.full((rows, self.k), -1, np.int32), np.full(rows, 2, np.int32))

  with pytest.raises(ValueError, match="drafted ids"):
    Engine(target, Bad(k=4), ENGINE_CONFIG).generate(
        [Request("x", (1, 2, 3), SamplingParams(max_tokens=4))])


def test_stop_strings_need_a_detokenizer(target):
  from methods.ar import AutoRegressive

  with pytest.raises(ValueError, match="detokenizer"):
    Engine(target, AutoRegressive(), ENGINE_CONFIG).generate(
        [Request("x", (1, 2, 3), SamplingParams(max_tokens=4, stop=("ab",)))])
