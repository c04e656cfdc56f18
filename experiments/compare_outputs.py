"""Compares the greedy outputs of two evaluation runs (e.g. CPU vs GPU, f32 vs bf16).

Reads two ``outputs.jsonl`` files written by ``experiments.evaluate`` for the same
prompts, pairs records by (method, batch_size, repeat, request_id), and for each pair
that differs reports the first differing position and the target's top-2 logit margin
there (recomputed on this machine for the reference run's context, see
``harness.divergence``). Writes ``divergences.csv`` and prints a per-method summary.

  python -m experiments.compare_outputs --reference=cpu/outputs.jsonl \
      --other=gpu/outputs.jsonl --target=smollm2-135m --output_dir=results/cpu_vs_gpu
"""

from __future__ import annotations

import json
import os

import jax
import pandas as pd
from absl import flags

from harness import cli
from harness.divergence import divergence
from harness.evaluation import load_model
from specjax.steps import split_model

_REF = flags.DEFINE_string("reference", None, "Reference outputs.jsonl.", required=True)
_OTHER = flags.DEFINE_string("other", None, "Other outputs.jsonl.", required=True)
_TARGET = flags.DEFINE_string("target", "smollm2-135m", "Target model of both runs.")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"],
                           "Dtype for the margin forward.")
_PRECISION = flags.DEFINE_string("matmul_precision", "highest", "Matmul precision of the forward.")
_OUT = flags.DEFINE_string("output_dir", None, "Where divergences.csv goes (default: none).")

_KEY = ("method", "batch_size", "repeat", "request_id")


def _read(path: str) -> dict:
  with open(path) as f:
    recs = [json.loads(line) for line in f if line.strip()]
  return {tuple(r[k] for k in _KEY): r for r in recs}


def main(argv):
  del argv
  ref, other = _read(_REF.value), _read(_OTHER.value)
  common = sorted(set(ref) & set(other), key=str)
  if not common:
    raise ValueError(f"no (method, batch_size, repeat, request_id) in both {_REF.value} "
                     f"and {_OTHER.value}")
  target = split_model(load_model(_TARGET.value, _DTYPE.value).model)
  prompt_ids = _prompt_ids(ref)
  rows = []
  with jax.default_matmul_precision(_PRECISION.value):
    for key in common:
      a, b = ref[key]["output_token_ids"], other[key]["output_token_ids"]
      d = divergence(target, prompt_ids[key[3]], a, b) if a != b else None
      rows.append({**dict(zip(_KEY, key)), "diverged": d is not None,
                   "position": d.position if d else None, "margin": d.margin if d else None,
                   "reference_token": d.reference_token if d else None,
                   "other_token": d.other_token if d else None})
  df = pd.DataFrame(rows)
  summary = df.groupby(["method", "batch_size"]).agg(
      requests=("diverged", "size"), diverged=("diverged", "sum"),
      max_margin=("margin", "max"), median_position=("position", "median"))
  print(summary.to_string())
  if _OUT.value:
    os.makedirs(_OUT.value, exist_ok=True)
    df.to_csv(os.path.join(_OUT.value, "divergences.csv"), index=False)
    print(f"wrote {os.path.join(_OUT.value, 'divergences.csv')}")


def _prompt_ids(records: dict) -> dict:
  """request_id -> prompt token ids (outputs.jsonl stores them as ``prompt_token_ids``)."""
  out = {}
  for r in records.values():
    if "prompt_token_ids" not in r:
      raise ValueError("outputs.jsonl lacks prompt_token_ids; re-run experiments.evaluate")
    out[r["request_id"]] = r["prompt_token_ids"]
  return out


if __name__ == "__main__":
  cli.run(main)
