"""Runs AR and SD methods over a benchmark and prints tau, c, S_pred and measured speedup.

Flags -> ``harness.evaluation.EvalConfig`` -> ``run_evaluation``. "ar" (the reference)
always runs. Examples:

  python -m experiments.evaluate   # smollm2-135m, 24 Spec-Bench prompts, ar,ngram, b=1,4
  python -m experiments.evaluate --target=qwen2.5-coder-1.5b --draft=qwen2.5-coder-0.5b \
      --methods=ar,draft_model,ngram --dataset=humaneval --num_prompts=8 --batch_sizes=1
  # random weights of a real shape (no download, no tokenizer): random token-id prompts
  python -m experiments.evaluate --target=random:llama3-8b --dtype=bfloat16 \
      --dataset=random --input_len=512 --num_prompts=16 --batch_sizes=1,16
"""

from __future__ import annotations

import jax
from absl import app, flags

from harness import cli
from harness.evaluation import (
  LAYER_EXECUTIONS,
  MATMUL_PRECISIONS,
  EvalConfig,
  default_output_dir,
  run_evaluation,
)
from harness.workloads import DATASETS, RANDOM_DATASET
from models.layers import SMALL_F32_MATMULS, set_small_f32_matmul, small_f32_matmul

_TARGET = flags.DEFINE_string(
    "target", "smollm2-135m",
    "Target model: a models.zoo name, random:<shape> (random weights of a models.shapes.SHAPES "
    "architecture, e.g. random:llama3-8b; needs --dataset=random), a .gguf file or an HF "
    "directory.")
_DRAFT = flags.DEFINE_string(
    "draft", None, "Draft model for draft_model (same tokenizer as the target); none = no draft.")
_METHODS = flags.DEFINE_list("methods", ["ar", "ngram"], "SD methods; 'ar' always runs. "
                             "NAME@LABEL runs a labelled configuration of NAME (its own "
                             "--method_option=NAME@LABEL.OPTION=VALUE; LABEL without '.'), "
                             "e.g. eagle3@chain,eagle3@tree against one AR run.")
_METHOD_OPTION = flags.DEFINE_multi_string(
    "method_option", [],
    "METHOD.OPTION=VALUE for a method's config (repeatable), e.g. eagle.head_path=heads/e1 or "
    "ngram.n_max=3; VALUE is read as JSON when it parses (3, [30] as a tuple, true), else as a string. "
    "OPTION k sets that method's draft length (default --num_speculative_tokens).")
_DATASET = flags.DEFINE_enum(
    "dataset", "spec_bench", [*DATASETS, RANDOM_DATASET],
    "Prompt set; 'random': --input_len random token ids per prompt (seeded by --seed).")
_INPUT_LEN = flags.DEFINE_integer(
    "input_len", None, "Prompt length in tokens of --dataset=random (only there).")
_NUM_PROMPTS = flags.DEFINE_integer("num_prompts", 24, "Prompts, balanced over categories.")
_CATEGORIES = flags.DEFINE_list("categories", None, "Subset of the dataset's categories.")
_BATCH_SIZES = flags.DEFINE_list("batch_sizes", ["1", "4"], "Batch sizes (max_num_seqs).")
_K = flags.DEFINE_integer("num_speculative_tokens", 4, "Draft length k of SD methods.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 128, "Generated tokens per request (max).")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "Sampling temperature; 0 = greedy.")
_SEED = flags.DEFINE_integer("seed", 0, "Prompt sampling, arrivals and request keys.")
_REPEATS = flags.DEFINE_integer(
    "repeats", None,
    "Measured passes per method and batch size, each with its own sampling seed and a fresh "
    "engine (mean ± std and a 95%% t interval over them); default 3 on GPU, 2 elsewhere.")
_OUTPUT_DIR = flags.DEFINE_string(
    "output_dir", None, "Where results.csv and outputs.jsonl go (default results/<timestamp>).")
_MAX_MODEL_LEN = flags.DEFINE_integer(
    "max_model_len", None, "Tokens per sequence (default: longest prompt + max_new_tokens).")
_PAGE_SIZE = flags.DEFINE_integer("page_size", 16, "KV positions per page.")
_ATTN = flags.DEFINE_list(
    "attention_implementation", ["reference"],
    "Paged-attention implementation(s), tried in order (pallas_kernels.paged_attention."
    "IMPLEMENTATIONS lists them).")
_VERIFY = flags.DEFINE_list(
    "verify_implementation", ["auto"],
    "auto: the fused chain sampler (jnp row statistics) for temperature-only steps, else the "
    "jnp rejection sampler; jnp: the jnp rejection sampler (temperature, top-k, top-p) always; "
    "else pallas_kernels.verify implementation(s) for the fused sampler (temperature only), "
    "e.g. pallas_triton.")
_RATE = flags.DEFINE_float(
    "request_rate", None, "Poisson arrivals in requests/s (online mode); unset = offline.")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Model dtype.")
_WARMUP = flags.DEFINE_boolean(
    "warmup", True, "Run the workload once untimed per engine first (compiles outside timing).")
_WARMUP_TOKENS = flags.DEFINE_integer(
    "warmup_tokens", 16,
    "New tokens per request in the warm-up pass (0 = the full max_new_tokens).")
_IGNORE_EOS = flags.DEFINE_boolean(
    "ignore_eos", None,
    "EOS does not end requests (each makes --max_new_tokens); unset: on iff the target has "
    "no tokenizer (random: targets).")
_CHAT = flags.DEFINE_boolean(
    "chat_template", True, "Apply the tokenizer's chat template when it has one.")
_LAYERS = flags.DEFINE_enum(
    "layer_execution", "unrolled", list(LAYER_EXECUTIONS),
    "'unrolled' (fastest steps) or 'scan' (one lax.scan over the layers: faster compiles).")
_PRECISION = flags.DEFINE_enum(
    "matmul_precision", "highest", list(MATMUL_PRECISIONS),
    "jax.default_matmul_precision for every pass (default 'highest': "
    "full-f32 matmuls on GPUs, for a token-exact lossless check.")

_MESH = flags.DEFINE_string(
    "mesh", "none", "'none' or a one-replica device mesh such as 'data:1,model:2' "
    "(specjax.sharding; tensor-parallel target, KV pool split by KV heads).")
_DRAFT_SHARDING = flags.DEFINE_enum(
    "draft_sharding", "replicated", ["replicated", "sharded"],
    "Draft model / learned head placement on the mesh.")
_BATCHED = flags.DEFINE_integer(
    "max_num_batched_tokens", 512, "Prefill token budget per engine iteration (chunked prefill).")
_PRECOMPILE = flags.DEFINE_boolean(
    "precompile", True, "In the warm-up, first compile every decode, verify and prefill "
    "shape the measured passes can meet (Engine.precompile), so they compile none.")
_PRECOMPILE_THREADS = flags.DEFINE_integer(
    "precompile_threads", None, "Compile threads of --precompile (default: the cores, at "
    "most 16; 1: one shape at a time).", lower_bound=1)
_STEPS_PER_DISPATCH = flags.DEFINE_integer(
    "steps_per_dispatch", EvalConfig.steps_per_dispatch, "Engine iterations per device "
    "call (plain decoding and fused proposers such as ngram; "
    "EngineConfig.steps_per_dispatch).")
_CACHE = flags.DEFINE_boolean(
    "compilation_cache", True, "JAX persistent compilation cache under $SPECJAX_CACHE.")
_SLO_TTFT = flags.DEFINE_float(
    "slo_ttft_ms", None, "TTFT service-level objective in ms (goodput, SLO attainment).")
_SLO_TPOT = flags.DEFINE_float(
    "slo_tpot_ms", None, "TPOT service-level objective in ms (goodput, SLO attainment).")
_PLOTS = flags.DEFINE_boolean("plots", True, "Write figures next to results.csv.")
_DEVICE_PROFILE = flags.DEFINE_boolean(
    "device_profile", False, "One more pass per method under jax.profiler: device_ms and "
    "c_device columns (device time per step; GPU/TPU only) and ops_{method}_b{batch}.csv.")
_METHOD_BY_METHOD = flags.DEFINE_boolean(
    "method_by_method", False, "Per batch size, each method's warm-up and repeats before the "
    "next method's (AR first), so a run cut off early keeps every finished method's rows "
    "(results.csv is rewritten after each measured pass); not with --device_profile.")
_PEER = flags.DEFINE_enum(
    "peer", "none", ["none", "hf"],
    "hf: also run Hugging Face transformers (greedy generate and prompt-lookup decoding) on the "
    "same prompt ids from the same local weights; needs torch and transformers.")


def parse_method_options(entries: list[str]) -> dict[str, dict[str, object]]:
  """``["eagle.head_path=/h", "ngram.n_max=3"]`` -> ``{"eagle": {"head_path": "/h"}, ...}``.

  Raises:
    ValueError: an entry not of the form ``METHOD.OPTION=VALUE``.
  """
  out: dict[str, dict[str, object]] = {}
  for entry in entries:
    key, sep, raw = entry.partition("=")
    method, dot, option = key.partition(".")
    if not (sep and dot and method and option):
      raise ValueError(f"--method_option={entry!r} must look like METHOD.OPTION=VALUE")
    out.setdefault(method, {})[option] = cli.option_value(raw)
  return out


_SMALL_F32 = flags.DEFINE_enum(
    "small_f32_matmul", small_f32_matmul()[0], list(SMALL_F32_MATMULS),
    "models.layers.set_small_f32_matmul: how full-f32 GPU projections of at most "
    "--small_f32_max_rows rows run (recorded as the small_f32_matmul column).")
_SMALL_F32_ROWS = flags.DEFINE_integer("small_f32_max_rows", small_f32_matmul()[1],
                                       "Most rows of such a projection.", lower_bound=0)


_ACCEPTANCE = flags.DEFINE_string(
    "acceptance", "real", "real (drafts verified) or replay:FILE[:METHOD]: a trace file's "
    "requests (their prompt and output lengths; --dataset and --max_new_tokens unused) "
    "with each SD method's acceptance replayed from it (timing only, not lossless).")


def config_from_flags() -> EvalConfig:
  """The ``EvalConfig`` the parsed flags describe."""
  draft = _DRAFT.value
  if draft is not None and draft.strip().lower() in ("", "none"):
    draft = None
  try:
    batch_sizes = tuple(int(b) for b in _BATCH_SIZES.value)
  except ValueError as e:
    raise ValueError(f"--batch_sizes={','.join(_BATCH_SIZES.value)} must be integers") from e
  attn = tuple(_ATTN.value)
  return EvalConfig(
      target=_TARGET.value,
      draft=draft,
      methods=tuple(_METHODS.value),
      method_options=parse_method_options(_METHOD_OPTION.value),
      dataset=_DATASET.value,
      input_len=_INPUT_LEN.value,
      num_prompts=_NUM_PROMPTS.value,
      categories=tuple(_CATEGORIES.value) if _CATEGORIES.value else None,
      batch_sizes=batch_sizes,
      num_speculative_tokens=_K.value,
      max_new_tokens=_MAX_NEW.value,
      temperature=_TEMPERATURE.value,
      seed=_SEED.value,
      repeats=_REPEATS.value or default_repeats(),
      output_dir=_OUTPUT_DIR.value or default_output_dir(),
      max_model_len=_MAX_MODEL_LEN.value,
      page_size=_PAGE_SIZE.value,
      attention_implementation=attn[0] if len(attn) == 1 else attn,
      request_rate=_RATE.value,
      dtype=_DTYPE.value,
      warmup=_WARMUP.value,
      warmup_tokens=_WARMUP_TOKENS.value or None,
      chat_template=_CHAT.value,
      layer_execution=_LAYERS.value,
      ignore_eos=_IGNORE_EOS.value,
      verify_implementation=_verify_implementation(_VERIFY.value),
      matmul_precision=_PRECISION.value,
      max_num_batched_tokens=_BATCHED.value, steps_per_dispatch=_STEPS_PER_DISPATCH.value,
      precompile=_PRECOMPILE.value, precompile_threads=_PRECOMPILE_THREADS.value,
      compilation_cache=_CACHE.value,
      mesh=_MESH.value, draft_sharding=_DRAFT_SHARDING.value,
      slo_ttft_s=None if _SLO_TTFT.value is None else _SLO_TTFT.value / 1e3,
      slo_tpot_s=None if _SLO_TPOT.value is None else _SLO_TPOT.value / 1e3,
      plots=_PLOTS.value,
      peer=None if _PEER.value == "none" else _PEER.value,
      device_profile=_DEVICE_PROFILE.value,
      method_by_method=_METHOD_BY_METHOD.value,
      acceptance=_ACCEPTANCE.value,
  )


def default_repeats() -> int:
  """3 repeats on a GPU, 2 elsewhere (the CPU default run must stay short)."""
  return 3 if jax.default_backend() == "gpu" else 2


def _verify_implementation(values: list[str]):
  """``--verify_implementation`` -> ``EvalConfig.verify_implementation``; "auto" and
  "jnp" stand alone, kernel names may be listed (tried in order)."""
  if len(values) == 1 and values[0] in ("auto", "jnp"):
    return None if values[0] == "jnp" else "auto"
  if not values or {"auto", "jnp"} & set(values):
    raise ValueError(f"--verify_implementation={','.join(values)} must be 'auto', 'jnp', or "
                     "pallas_kernels.verify implementation names (reference, pallas_triton), "
                     "tried in order")
  return values[0] if len(values) == 1 else tuple(values)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  set_small_f32_matmul(_SMALL_F32.value, _SMALL_F32_ROWS.value)  # recorded in each row
  run_evaluation(config_from_flags())  # caller errors: one line (harness.cli)


if __name__ == "__main__":
  cli.run(main)
