"""End-to-end evaluation on tiny random models with a stub tokenizer (no real weights)."""

import json
import types
import zlib

import jax
import pandas as pd
import pytest
from absl import flags
from absl.testing import flagsaver

from harness import evaluation
from harness.build import build_method, method_base
from harness.evaluation import EvalConfig, first_divergence, run_evaluation
from models import testing

VOCAB = 96


class StubTokenizer:
  """Words -> ids by crc32 (ids 3..V-1), at most 12 words; ChatML-like template.

  Ids: 1 = BOS, 2 = EOS (the tiny config's), 0 never produced by ``encode``.
  """

  chat_template = "stub"
  eos_token_ids = (2,)

  def encode(self, text, add_special_tokens=True):
    words = text.replace("<", " <").split()[:12]
    ids = [zlib.crc32(w.encode()) % (VOCAB - 3) + 3 for w in words]
    return ([1] if add_special_tokens else []) + ids

  def decode(self, ids):
    return " ".join(f"t{i}" for i in ids)

  def apply_chat_template(self, messages, add_generation_prompt=True):
    return "<bos> " + " ".join(m["content"] for m in messages) + " <assistant>"


@pytest.fixture
def tiny_models(monkeypatch):
  cfg = testing.tiny_config("llama", vocab_size=VOCAB)
  models = {
      "tiny-target": testing.random_model(cfg, seed=0),
      # The target's own weights: every greedy draft is accepted (tau = k + 1 when it fits).
      "tiny-draft": testing.random_model(cfg, seed=0),
      "tiny-other-vocab": testing.random_model(cfg.replace(vocab_size=VOCAB + 8), seed=2),
  }
  loaded = []

  def load(name, dtype):
    assert dtype == "float32"
    loaded.append(name)
    if name not in models:
      raise ValueError(f"name={name!r} is not a test model")
    m = models[name]
    return types.SimpleNamespace(name=name, config=m.cfg, model=m, tokenizer=StubTokenizer())

  monkeypatch.setattr(evaluation, "load_model", load)
  return loaded


def test_end_to_end_greedy_lossless(tiny_models, tmp_path, capsys):
  cfg = EvalConfig(
      target="tiny-target", draft="tiny-draft", methods=("ngram", "draft_model"),
      method_options={"ngram": {"n_min": 1}}, dataset="spec_bench", num_prompts=6, batch_sizes=(1, 3), num_speculative_tokens=3,
      max_new_tokens=10, page_size=8, output_dir=str(tmp_path),
  )
  with jax.default_matmul_precision("highest"):
    df = run_evaluation(cfg, progress=False)
  assert cfg.methods == ("ar", "ngram", "draft_model")
  assert tiny_models == ["tiny-target", "tiny-draft"]
  assert len(df) == 3 * 2
  expected = {
      "model", "draft", "method", "method_config", "k", "batch_size", "repeat", "dataset",
      "num_prompts", "temperature", "device", "backend", "attention_implementation",
      "jax_version", "tau", "acceptance_rate", "accept_rate_pos1", "accept_rate_pos3", "c",
      "share_matched", "S_pred", "measured_speedup", "tokens_per_s", "ttft_p50_s",
      "ttft_p95_s", "tpot_p50_s", "tpot_p95_s", "draft_ms", "verify_ms", "rejection_ms",
      "host_ms", "num_compiles", "compile_s", "lossless", "num_mismatched", "first_divergence",
  }
  assert expected <= set(df.columns)
  sd = df[df.method != "ar"]
  assert sd.lossless.tolist() == [True] * 4
  assert (sd.num_mismatched == 0).all()
  # The warm-up pass compiled every bucket: the measured passes compile nothing.
  # Ragged verify widths (1, 2, 4 for k = 4) that the short warm-up did not reach compile
  # inside the measured pass; those steps are flagged and left out of the timings.
  assert df.num_compiles.sum() <= 2, df.num_compiles.tolist()
  assert (df.S_pred - df.tau / df.c).abs().max() < 1e-9
  ar = df[df.method == "ar"]
  assert (ar.tau == 1.0).all() and (ar.k == 0).all() and ar.lossless.isna().all()
  assert (df[df.method == "draft_model"].tau > 1.0).all()
  assert set(df[df.method == "draft_model"].draft) == {"tiny-draft"}
  assert df[df.method == "ngram"].draft.isna().all()
  ngram_config = json.loads(df[df.method == "ngram"].method_config.iloc[0])
  assert ngram_config["k"] == 3 and ngram_config["n_min"] == 1

  written = pd.read_csv(tmp_path / "results.csv")
  assert len(written) == len(df)
  records = [json.loads(x) for x in (tmp_path / "outputs.jsonl").read_text().splitlines()]
  assert len(records) == 3 * 2 * 6
  assert {"request_id", "category", "output_token_ids", "text"} <= set(records[0])
  assert json.loads((tmp_path / "config.json").read_text())["num_prompts"] == 6
  printed = capsys.readouterr().out
  for header in ("method", "batch", "tau", "accept_rate", "c", "S_pred", "measured_speedup",
                 "tokens/s", "lossless"):
    assert header in printed


def test_method_by_method_rows_against_one_ar_pass(tiny_models, tmp_path, monkeypatch):
  """``method_by_method``: per batch size each method's warm-up and repeats in turn (AR
  first), its rows against AR's pass of the same repeat: the same tau and outputs as every
  method in each repeat, and the rows so far written after every measured pass."""
  base = dict(target="tiny-target", draft="tiny-draft", methods=("ngram", "draft_model"),
              num_prompts=3, batch_sizes=(1, 2), num_speculative_tokens=3, max_new_tokens=8,
              page_size=8, repeats=2, plots=False)
  written = []
  write = evaluation._write
  monkeypatch.setattr(evaluation, "_write", lambda cfg, df, *args, **kwargs: (
      written.append(df.method.tolist()), write(cfg, df, *args, **kwargs)))
  with jax.default_matmul_precision("highest"):
    ref = run_evaluation(EvalConfig(**base), progress=False, verbose=False)
    df = run_evaluation(EvalConfig(**base, method_by_method=True, output_dir=str(tmp_path)),
                        progress=False, verbose=False)
  assert list(zip(df.method, df.batch_size, df.repeat)) == [
      (m, b, r) for b in (1, 2) for m in ("ar", "ngram", "draft_model") for r in (0, 1)]
  key = ["method", "batch_size", "repeat"]
  both = df.merge(ref, on=key, suffixes=("", "_ref"))
  assert len(both) == len(df) == len(ref)
  assert (both.tau == both.tau_ref).all()
  assert (both.num_output_tokens == both.num_output_tokens_ref).all()
  assert df[df.method != "ar"].lossless.tolist() == [True] * 8
  assert (df.c > 0).all() and df.c.notna().all()
  assert (df.warmup_s > 0).all()  # each method's own warm-up, on each of its rows
  # one write per measured pass (3 methods x 2 repeats x 2 batch sizes), then the last
  assert len(written) == 13 and written[0] == ["ar"] and written[2] == ["ar", "ar", "ngram"]
  assert len(pd.read_csv(tmp_path / "results.csv")) == len(df)
  with pytest.raises(ValueError, match="method_by_method"):
    EvalConfig(method_by_method=True, device_profile=True)


def test_sampling_online_repeats(tiny_models):
  cfg = EvalConfig(
      target="tiny-target", methods=("ngram",), dataset="gsm8k", num_prompts=3,
      batch_sizes=(3,), max_new_tokens=6, temperature=0.8, repeats=2, page_size=8,
      request_rate=200.0, warmup=False, matmul_precision="highest",
  )
  df = run_evaluation(cfg, progress=False, verbose=False)
  assert (df.matmul_precision == "highest").all()
  assert len(df) == 2 * 2 and sorted(set(df.repeat)) == [0, 1]
  assert df.lossless.isna().all()  # no token-for-token check when sampling
  assert (df.request_rate == 200.0).all()


def test_bad_values_raise_before_loading(tiny_models):
  with pytest.raises(ValueError, match=r"methods \['nope'\] are unknown; known methods"):
    EvalConfig(target="tiny-target", methods=("nope",))
  with pytest.raises(ValueError, match=r"\['draft_model'\] need a draft model"):
    run_evaluation(EvalConfig(target="tiny-target", methods=("draft_model",)), progress=False)
  with pytest.raises(ValueError, match="dataset='nope'"):
    run_evaluation(EvalConfig(target="tiny-target", dataset="nope"), progress=False)
  with pytest.raises(ValueError, match="implementation"):
    run_evaluation(EvalConfig(target="tiny-target", attention_implementation="nope"),
                   progress=False)
  assert tiny_models == []
  with pytest.raises(ValueError, match="batch_sizes"):
    EvalConfig(batch_sizes=(0,))
  with pytest.raises(ValueError, match="temperature=-1"):
    EvalConfig(temperature=-1.0)
  with pytest.raises(ValueError, match="request_rate=0"):
    EvalConfig(request_rate=0.0)
  with pytest.raises(ValueError, match="matmul_precision='exact'"):
    EvalConfig(matmul_precision="exact")
  with pytest.raises(ValueError, match=r"names methods \['eagle'\] that are not in"):
    EvalConfig(methods=("ngram",), method_options={"eagle": {"head_path": "x"}})
  with pytest.raises(ValueError, match="verify_implementation=cuda must be 'auto', None"):
    EvalConfig(verify_implementation="cuda")
  if jax.default_backend() != "gpu":
    with pytest.raises(ValueError, match="pallas_triton needs a GPU"):
      EvalConfig(verify_implementation="pallas_triton")
  if jax.default_backend() == "cpu":
    with pytest.raises(ValueError, match="device_profile=True needs a GPU or TPU backend"):
      run_evaluation(EvalConfig(target="tiny-target", device_profile=True), progress=False)
  with pytest.raises(ValueError,
                     match=r"not all options.*its options: \['device', 'n_max', 'n_min'\]"):
    run_evaluation(EvalConfig(target="tiny-target", method_options={"ngram": {"nope": 1}}),
                   progress=False)


def test_bad_models_and_lengths(tiny_models):
  with pytest.raises(ValueError, match="vocab_size"):
    run_evaluation(EvalConfig(target="tiny-target", draft="tiny-other-vocab",
                              methods=("draft_model",)), progress=False)
  with pytest.raises(ValueError, match="max_model_len=8 must be larger"):
    run_evaluation(EvalConfig(target="tiny-target", num_prompts=2, max_model_len=8),
                   progress=False)
  with pytest.raises(ValueError, match="max_model_len=512 must be <= the target's context"):
    run_evaluation(EvalConfig(target="tiny-target", num_prompts=2, max_model_len=512),
                   progress=False)
  with pytest.raises(ValueError, match="more than the target's context"):  # tiny config: 256 positions
    run_evaluation(EvalConfig(target="tiny-target", num_prompts=2, max_new_tokens=250),
                   progress=False)
  with pytest.raises(ValueError, match="'missing' is not a test model"):
    run_evaluation(EvalConfig(target="missing"), progress=False)


def test_first_divergence():
  assert first_divergence([5, 6, 7], [5, 6, 7]) is None
  assert first_divergence([5, 6, 7], [5, 6, 9, 1]) == 2
  assert first_divergence([5, 6], [5, 6, 7]) == 2


def test_binary_flags_to_config():
  from experiments import evaluate

  with flagsaver.flagsaver():
    flags.FLAGS.unparse_flags()
    flags.FLAGS(["evaluate", "--methods=ngram,draft_model", "--draft=none",
                 "--batch_sizes=1,2", "--output_dir=/tmp/x", "--categories=qa,rag",
                 "--matmul_precision=highest", "--method_option=ngram.n_max=3",
                 "--method_option=draft_model.note=[1, 2]"])
    cfg = evaluate.config_from_flags()
  assert cfg.methods == ("ar", "ngram", "draft_model")
  assert cfg.draft is None and cfg.batch_sizes == (1, 2)
  assert cfg.categories == ("qa", "rag") and cfg.output_dir == "/tmp/x"
  assert cfg.target == "smollm2-135m" and cfg.num_prompts == 24 and cfg.max_new_tokens == 128
  assert cfg.temperature == 0 and cfg.request_rate is None
  assert cfg.repeats == (3 if jax.default_backend() == "gpu" else 2)
  assert cfg.matmul_precision == "highest" and cfg.warmup
  assert cfg.method_options == {"ngram": {"n_max": 3}, "draft_model": {"note": (1, 2)}}
  assert cfg.verify_implementation == "auto"
  with pytest.raises(ValueError, match="METHOD.OPTION=VALUE"):
    evaluate.parse_method_options(["n_max=3"])
  to_cfg = evaluate._verify_implementation
  assert to_cfg(["jnp"]) is None and to_cfg(["auto"]) == "auto"
  assert to_cfg(["pallas_triton", "reference"]) == ("pallas_triton", "reference")
  for bad in ([], ["auto", "reference"], ["jnp", "reference"]):
    with pytest.raises(ValueError, match="must be 'auto', 'jnp', or"):
      to_cfg(bad)


@pytest.mark.realmodel
def test_real_smollm2_ngram_lossless():
  cfg = EvalConfig(target="smollm2-135m", methods=("ngram",), categories=("qa", "translation"),
                   num_prompts=2, batch_sizes=(2,), max_new_tokens=16, warmup=False)
  df = run_evaluation(cfg, progress=False, verbose=False)
  ngram = df[df.method == "ngram"].iloc[0]
  assert ngram.lossless and ngram.tau >= 1.0
  assert (df.num_output_tokens > 0).all()


def test_labelled_method_variants_share_one_ar_run(tiny_models):
  """``NAME@LABEL`` methods: configurations of one method side by side, each with its
  own options and rows, against one AR run."""
  cfg = EvalConfig(target="tiny-target", methods=("ngram@n1", "ngram@n3"),
                   method_options={"ngram@n1": {"n_min": 1, "n_max": 1, "k": 2},
                                   "ngram@n3": {"n_min": 3, "n_max": 3}},
                   num_prompts=3, batch_sizes=(1,), num_speculative_tokens=3,
                   max_new_tokens=8, repeats=1, warmup=False, plots=False)
  with jax.default_matmul_precision("highest"):
    df = run_evaluation(cfg, progress=False, verbose=False)
  assert df.method.tolist() == ["ar", "ngram@n1", "ngram@n3"]
  configs = {m: json.loads(c) for m, c in zip(df.method, df.method_config)}
  assert configs["ngram@n1"]["n_max"] == 1 and configs["ngram@n3"]["n_max"] == 3
  assert configs["ngram@n1"]["k"] == 2 and configs["ngram@n3"]["k"] == 3  # per-method k
  assert df[df.method != "ar"].lossless.tolist() == [True, True]
  assert method_base("ngram@n1") == "ngram"
  for bad, match in (("ngram@", "non-empty LABEL"), ("ar@x", "'ar' takes none"),
                     ("ngram@a.b", "without '.'"), ("nope@x", "unknown")):
    with pytest.raises(ValueError, match=match):
      EvalConfig(target="tiny-target", methods=(bad,))
  with pytest.raises(ValueError, match="k='2' must be an int"):
    build_method("ngram@s", 3, {"k": "2"})


def test_device_profile_sets_device_columns_and_ops(monkeypatch, tmp_path):
  """The profiled pass's arithmetic: device busy time less the prefill wall time per
  engine step, c_device against AR's, one ops CSV per method (the trace parsing itself
  is ``harness.device_time``'s; CPU traces have no device track)."""
  busy = iter([0.9, 0.7])  # seconds: ar, then ngram
  monkeypatch.setattr(evaluation, "device_busy_seconds", lambda d: next(busy))
  monkeypatch.setattr(evaluation, "ops_table", lambda d, steps: [dict(
      op="fusion", ms_per_step=0.1, calls_per_step=2, hlo_module="jit_step",
      hlo_op="fusion.3")])

  class FakeEngine:
    def __init__(self, steps):
      self.runtime = types.SimpleNamespace(method_cache={"x": 1})
      self.config = types.SimpleNamespace(acceptance_replay=False)
      self.steps = steps

    def generate(self, requests, progress=None):
      return [], types.SimpleNamespace(steps=[None] * self.steps, prefill_s=0.1)

  engines = {"ar": FakeEngine(100), "ngram": FakeEngine(50)}
  rows = [{"method": m, "batch_size": b} for m in ("ar", "ngram") for b in (1, 4)]
  evaluation._device_profile(engines, [], rows, 1, str(tmp_path), None)
  assert rows[0]["device_ms"] == pytest.approx(8.0)  # (0.9 - 0.1) s / 100 steps
  assert rows[0]["c_device"] == pytest.approx(1.0)
  assert rows[2]["device_ms"] == pytest.approx(12.0)  # (0.7 - 0.1) s / 50 steps
  assert rows[2]["c_device"] == pytest.approx(1.5)
  assert "device_ms" not in rows[1]  # batch 4 was not profiled here
  assert engines["ngram"].runtime.method_cache == {}
  ops = pd.read_csv(tmp_path / "ops_ngram_b1.csv")
  assert ops.to_dict("records") == [{"op": "fusion", "ms_per_step": 0.1, "calls_per_step": 2,
                                     "hlo_module": "jit_step", "hlo_op": "fusion.3"}]
