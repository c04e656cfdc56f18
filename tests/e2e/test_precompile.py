"""``Engine.precompile``: after it, a run of the same requests compiles nothing (decode,
verify and prefill shapes), compiled one by one or in threads first, with unchanged
greedy outputs."""

import jax
import numpy as np
import pytest
from e2e_lib import ENGINE_CONFIG, make_requests

from harness.synthetic import ConstantDrafter
from methods.ngram import NGram
from methods.registry import make_method
from specjax.batch import bucket
from specjax.config import SamplingParams
from specjax.metrics import CompileMonitor
from specjax.precompile import prefill_shapes
from specjax.request import Request

pytestmark = pytest.mark.filterwarnings("ignore")


def _pages_bucket(page_size):
  return lambda ends: bucket(-(-max(ends) // page_size), 64, minimum=4, growth=4)


def test_prefill_shapes_docstring_example():
  reqs = [Request("a", (0,) * 40), Request("b", (0,) * 700)]
  shapes = prefill_shapes(reqs, bucket=bucket, pages_bucket=_pages_bucket(16), max_num_seqs=4,
                          budget=512, min_bucket=16)
  assert shapes == [(1, 64, 4), (1, 256, 64), (1, 512, 64), (2, 256, 64)]


def test_prefill_shapes_cover_what_a_run_meets(make_engine):
  """Every prefill call of a real run has a shape from prefill_shapes."""
  requests = make_requests(5, 7, prompt_len=(1, 30), max_tokens=(1, 3))
  cfg = ENGINE_CONFIG.replace(max_num_seqs=4, max_model_len=40, num_pages=64,
                              max_num_batched_tokens=64, min_prefill_bucket=8)
  engine = make_engine("ar", cfg)
  seen = []
  real = engine._prefill

  def spy(chunks, metrics, state):
    t = bucket(max(e - s for _, s, e in chunks), cfg.max_num_batched_tokens,
               cfg.min_prefill_bucket)
    seen.append((bucket(len(chunks), cfg.max_num_seqs), t,
                 engine._pages_bucket([e for _, _, e in chunks])))
    return real(chunks, metrics, state)

  engine._prefill = spy
  engine.generate(requests)
  shapes = set(prefill_shapes(requests, bucket=bucket, pages_bucket=engine._pages_bucket,
                              max_num_seqs=cfg.max_num_seqs, budget=cfg.max_num_batched_tokens,
                              min_bucket=cfg.min_prefill_bucket))
  assert seen and set(seen) <= shapes, set(seen) - shapes


@pytest.mark.parametrize("method", [
    make_method("ar"), NGram(k=4),
    pytest.param(NGram(k=4, device=False), marks=pytest.mark.slow),
    pytest.param(ConstantDrafter(k=2), marks=pytest.mark.slow)])
def test_no_compiles_after_precompile(make_engine, reference, method):
  requests = make_requests(31, 6)
  cfg = ENGINE_CONFIG.replace(max_num_seqs=4)
  engine = make_engine(method, cfg)
  assert engine.precompile(requests, num_threads=1) > 0
  outputs, metrics = engine.generate(requests)
  decode_compiles = [s for s in metrics.steps if s.compiled]
  assert not decode_compiles, [(s.num_rows, s.pages_bucket, s.query_bucket)
                               for s in decode_compiles]
  assert metrics.num_compiles == 0 and metrics.prefill_compiled_s == 0
  if method.name != "constant":
    assert [o.output_token_ids for o in outputs] == reference(requests)


def test_threaded_precompile(make_engine, reference):
  """Compiled in threads first, then run as padding calls: as many compiles as one by
  one (each shape once, not again in its padding call, also under a thread-local
  precision context as evaluations run), and the run compiles nothing."""
  requests = make_requests(32, 5)
  cfg = ENGINE_CONFIG.replace(max_num_seqs=2, min_prefill_bucket=16)
  compiles = {}
  with jax.default_matmul_precision("float32"):
    for threads in (1, 2):
      engine = make_engine(NGram(k=3), cfg)
      jax.clear_caches()
      c0 = CompileMonitor.snapshot()[0]
      count = engine.precompile(requests, num_threads=threads)
      compiles[threads] = CompileMonitor.snapshot()[0] - c0
    outputs, metrics = engine.generate(requests)
  assert count > 0 and compiles[2] == compiles[1] >= count, (count, compiles)
  assert metrics.num_compiles == 0 and not any(s.compiled for s in metrics.steps)
  # Not even a flagged window: the first call of a shape compiled in a thread hits jit's
  # trace cache, which JAX records as a ~0 s trace event (CompileMonitor ignores those).
  assert not metrics.compile_windows and metrics.prefill_compiled_s == 0
  assert [o.output_token_ids for o in outputs] == reference(requests)


def test_compile_monitor_ignores_trace_cache_hits():
  trace, lower, backend = ("/jax/core/compile/jaxpr_trace_duration",
                           "/jax/core/compile/jaxpr_to_mlir_module_duration",
                           "/jax/core/compile/backend_compile_duration")
  before = CompileMonitor.snapshot()
  CompileMonitor._on_event(trace, 2e-5)
  CompileMonitor._on_event(lower, 1e-5)
  assert CompileMonitor.snapshot() == before
  CompileMonitor._on_event(trace, 0.25)
  CompileMonitor._on_event(backend, 0.0)
  count, seconds = CompileMonitor.snapshot()
  assert count == before[0] + 1 and seconds == pytest.approx(before[1] + 0.25)


def test_fused_head_compiles_nothing_after_precompile_on_a_new_engine(target):
  """A learned head's feature-pool writes at prefill (``prefill_device``) keep one
  compiled variant whatever the arrays' placement history: after one engine's precompile
  and run, a new engine (an evaluation's next repeat) compiles nothing. The target's
  weights are committed to the device, as loaded real weights are."""

  from methods.eagle3 import Eagle3  # noqa: PLC0415
  from specjax.engine import Engine  # noqa: PLC0415

  placed = target._replace(params=jax.device_put(target.params, jax.devices()[0]))

  def make_engine(method, config):
    return Engine(placed, method, config)

  # The first request's prefill bucket (16) is not the first one precompile runs (4).
  rng = np.random.default_rng(33)
  requests = [Request(f"r{i}", tuple(int(t) for t in rng.integers(0, 20, n)),
                      SamplingParams(max_tokens=3)) for i, n in enumerate((14, 3))]
  cfg = ENGINE_CONFIG.replace(max_num_seqs=1, min_prefill_bucket=4)
  method = Eagle3(k=2, feature_layers=(1, 2, 2))
  first = make_engine(method, cfg)
  assert first.precompile(requests, num_threads=1) > 0
  _, metrics = first.generate(requests)
  assert metrics.num_compiles == 0 and metrics.prefill_compiled_s == 0
  _, again = make_engine(method, cfg).generate(requests)
  assert again.num_compiles == 0 and again.prefill_compiled_s == 0


def test_decode_batch_sizes_pad_every_step_to_the_listed_sizes(make_engine, reference):
  """``EngineConfig.decode_batch_sizes=(4,)``: every decode / verify step runs 4 rows
  (a run of 6 requests on 4 slots drains to fewer), precompile compiles fewer shapes
  (decode batch buckets 4 instead of 1, 2, 4), the run compiles nothing and the greedy
  outputs are AR's."""
  requests = make_requests(33, 6)
  cfg = ENGINE_CONFIG.replace(max_num_seqs=4)
  shapes = {}
  for sizes in (None, (4,)):
    engine = make_engine(NGram(k=3), cfg.replace(decode_batch_sizes=sizes))
    shapes[sizes] = engine.precompile(requests, num_threads=1)
    outputs, metrics = engine.generate(requests)
    assert metrics.num_compiles == 0
    assert [o.output_token_ids for o in outputs] == reference(requests)
    if sizes:
      assert {s.batch_bucket for s in metrics.steps} == {4}
      assert min(s.num_rows for s in metrics.steps) < 4  # the drain ran padded
  assert shapes[None] > shapes[(4,)] > 0, shapes


def test_mixed_sampling_compiles_nothing_after_precompile(make_engine):
  """Greedy, temperature and top-k requests on 2 slots: a step can hold any mix of them
  (greedy only, fused, jnp, fused+jnp samplers); each is precompiled (only the whole
  workload's mix was before: the greedy-only steps compiled in the run)."""
  requests = (make_requests(34, 3, prefix="g")
              + make_requests(35, 3, prefix="t", temperature=0.8, seed=1)
              + make_requests(36, 2, prefix="k", temperature=0.8, top_k=5, seed=2))
  engine = make_engine(NGram(k=3), ENGINE_CONFIG.replace(max_num_seqs=2))
  assert engine.precompile(requests, num_threads=1) > 0
  _, metrics = engine.generate(requests)
  assert metrics.num_compiles == 0 and not any(s.compiled for s in metrics.steps)
