"""End-to-end head training for a named target: prompts -> target responses -> train.

``train_draft_head(job)`` is the one library call behind
``experiments/train_draft_head.py``. ShareGPT prompts (disjoint from the evaluation
sets) go through the target's chat template; the target regenerates the responses
greedily; the token data is cached in ``output_dir/data.npz`` (reused when the job's data
fields match); then ``trainer.train`` runs (resuming from ``output_dir/checkpoints``).
"""

from __future__ import annotations

import dataclasses
import json
import os

from absl import logging

from methods.training.data import (
    TokenDataset,
    read_sharegpt_prompts,
    regenerate,
    tokenize_chat,
)
from methods.training.trainer import TrainConfig, TrainResult, train
from models.zoo import RANDOM_PREFIX

__all__ = ["DraftHeadJob", "train_draft_head"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class DraftHeadJob:
  """A head-training job for a named target.

  Attributes:
    target: ``models.zoo`` name, ``.gguf`` file or HF directory.
    data: path of a ShareGPT ``.jsonl``/``.json`` file (``experiments.train_draft_head``
      resolves its ``--data`` name, e.g. the bundled sample, with
      ``harness.workloads.sharegpt_path``).
    num_prompts: prompts read (the last ``num_held_out`` are held out).
    all_turns: read every human turn of a record as a prompt, not only the first.
    num_held_out: held-out sequences.
    max_prompt_tokens: prompts are cut to their last this many tokens.
    max_new_tokens: response budget of the regeneration.
    max_len: sequence length T of the training data.
    gen_batch_size: engine batch for the regeneration.
    dtype: target dtype ("float32" | "bfloat16").
    train: the training run (its ``output_dir`` holds everything).
  """

  target: str = "smollm2-135m"
  data: str
  num_prompts: int = 256
  all_turns: bool = False
  num_held_out: int = 16
  max_prompt_tokens: int = 96
  max_new_tokens: int = 160
  max_len: int = 256
  gen_batch_size: int = 16
  dtype: str = "float32"
  train: TrainConfig

  def __post_init__(self):
    for name in ("num_prompts", "num_held_out", "max_prompt_tokens", "max_new_tokens",
                 "max_len", "gen_batch_size"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
    if self.num_held_out >= self.num_prompts:
      raise ValueError(f"num_held_out={self.num_held_out} must be < num_prompts="
                       f"{self.num_prompts}")
    if self.max_prompt_tokens >= self.max_len:
      raise ValueError(f"max_prompt_tokens={self.max_prompt_tokens} must be < max_len="
                       f"{self.max_len}")
    if self.target.startswith(RANDOM_PREFIX):
      raise ValueError(f"target={self.target!r} has random weights and no tokenizer; head "
                       "training regenerates the target's responses to text prompts")


def _data_key(job: DraftHeadJob) -> dict:
  return {k: getattr(job, k) for k in ("target", "data", "num_prompts", "all_turns",
                                       "max_prompt_tokens", "max_new_tokens", "max_len",
                                       "dtype")}


def train_draft_head(job: DraftHeadJob) -> TrainResult:
  """Loads the target, builds (or reuses) the data, trains; see the module docstring."""
  from tqdm.auto import tqdm  # noqa: PLC0415

  from models.zoo import load_model  # noqa: PLC0415

  out_dir = os.path.abspath(job.train.output_dir)
  data_file, key_file = os.path.join(out_dir, "data.npz"), os.path.join(out_dir, "data.json")
  key = _data_key(job)
  cached = (os.path.exists(data_file) and os.path.exists(key_file)
            and json.load(open(key_file)) == key)
  texts = None
  if not cached:  # read the prompts first: a bad --data fails before the model loads
    texts = read_sharegpt_prompts(job.data, job.num_prompts, job.all_turns)
  os.makedirs(out_dir, exist_ok=True)
  loaded = load_model(job.target, dtype=job.dtype)
  if cached:
    data = TokenDataset.load(data_file)
    logging.info("reusing the regenerated data in %s (%d sequences)", data_file, len(data))
  else:
    prompts = tokenize_chat(texts, loaded.tokenizer, job.max_prompt_tokens)
    bar = tqdm(total=len(prompts), desc="regenerate responses", unit="prompt",
               disable=not job.train.progress)
    data = regenerate(loaded.model, prompts, max_new_tokens=job.max_new_tokens,
                      max_len=job.max_len, eos_token_ids=loaded.tokenizer.eos_token_ids,
                      batch_size=job.gen_batch_size, progress=bar.update)
    bar.close()
    data.save(data_file)
    with open(key_file, "w") as f:
      json.dump(key, f)
  train_data, held_out = data.split(min(job.num_held_out, len(data) - 1))
  return train(job.train, loaded.model, train_data, held_out)
