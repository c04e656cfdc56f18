"""Offline agreement of a trained draft head on an evaluation's prompts
(``methods.training.agreement``): the acceptance the head can reach there, to set
beside ``experiments.evaluate``'s measured ``accept_rate_pos{j}``.

The target answers the prompts greedily (the evaluation's prompt selection and chat
template, ``--max_new_tokens``), then the head's training-time unroll is scored on
those answers. One CSV row per depth j: ``top1`` (depth j's own agreement), ``chain``
(over every response position as a chain start), ``num_starts``, ``stepped`` (over the
chain starts greedy SD with k = depth visits: the engine's ``accept_rate_pos{j}``); the
log prints the offline tau of a k = depth chain over every start.

  python -m experiments.head_agreement --target=smollm2-135m \\
      --head_path=smollm2-135m-eagle3 --categories=mt_bench --num_prompts=16
"""

from __future__ import annotations

import os

import jax
import pandas as pd
from absl import flags

from harness import cli
from harness.evaluation import MATMUL_PRECISIONS
from harness.workloads import DATASETS, load_prompts, tokenize_prompts
from methods.training.agreement import head_agreement
from methods.training.data import regenerate
from models.heads import load_head
from models.zoo import load_model, resolve_head_path
from specjax.steps import split_model

_TARGET = flags.DEFINE_string("target", "smollm2-135m", "models.zoo name, .gguf or HF dir.")
_HEAD = flags.DEFINE_string("head_path", None, "Head directory or models.zoo.HEADS name.",
                            required=True)
_DATASET = flags.DEFINE_enum("dataset", "spec_bench", list(DATASETS), "Prompt set.")
_CATEGORIES = flags.DEFINE_list("categories", None, "Categories (default: all).")
_NUM_PROMPTS = flags.DEFINE_integer("num_prompts", 16, "Prompts.", lower_bound=1)
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 128, "Greedy response budget.", lower_bound=1)
_DEPTH = flags.DEFINE_integer("depth", 5, "Chain depths scored (k; MTP/Medusa: at most the "
                              "head's modules).", lower_bound=1)
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Target dtype.")
_PRECISION = flags.DEFINE_enum("matmul_precision", "highest", list(MATMUL_PRECISIONS),
                               "jax.default_matmul_precision of generation and scoring.")
_CHAT = flags.DEFINE_boolean("chat_template", True, "Apply the tokenizer's chat template.")
_SEED = flags.DEFINE_integer("seed", 0, "Prompt selection seed (as evaluate's).")
_BATCH = flags.DEFINE_integer("batch_size", 16, "Rows per generation / scoring call.",
                              lower_bound=1)
_OUT = flags.DEFINE_string("output_dir", "results/head_agreement", "Where the CSV goes.")


def main(argv):
  del argv
  prompts = load_prompts(_DATASET.value, _NUM_PROMPTS.value, _CATEGORIES.value, _SEED.value)
  loaded = load_model(_TARGET.value, _DTYPE.value)
  if loaded.tokenizer is None:
    raise ValueError(f"target={_TARGET.value!r} has no tokenizer: text prompts need one")
  head = load_head(resolve_head_path(_HEAD.value), loaded.config)
  ids = tokenize_prompts(prompts, loaded.tokenizer, chat_template=_CHAT.value)
  width = max(len(p) for p in ids) + _MAX_NEW.value
  with jax.default_matmul_precision(_PRECISION.value):
    target = split_model(loaded.model)
    data = regenerate(target, ids, max_new_tokens=_MAX_NEW.value, max_len=width + 1,
                      eos_token_ids=loaded.tokenizer.eos_token_ids, batch_size=_BATCH.value)
    agree = head_agreement(head, target, data, _DEPTH.value, _BATCH.value)
  df = pd.DataFrame({
      "depth": range(1, _DEPTH.value + 1), "top1": agree.top1, "chain": agree.chain,
      "num_starts": agree.num_starts, "stepped": agree.stepped})
  for key, value in (("model", _TARGET.value), ("head", _HEAD.value),
                     ("dataset", _DATASET.value),
                     ("categories", ",".join(_CATEGORIES.value or ["all"])),
                     ("num_prompts", _NUM_PROMPTS.value), ("max_new_tokens", _MAX_NEW.value),
                     ("matmul_precision", _PRECISION.value), ("offline_tau", agree.tau),
                     ("backend", jax.default_backend())):
    df[key] = value
  os.makedirs(_OUT.value, exist_ok=True)
  path = os.path.join(_OUT.value, "head_agreement.csv")
  df.to_csv(path, index=False)
  print(df[["depth", "top1", "chain", "num_starts", "stepped"]].to_string(index=False))
  print(f"offline tau (k={_DEPTH.value} chain): {agree.tau:.3f}; {path}")


if __name__ == "__main__":
  cli.run(main)
