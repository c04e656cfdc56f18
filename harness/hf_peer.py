"""Hugging Face transformers as a peer on the same prompt ids (``EvalConfig.peer="hf"``).

The target is loaded into ``transformers.AutoModelForCausalLM`` from the same local
weights specjax runs: the converted HF-form checkpoint (``config.json`` +
``model.safetensors``) that ``models.zoo`` wrote for a zoo name or a ``.gguf`` file, or
the HF directory itself; nothing is fetched (``local_files_only``). Two rows, batch 1
(HF's assisted generation takes one sequence), requests one after another:

- ``hf_greedy``: ``generate(do_sample=False)`` with the model's dynamic cache;
- ``hf_prompt_lookup``: the same with ``prompt_lookup_num_tokens=k`` (prompt-lookup
  decoding, the n-gram drafter of transformers).

Each row reports tokens/s (new tokens / summed generate time after one untimed warm-up
call), and its agreement with specjax's AR outputs of the smallest batch, first repeat:
``exact_match`` (share of requests with identical ids) and ``prefix_agreement`` (mean
share of AR's tokens matched before the first difference). Without torch or
transformers the peer is skipped with one message and ``run_peer`` returns None.
"""

from __future__ import annotations

import os
import time

import pandas as pd
from absl import logging

__all__ = ["hf_checkpoint_dir", "run_peer"]


def hf_checkpoint_dir(target: str, cache_dir: str | None = None) -> str:
  """The HF-form directory holding ``target``'s weights as specjax loads them.

  Raises:
    ValueError: ``target`` is a ``random:`` model (no checkpoint) or has not been
      converted yet (load it with specjax first).
  """
  from models import zoo  # noqa: PLC0415

  if zoo.is_random_name(target):
    raise ValueError(f"target={target!r} has random weights: there is no checkpoint for HF")
  cache_dir = os.fspath(cache_dir or zoo.default_cache_dir())
  if target in zoo.MODELS:
    path = os.path.join(cache_dir, "converted", target)
  elif os.path.isfile(target) and target.endswith(".gguf"):
    path = os.path.join(cache_dir, "converted", f"local-{zoo.sha256_file(target)[:16]}")
  else:
    path = target
  if not os.path.isfile(os.path.join(path, "config.json")):
    raise ValueError(f"target={target!r}: no HF-form checkpoint at {path!r} (load the target "
                     "with specjax once to convert it)")
  return path


def _agreement(ref: list[list[int]], out: list[list[int]]) -> tuple[float, float]:
  exact, prefix = [], []
  for a, b in zip(ref, out):
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    exact.append(a == b)
    prefix.append(n / len(a) if a else 1.0)
  return (sum(exact) / len(exact), sum(prefix) / len(prefix)) if ref else (float("nan"),) * 2


def run_peer(cfg, requests, output_records: list[dict]) -> pd.DataFrame | None:
  """Runs the two HF rows on ``requests``' prompt ids; None when torch/transformers are
  absent (a warning says so). See the module docstring for the columns."""
  try:
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415
  except ImportError as e:
    logging.warning("peer=hf skipped: %s (pip install torch transformers)", e)
    return None
  path = hf_checkpoint_dir(cfg.target)
  device = "cuda" if torch.cuda.is_available() else "cpu"
  dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.dtype]
  model = transformers.AutoModelForCausalLM.from_pretrained(
      path, dtype=dtype, local_files_only=True).to(device).eval()
  ignore_eos = bool(cfg.ignore_eos) if cfg.ignore_eos is not None else False
  batch = min(cfg.batch_sizes)
  ref = {r["request_id"]: r["output_token_ids"] for r in output_records
         if r["method"] == "ar" and r["batch_size"] == batch and r["repeat"] == 0}
  eos = model.generation_config.eos_token_id

  def generate(ids, **kw):
    x = torch.tensor([list(ids)], device=device)
    args = dict(max_new_tokens=cfg.max_new_tokens, do_sample=False,
                pad_token_id=eos[0] if isinstance(eos, list) else eos, **kw)
    if ignore_eos:
      args["min_new_tokens"] = cfg.max_new_tokens
    with torch.inference_mode():
      out = model.generate(x, **args)
    return out[0, x.shape[1]:].tolist()

  rows = []
  variants = (("hf_greedy", {}),
              ("hf_prompt_lookup", {"prompt_lookup_num_tokens": cfg.num_speculative_tokens}))
  for name, kw in variants:
    generate(requests[0].prompt_token_ids[:16], **kw)  # warm-up (kernels, allocator)
    outs, total_s = [], 0.0
    for r in requests:
      if device == "cuda":
        torch.cuda.synchronize()
      t0 = time.perf_counter()
      outs.append(generate(r.prompt_token_ids, **kw))
      if device == "cuda":
        torch.cuda.synchronize()
      total_s += time.perf_counter() - t0
    new_tokens = sum(len(o) for o in outs)
    exact, prefix = _agreement([ref.get(r.request_id, []) for r in requests], outs)
    rows.append({"peer": name, "device": device, "dtype": cfg.dtype, "batch_size": 1,
                 "num_requests": len(requests), "num_output_tokens": new_tokens,
                 "tokens_per_s": new_tokens / total_s if total_s else float("nan"),
                 "exact_match_vs_specjax_ar": exact, "prefix_agreement_vs_specjax_ar": prefix,
                 "transformers_version": transformers.__version__,
                 "torch_version": torch.__version__})
  return pd.DataFrame(rows)
