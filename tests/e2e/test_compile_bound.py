"""A varied workload compiles a bounded number of times; a repeated one compiles none.

Every dynamic size is bucketed (batch, prefill tokens, KV pages; the verify step has
T = 1 or k + 1), so the number of backend compiles of a run is bounded by the product
of bucket counts, whatever the mix of batch sizes, prompt lengths and ``max_tokens``.
The test uses its own model graph (a config no other test uses), so the target's
forward steps are compiled here from scratch whatever ran before.
"""

from e2e_lib import K, build_model, make_requests, model_config

from methods.registry import make_method
from specjax.config import EngineConfig
from specjax.engine import Engine, bucket
from specjax.request import Request

CONFIG = EngineConfig(max_num_seqs=4, max_model_len=32, page_size=8, num_pages=16,
                      min_prefill_bucket=16)


def _buckets(max_n, cap, minimum=1, growth=2):
  """The engine's buckets of sizes 1..max_n (``Engine`` calls ``bucket``)."""
  return {bucket(n, cap, minimum, growth) for n in range(1, max_n + 1)}


def _bound(config: EngineConfig, k: int) -> int:
  batch = len(_buckets(config.max_num_seqs, config.max_num_seqs))
  # Prefill covers all but the pending token: 1 .. max_model_len - 2 tokens.
  prefill = len(_buckets(config.max_model_len - 2, config.max_model_len,
                         config.min_prefill_bucket))
  pages = len(_buckets(config.pages_per_seq, config.pages_per_seq, 4, growth=4))
  query = 2 if k else 1  # T = 1 (no drafts this step) or k + 1
  forward = pages * (prefill + batch * query)  # prefill runs one sequence per call
  verify = batch * query  # greedy requests only: one verify variant per (B, T)
  return forward + verify


def _workload(seed):
  """10 requests for 4 seats (batches of 1..4 rows), prompts 1..24, max_tokens 1..8.

  Every other prompt repeats itself, so n-gram lookup finds drafts (T = k + 1 steps).
  """
  requests = make_requests(seed, 10, prompt_len=(1, 12), max_tokens=(1, 8), prefix=f"w{seed}-")
  return [r if i % 2 else Request(r.request_id, r.prompt_token_ids * 2, r.sampling)
          for i, r in enumerate(requests)]


def test_compiles_are_bounded():
  target = build_model(model_config(rms_norm_eps=1e-5), seed=7)  # a fresh graph
  engine = Engine(target, make_method("ngram", K), CONFIG)
  bound = _bound(CONFIG, K)
  assert bound == 1 * (2 + 3 * 2) + 3 * 2  # B in {1,2,4}, prefill T in {16,32}, 4 pages
  outputs, metrics = engine.generate(_workload(0))
  shapes = {(s.batch_bucket, s.query_bucket, s.pages_bucket) for s in metrics.steps}
  assert len({s.num_rows for s in metrics.steps}) >= 3  # the workload is varied
  assert K + 1 in {q for _, q, _ in shapes}  # drafts were verified
  # Each decode shape of the fresh graph compiled at least once, and no more than the bound.
  assert len(shapes) <= metrics.num_compiles <= bound, (metrics.num_compiles, shapes)

  again, metrics_again = engine.generate(_workload(0))
  assert metrics_again.num_compiles == 0
  assert [o.output_token_ids for o in again] == [o.output_token_ids for o in outputs]

  # A different varied workload stays inside the same buckets.
  _, metrics_other = engine.generate(_workload(1))
  assert metrics.num_compiles + metrics_other.num_compiles <= bound
