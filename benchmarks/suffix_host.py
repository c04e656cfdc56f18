"""Host cost of suffix decoding's propose + observe (no device, no model).

Builds B requests of ``--prompt_len`` tokens (a text-like stream: a Zipf-distributed
vocabulary, or with ``--repeat`` a prompt made of a repeated chunk), then times
``SuffixDecoding.propose`` and ``observe`` per engine step with ``--emitted`` new
tokens per row, and prints the first step (which builds the local trees), the median
steady step and the mean draft length. Compare with the device step time (e.g.
``benchmarks.engine_loop``) to see whether the host keeps up.

  python -m benchmarks.suffix_host --batch_sizes=1,8,32 --prompt_len=1000 --k=8
"""

from __future__ import annotations

import time

import numpy as np
import pandas as pd
from absl import flags

from harness import cli
from methods.suffix import SuffixDecoding
from specjax.method import ProposeContext, RuntimeInfo, VerifyResult

_BATCHES = flags.DEFINE_list("batch_sizes", ["1", "8", "32"], "Rows B per step.")
_PROMPT = flags.DEFINE_integer("prompt_len", 1000, "Prompt tokens per request.")
_K = flags.DEFINE_integer("k", 8, "Most draft tokens per row.")
_STEPS = flags.DEFINE_integer("steps", 30, "Timed steps.")
_EMITTED = flags.DEFINE_integer("emitted", 3, "Tokens committed per row per step.")
_REPEAT = flags.DEFINE_integer("repeat", 0, "If > 0: prompts repeat a chunk of this length.")
_TREE = flags.DEFINE_boolean("tree", False, "Tree drafting.")
_OUT = flags.DEFINE_string("output_csv", None, "Optional CSV path.")


def _tokens(rng, n):
  if _REPEAT.value > 0:
    chunk = rng.zipf(1.3, _REPEAT.value) % 32000
    return np.resize(chunk, n).astype(np.int32)
  return (rng.zipf(1.3, n) % 32000).astype(np.int32)


def _context(ids, seqs, k):
  b = len(ids)
  return ProposeContext(ids, seqs, np.full(b, k, np.int32), np.zeros((b, 1), np.int32),
                        np.zeros(b, np.float32), np.zeros(b, np.int32), np.ones(b, np.float32),
                        np.zeros((b, 2), np.uint32), frozenset(ids))


def run(batch: int) -> dict:
  rng = np.random.default_rng(batch)
  method = SuffixDecoding(k=_K.value, tree=_TREE.value)
  state = method.init_state(RuntimeInfo(None, None, 1, 1, 1 << 20, None))
  ids = [f"r{i}" for i in range(batch)]
  seqs = [_tokens(rng, _PROMPT.value) for _ in ids]
  t0 = time.perf_counter()
  state, _ = method.propose(state, _context(ids, seqs, _K.value))
  first = time.perf_counter() - t0
  times, drafted = [], []
  for _ in range(_STEPS.value):
    emitted = [_tokens(rng, _EMITTED.value).tolist() for _ in ids]
    t0 = time.perf_counter()
    state = method.observe(state, VerifyResult(ids, np.zeros(batch, np.int32), emitted,
                                               frozenset()))
    seqs = [np.concatenate([s, e]).astype(np.int32) for s, e in zip(seqs, emitted)]
    state, draft = method.propose(state, _context(ids, seqs, _K.value))
    times.append(time.perf_counter() - t0)
    drafted.append(float(np.mean(draft.num_tokens)))
  steady = float(np.median(times))
  return {"batch": batch, "prompt_len": _PROMPT.value, "k": _K.value, "tree": _TREE.value,
          "first_step_ms": 1e3 * first, "steady_step_ms": 1e3 * steady,
          "steady_us_per_row": 1e6 * steady / batch, "mean_draft_len": float(np.mean(drafted))}


def main(argv):
  del argv
  df = pd.DataFrame([run(int(b)) for b in _BATCHES.value])
  print(df.to_string(index=False, float_format=lambda x: f"{x:.2f}"))
  if _OUT.value:
    df.to_csv(_OUT.value, index=False)


if __name__ == "__main__":
  cli.run(main)
