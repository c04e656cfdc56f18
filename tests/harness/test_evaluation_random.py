"""Evaluation of a random-weight target (``random:tiny``) on random token-id prompts.

The model is the real ``models.zoo`` load (no test replacement): no tokenizer, no EOS,
no chat template; outputs are compared to AR's as ids and run to ``max_new_tokens``.
"""

import json
import types

import pytest
from absl import flags
from absl.testing import flagsaver

from experiments import evaluate
from harness import evaluation
from harness.evaluation import EvalConfig, run_evaluation
from models import testing


def test_random_tiny_end_to_end(tmp_path):
  # The command line of the brief, through the binary's flags.
  with flagsaver.flagsaver():
    flags.FLAGS.unparse_flags()
    flags.FLAGS(["evaluate", "--target=random:tiny", "--dataset=random", "--input_len=64",
                 "--methods=ar,ngram", "--num_prompts=2", "--batch_sizes=1",
                 "--max_new_tokens=8", "--repeats=1", f"--output_dir={tmp_path}"])
    cfg = evaluate.config_from_flags()
  assert cfg.dataset == "random" and cfg.input_len == 64 and cfg.ignore_eos is None
  df = run_evaluation(cfg, progress=False, verbose=False)
  assert list(df.method) == ["ar", "ngram"]
  assert df.ignore_eos.all() and (df.input_len == 64).all() and (df.model == "random:tiny").all()
  assert df.set_index("method").lossless["ngram"]  # outputs compared as ids
  records = [json.loads(x) for x in (tmp_path / "outputs.jsonl").read_text().splitlines()]
  assert len(records) == 2 * 2
  for r in records:
    assert r["prompt_tokens"] == 64 and all(0 <= t < 512 for t in r["prompt_token_ids"])
    assert len(r["output_token_ids"]) == 8 and r["finish_reason"] == "length"
    assert r["text"] is None
  ids = {r["request_id"]: r["prompt_token_ids"] for r in records}
  assert sorted(ids) == ["random/0", "random/1"] and ids["random/0"] != ids["random/1"]


def test_random_config_errors():
  with pytest.raises(ValueError, match=r"target='random:tiny' has random weights and no "
                                       r"tokenizer: dataset='spec_bench' must be 'random'"):
    EvalConfig(target="random:tiny")
  with pytest.raises(ValueError, match="input_len=None must be >= 1 with dataset='random'"):
    EvalConfig(target="random:tiny", dataset="random")
  with pytest.raises(ValueError, match="input_len=0 must be >= 1"):
    EvalConfig(target="random:tiny", dataset="random", input_len=0)
  with pytest.raises(ValueError, match="input_len=8 is only for dataset='random'"):
    EvalConfig(dataset="gsm8k", input_len=8)
  with pytest.raises(ValueError, match=r"categories=\('qa',\) must be None with dataset"):
    EvalConfig(dataset="random", input_len=8, categories=("qa",))


def test_text_dataset_needs_a_tokenizer(monkeypatch):
  model = testing.random_model(testing.tiny_config("llama"), seed=0)
  monkeypatch.setattr(evaluation, "load_model", lambda name, dtype: types.SimpleNamespace(
      name=name, config=model.cfg, model=model, tokenizer=None))
  with pytest.raises(ValueError, match=r"target='no-tok' has no tokenizer: dataset='gsm8k' "
                                       r"must be 'random'"):
    run_evaluation(EvalConfig(target="no-tok", dataset="gsm8k", num_prompts=1),
                   progress=False, verbose=False)


def test_cpu_executables_are_dropped_between_batch_sizes(monkeypatch):
  """On CPU the evaluation drops compiled executables after each batch size (they count
  against vm.max_map_count), and the next batch size's measured pass still compiles
  nothing (its warm-up compiled it again)."""
  import jax  # noqa: PLC0415

  calls = []
  real = jax.clear_caches
  monkeypatch.setattr(evaluation.jax, "clear_caches", lambda: calls.append(1) or real())
  cfg = EvalConfig(target="random:tiny", dataset="random", input_len=16, methods=("ar", "ngram"),
                   num_prompts=2, batch_sizes=(1, 2), max_new_tokens=6, repeats=1)
  df = run_evaluation(cfg, progress=False, verbose=False)
  assert len(calls) == 2  # after batch 1 and after batch 2
  assert (df.num_compiles == 0).all() and df.lossless.dropna().all()


def test_host_called_jitted_drafter_compiles_nothing_in_the_measured_pass():
  """A method whose ``propose`` calls its own jitted functions (LayerSkip: runs_on
  "device") warms up on the whole workload, so its measured pass compiles nothing and
  keeps every request in the latencies; the capped warm-up of the shortest prompts left
  its prefill-chunk and row-count shapes to the measured pass."""
  cfg = EvalConfig(target="random:tiny", dataset="random", input_len=40,
                   methods=("ar", "layerskip"), num_prompts=3, batch_sizes=(2,),
                   max_new_tokens=12, repeats=1,
                   method_options={"layerskip": {"exit_layer": 1}})
  df = run_evaluation(cfg, progress=False, verbose=False).set_index("method")
  assert df.num_compiles["layerskip"] == 0 and df.lossless["layerskip"]
