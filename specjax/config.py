"""Frozen configuration dataclasses shared by the library, binaries and tests."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

__all__ = ["AUTO_VERIFY_IMPLEMENTATION", "MATMUL_PRECISIONS", "SAMPLING_EPS", "SamplingParams", "EngineConfig"]

# Temperatures below this are greedy (argmax), as vLLM's ``_SAMPLING_EPS``: softmax(z / t)
# is then one-hot in f32 for any logit gap that matters, and dividing by smaller t only
# courts overflow (a positive t of 1e-9 made the fused sampler's softmax inf / NaN).
# Every sampler and drafter decides greediness by this one rule (``SamplingParams.greedy``,
# ``specjax.sampling.is_greedy``).
SAMPLING_EPS = 1e-5
# Values ``jax.default_matmul_precision`` accepts.
MATMUL_PRECISIONS = ("default", "high", "highest", "bfloat16", "tensorfloat32", "float32")
_F32_MAX = 3.4028234663852886e38


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
  """Per-request sampling and stopping (vLLM semantics).

  Attributes:
    temperature: a finite number >= 0; 0, and any value below ``SAMPLING_EPS`` (1e-5),
      means greedy (argmax), as in vLLM.
    top_k: keep the k most likely tokens; 0 disables. Must be >= 0.
    top_p: nucleus mass in (0, 1]; 1 disables. Greedy requests ignore top-k / top-p.
    seed: per-request seed; outputs of a seeded request do not depend on its batch
      partners. None derives a key from the engine seed and the request id.
    max_tokens: maximum number of generated tokens (>= 1).
    stop: stop strings; the request ends at the first token whose decoded output
      contains one (the string is kept in the token list, like vLLM's token ids).
    stop_token_ids: extra token ids that end the request (emitted, then stop).
    ignore_eos: if True, the model's EOS ids do not end the request.
  """

  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  seed: int | None = None
  max_tokens: int = 128
  stop: tuple[str, ...] = ()
  stop_token_ids: tuple[int, ...] = ()
  ignore_eos: bool = False

  def __post_init__(self):
    if not (_finite(self.temperature) and self.temperature >= 0):
      raise ValueError(f"temperature={self.temperature} must be a finite number >= 0 (values "
                       f"below {SAMPLING_EPS} are greedy)")
    if self.top_k < 0:
      raise ValueError(f"top_k={self.top_k} must be >= 0 (0 disables top-k)")
    if not (_finite(self.top_p) and 0 < self.top_p <= 1):
      raise ValueError(f"top_p={self.top_p} must be a finite number in (0, 1] (1 disables "
                       "top-p)")
    if self.max_tokens < 1:
      raise ValueError(f"max_tokens={self.max_tokens} must be >= 1")
    if isinstance(self.stop, str):
      object.__setattr__(self, "stop", (self.stop,))
    if any(not s for s in self.stop):
      raise ValueError(f"stop={self.stop!r} must not contain empty strings")

  @property
  def greedy(self) -> bool:
    """True for argmax decoding: ``temperature < SAMPLING_EPS`` (0 included)."""
    # Compared in float32, as the device samplers compare the engine's f32 temperatures.
    return bool(np.float32(self.temperature) < np.float32(SAMPLING_EPS))


def _finite(x) -> bool:
  """A real number whose float32 value is finite (NaN, +-inf and > 3.4e38 are not)."""
  try:
    return math.isfinite(x) and abs(x) <= _F32_MAX
  except TypeError:
    return False


# The fused chain sampler's backend under verify_implementation="auto": the jnp row
# statistics beat the Triton-lowered kernel on the H200 (0.13 vs 1.28 ms at batch 1,
# V = 128256, L = 4; docs/gpu/qwen_code_and_llama8b_step/bench_verify_v128256.csv).
AUTO_VERIFY_IMPLEMENTATION = ("reference",)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
  """Engine limits and buckets.

  Attributes:
    max_num_seqs: most sequences in one step (the batch size cap).
    max_model_len: most tokens (prompt + output) per sequence.
    page_size: KV positions per page.
    num_pages: pages in the KV pool; None sizes it so ``max_num_seqs`` sequences of
      ``max_model_len`` fit (no preemption). Smaller pools preempt by recompute.
    attention_implementation: paged-attention implementation(s), recorded in results.
    verify_implementation: how sampled chain drafts are verified. "auto" (default):
      ``specjax.verify.fused_rejection_sample`` with the jnp row-statistics backend
      (one sweep over V per position; measured 0.06-0.08x the jnp sampler's time on a
      2-core CPU at V = 49152 and 0.12-0.25x on the H200 at V = 128256, L = 4,
      ``benchmarks.bench_verify``) for steps whose requests all use temperature only;
      the jnp rejection sampler (``specjax.verify.rejection_sample``: temperature,
      top-k, top-p) for steps with a top-k/top-p request and for tree drafts. None: the
      jnp rejection sampler always. A ``pallas_kernels.verify`` implementation name (or
      names tried in order): the fused sampler always (requests with top-k/top-p are
      rejected, tree drafts raise NotImplementedError). Greedy rows give the same tokens
      under every choice.
    min_prefill_bucket: smallest padded prefill length (prefill T is bucketed to
      powers of two from here).
    max_num_batched_tokens: prefill token budget of one engine iteration (vLLM's
      chunked prefill): one prefill call per iteration covers chunks of several prompts
      whose padded size (rows x bucketed chunk length) is at most this, so a long prompt
      arriving online delays running requests by at most one such call per step.
    decode_batch_sizes: the row counts a decode / verify step is padded to (vLLM's
      ``cudagraph_capture_sizes``): a step of n running rows runs at the smallest listed
      size >= n. None (default): powers of two, capped at ``max_num_seqs``. Increasing,
      each in [1, ``max_num_seqs``], the last ``max_num_seqs``. Fewer sizes mean fewer
      step programs to compile (``Engine.precompile``) and more padding rows in the
      steps below the largest: e.g. ``(max_num_seqs,)`` runs every step at full width
      (a benchmark that measures only full-batch steps compiles one row count).
    async_scheduling: steps of plain decoding and of fused proposers (``Capabilities.
      runs_on == "fused"``) are dispatched before the previous step's result is read (the
      decode state lives on the device, ``specjax.slots``); False: every step waits.
      Host and host-called device proposers always wait (they need step n's tokens
      before step n+1).
    steps_per_dispatch: engine iterations per device call for plain decoding and fused
      proposers (``lax.scan`` inside ``specjax.steps.engine_step``): fewer host round
      trips, but a row that ends inside a call idles (no writes) for the call's rest,
      and new requests join at call boundaries. Stop strings are applied by the host
      afterwards, so outputs do not change. Default 2, from the H200 engine loop
      (``docs/gpu/device_resident_loop``): SmolLM2-135M f32 at batch 1 AR steps of
      2.10 / 1.65 / 1.65 / 1.67 ms at 1 / 2 / 4 / 8 iterations per call (L = 4: 1.83 /
      1.33 / 1.35 / 1.34 ms); Llama-3.1-8B bf16 at batch 1 and 16 unchanged (4.58 and
      5.34 ms at 1 and at 4).
    synthetic_acceptance: None, or per-position acceptance probabilities in [0, 1]:
      verification accepts the leading run of Bernoulli draws instead of comparing
      draft and target (vLLM's synthetic rejection sampling); for timing the engine loop
      on random weights. Outputs are NOT lossless.
    acceptance_replay: replay recorded acceptance (``Request.replay_acc_len``, which
      every request must then carry): a step at output position i accepts
      ``min(replay_acc_len[i] - 1, L)`` of a row's L drafts, whatever the drafts and the
      target (the seed study's traces on random-weight shapes). NOT lossless; exclusive
      with ``synthetic_acceptance``.
    replay_sources: recorded traces per request under ``acceptance_replay``: 1 (default,
      ``Request.replay_acc_len``) or more (``Request.replay_sources`` holds the others; a
      host-path method picks a row's by ``Draft.replay_source``; fused steps replay
      source 0).
    seed: engine seed for requests without their own.
    mesh: None (one device, no sharding), or a ``("data", "model")``
      ``jax.sharding.Mesh`` of data size 1 (``specjax.sharding.make_mesh``): the target
      is placed by ``specjax.sharding.shard_model`` (tensor-parallel on ``model``), the
      KV pool split by KV heads, and the jitted step follows those input shardings.
      Several replicas (data > 1) run through ``specjax.data_parallel``.
    draft_sharding: "replicated" (default: a draft model and a learned head are whole
      on every device of the mesh) or "sharded" (by the target's rules, attention of a
      draft model under ``shard_map`` too).
  """

  max_num_seqs: int = 8
  max_model_len: int = 2048
  page_size: int = 16
  num_pages: int | None = None
  attention_implementation: str | tuple[str, ...] = "reference"
  verify_implementation: str | tuple[str, ...] | None = "auto"
  min_prefill_bucket: int = 16
  max_num_batched_tokens: int = 512
  decode_batch_sizes: tuple[int, ...] | None = None
  async_scheduling: bool = True
  steps_per_dispatch: int = 2
  synthetic_acceptance: tuple[float, ...] | None = None
  acceptance_replay: bool = False
  replay_sources: int = 1
  seed: int = 0
  mesh: object = None
  draft_sharding: str = "replicated"

  def __post_init__(self):
    if self.draft_sharding not in ("replicated", "sharded"):
      raise ValueError(f"draft_sharding={self.draft_sharding!r} must be 'replicated' or "
                       "'sharded'")
    if self.mesh is not None and (tuple(getattr(self.mesh, "axis_names", ())) != ("data", "model")
                                  or self.mesh.shape["data"] != 1):
      raise ValueError(f"mesh={self.mesh!r} must be a ('data', 'model') jax Mesh with data "
                       "size 1 (specjax.sharding.make_mesh; data > 1 runs through "
                       "specjax.data_parallel)")
    if self.verify_implementation not in (None, "auto"):
      from pallas_kernels.verify import IMPLEMENTATIONS  # noqa: PLC0415

      names = ((self.verify_implementation,) if isinstance(self.verify_implementation, str)
               else tuple(self.verify_implementation))
      bad = [n for n in names if n not in IMPLEMENTATIONS]
      if bad or not names:
        raise ValueError(f"verify_implementation={self.verify_implementation!r} must be None, "
                         f"'auto' or names from {IMPLEMENTATIONS}")
      object.__setattr__(self, "verify_implementation", names)
    if self.synthetic_acceptance is not None:
      rates = tuple(float(a) for a in self.synthetic_acceptance)
      if not rates or not all(0.0 <= a <= 1.0 for a in rates):
        raise ValueError(f"synthetic_acceptance={self.synthetic_acceptance!r} must be a "
                         "non-empty sequence of probabilities in [0, 1]")
      object.__setattr__(self, "synthetic_acceptance", rates)
      if self.acceptance_replay:
        raise ValueError("acceptance_replay=True and synthetic_acceptance="
                         f"{self.synthetic_acceptance!r} exclude each other (pick one)")
    if self.replay_sources > 1 and not self.acceptance_replay:
      raise ValueError(f"replay_sources={self.replay_sources} needs acceptance_replay=True")
    for name in ("max_num_seqs", "max_model_len", "page_size", "min_prefill_bucket",
                 "max_num_batched_tokens", "steps_per_dispatch", "replay_sources"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
    if self.decode_batch_sizes is not None:
      sizes = tuple(self.decode_batch_sizes)
      if (not sizes or any(not isinstance(n, int) or not 1 <= n <= self.max_num_seqs
                           for n in sizes) or list(sizes) != sorted(set(sizes))
          or sizes[-1] != self.max_num_seqs):
        raise ValueError(f"decode_batch_sizes={self.decode_batch_sizes!r} must be increasing "
                         f"ints in [1, max_num_seqs={self.max_num_seqs}], the last "
                         f"{self.max_num_seqs}")
      object.__setattr__(self, "decode_batch_sizes", sizes)
    if self.num_pages is not None and self.num_pages < self.pages_per_seq:
      raise ValueError(
          f"num_pages={self.num_pages} must be >= pages for one max_model_len sequence "
          f"({self.pages_per_seq})"
      )

  def decode_batch(self, num_rows: int) -> int:
    """The row count a decode / verify step of ``num_rows`` rows is padded to
    (``decode_batch_sizes``); ``num_rows`` in [1, ``max_num_seqs``]."""
    if self.decode_batch_sizes is None:  # specjax.batch.bucket(num_rows, max_num_seqs)
      return min(1 << max(num_rows - 1, 0).bit_length(), self.max_num_seqs)
    return next(n for n in self.decode_batch_sizes if n >= num_rows)

  @property
  def pages_per_seq(self) -> int:
    return -(-self.max_model_len // self.page_size)

  @property
  def total_pages(self) -> int:
    return self.num_pages if self.num_pages is not None else self.max_num_seqs * self.pages_per_seq

  def replace(self, **kw) -> EngineConfig:
    return dataclasses.replace(self, **kw)
