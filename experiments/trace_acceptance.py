"""Writes per-position acceptance traces (``harness.traces``; the seed simulator's layout).

  python -m experiments.trace_acceptance --target=qwen2.5-coder-1.5b \
      --draft=qwen2.5-coder-0.5b --methods=ngram,draft_model --dataset=humaneval \
      --num_prompts=8 --max_new_tokens=128 --output_dir=results/traces
"""

from __future__ import annotations

import json

from absl import flags

from harness import cli
from harness.traces import TraceConfig, run_traces

_TARGET = flags.DEFINE_string("target", "smollm2-135m", "models.zoo name or path.")
_DRAFT = flags.DEFINE_string("draft", None, "Draft model (for draft_model).")
_METHODS = flags.DEFINE_list("methods", ["ngram"], "methods.registry names.")
_OPTION = flags.DEFINE_multi_string("method_option", [], "METHOD.OPTION=VALUE (repeatable).")
_DATASET = flags.DEFINE_string("dataset", "spec_bench", "harness.workloads dataset or random.")
_NUM = flags.DEFINE_integer("num_prompts", 24, "Prompts.")
_CATS = flags.DEFINE_list("categories", None, "Categories (default all).")
_INPUT_LEN = flags.DEFINE_integer("input_len", 0, "Prompt length of --dataset=random.")
_NEW = flags.DEFINE_integer("max_new_tokens", 256, "Output tokens per request.")
_KMAX = flags.DEFINE_integer("k_max", 16, "Most drafts per traced step.")
_BATCH = flags.DEFINE_integer("batch_size", 8, "Rows of the AR run.")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Model dtype.")
_IMPL = flags.DEFINE_string("attention_implementation", "reference", "Paged attention.")
_SEED = flags.DEFINE_integer("seed", 0, "Workload seed.")
_OUT = flags.DEFINE_string("output_dir", "results/traces", "Where the JSONL goes.")


def _method_options(entries) -> dict:
  """``["ngram.n_max=3"]`` -> ``{"ngram": {"n_max": 3}}`` (values parsed as JSON if they can
  be; lists become tuples), as experiments.evaluate's ``--method_option``."""
  out: dict = {}
  for entry in entries:
    key, sep, raw = entry.partition("=")
    method, dot, option = key.partition(".")
    if not (sep and dot and method and option):
      raise ValueError(f"--method_option={entry!r} must look like METHOD.OPTION=VALUE")
    try:
      value = json.loads(raw)
    except json.JSONDecodeError:
      value = raw
    out.setdefault(method, {})[option] = tuple(value) if isinstance(value, list) else value
  return out


def main(argv):
  del argv
  cfg = TraceConfig(
      target=_TARGET.value, draft=_DRAFT.value, methods=tuple(_METHODS.value),
      method_options=_method_options(_OPTION.value), dataset=_DATASET.value,
      num_prompts=_NUM.value, categories=tuple(_CATS.value) if _CATS.value else None,
      input_len=_INPUT_LEN.value, seed=_SEED.value, max_new_tokens=_NEW.value,
      k_max=_KMAX.value, batch_size=_BATCH.value, dtype=_DTYPE.value,
      attention_implementation=_IMPL.value, output_dir=_OUT.value)
  print(f"wrote {run_traces(cfg)}")


if __name__ == "__main__":
  cli.run(main)
