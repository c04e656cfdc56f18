"""GGUF -> HF round trips: tiny checkpoints written as llama.cpp writes them."""

import gguf
import numpy as np
import pytest
from gguf_helpers import random_hf_checkpoint, tiny_hf_config, write_gguf

from models.loaders.gguf import read_gguf, read_gguf_metadata

TOKENS = [f"<t{i}>" for i in range(64)]
TOKENS[0], TOKENS[1], TOKENS[2] = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
TYPES = [3, 3, 3] + [1] * 61


def _write(path, cfg, tensors, **kw):
  kw = {"tokens": TOKENS, "token_types": TYPES, "merges": [], "eos": 2, **kw}
  write_gguf(path, cfg, tensors, **kw)


@pytest.mark.parametrize(
    "model_type,tied",
    [("llama", False), ("llama", True), ("qwen2", False), ("qwen2", True), ("qwen3", False),
     ("gemma3_text", True)],
)
def test_round_trip(tmp_path, model_type, tied):
  cfg = tiny_hf_config(model_type, tied=tied)
  tensors = random_hf_checkpoint(cfg)
  path = tmp_path / "m.gguf"
  _write(path, cfg, tensors)
  ckpt = read_gguf(path)
  assert set(ckpt.tensors) == set(tensors)
  for name, want in tensors.items():
    got = ckpt.tensors[name]
    assert got.dtype == np.float32 and got.shape == want.shape, name
    # Gemma norms go through +1 then -1 in f32: equal to rounding.
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6, err_msg=name)
  hf = ckpt.hf_config
  assert hf["model_type"] == model_type
  for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim",
              "max_position_embeddings", "tie_word_embeddings"):
    assert hf[key] == cfg[key], key
  assert hf["rope_theta"] == cfg["rope_theta"]
  assert hf["rms_norm_eps"] == pytest.approx(cfg["rms_norm_eps"])
  assert hf["eos_token_id"] == [2, 0]  # <|im_end|> (file EOS), then <|endoftext|>
  if model_type == "gemma3_text":
    assert hf["sliding_window"] == 16
    assert hf["rope_local_base_freq"] == 10000.0
    assert hf["query_pre_attn_scalar"] == 8
    assert hf["layer_types"] == ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]
  assert ckpt.tokenizer_metadata["tokenizer.ggml.tokens"] == TOKENS
  assert ckpt.metadata["general.architecture"] == {"gemma3_text": "gemma3"}.get(model_type,
                                                                                model_type)


def test_llama_unpermute_is_needed(tmp_path):
  """The stored q rows are llama.cpp's interleaved order; read_gguf restores HF order."""
  cfg = tiny_hf_config("llama")
  tensors = random_hf_checkpoint(cfg)
  path = tmp_path / "m.gguf"
  _write(path, cfg, tensors)
  reader = gguf.GGUFReader(str(path))
  stored = {t.name: np.asarray(t.data) for t in reader.tensors}["blk.0.attn_q.weight"]
  want = tensors["model.layers.0.self_attn.q_proj.weight"]
  assert not np.array_equal(stored, want)
  # Head 0, H = 8: stored rows are [x0, y0, x1, y1, ...] of HF's [x0..x3, y0..y3].
  np.testing.assert_array_equal(stored[0], want[0])
  np.testing.assert_array_equal(stored[1], want[4])
  np.testing.assert_array_equal(read_gguf(path).tensors["model.layers.0.self_attn.q_proj.weight"],
                                want)


def test_quantized_tensors_dequantize(tmp_path):
  cfg = tiny_hf_config("qwen2")
  tensors = random_hf_checkpoint(cfg)
  path = tmp_path / "q.gguf"
  _write(path, cfg, tensors, quantize=gguf.GGMLQuantizationType.Q8_0)
  ckpt = read_gguf(path)
  w = tensors["model.layers.1.mlp.up_proj.weight"]
  want = gguf.quants.dequantize(gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0),
                                gguf.GGMLQuantizationType.Q8_0)
  got = ckpt.tensors["model.layers.1.mlp.up_proj.weight"]
  np.testing.assert_array_equal(got, want)
  assert np.abs(got - w).max() < 0.05
  assert not np.array_equal(got, w)  # really quantized
  np.testing.assert_array_equal(ckpt.tensors["model.norm.weight"], tensors["model.norm.weight"])


def test_metadata_parser_matches_gguf_reader(tmp_path):
  path = tmp_path / "kv.gguf"
  w = gguf.GGUFWriter(str(path), arch="llama")
  w.add_uint8("t.u8", 7)
  w.add_int8("t.i8", -7)
  w.add_uint16("t.u16", 700)
  w.add_int16("t.i16", -700)
  w.add_uint32("t.u32", 70000)
  w.add_int32("t.i32", -70000)
  w.add_uint64("t.u64", 2**40)
  w.add_int64("t.i64", -(2**40))
  w.add_float32("t.f32", 0.5)
  w.add_float64("t.f64", 0.25)
  w.add_bool("t.bool", True)
  w.add_string("t.str", "héllo ▁ world")
  w.add_array("t.arr_i", [1, 2, 3])
  w.add_array("t.arr_f", [0.5, 1.5])
  w.add_array("t.arr_s", ["a", "b c", ""])
  w.add_tensor("x", np.arange(6, dtype=np.float32).reshape(2, 3))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  ours = read_gguf_metadata(path)
  theirs = gguf.GGUFReader(str(path)).fields
  for key, field in theirs.items():
    if key.startswith("GGUF."):
      continue
    want = field.contents()
    got = ours[key]
    if isinstance(got, np.ndarray):
      got = got.tolist()
    assert got == pytest.approx(want) if isinstance(want, float) else got == want, key
  assert set(ours) == {k for k in theirs if not k.startswith("GGUF.")}


def test_errors(tmp_path):
  garbage = tmp_path / "garbage.gguf"
  garbage.write_bytes(b"not a gguf file at all" * 10)
  with pytest.raises(ValueError, match="not a GGUF file"):
    read_gguf(garbage)

  cfg = tiny_hf_config("llama")
  good = tmp_path / "good.gguf"
  _write(good, cfg, random_hf_checkpoint(cfg))
  data = good.read_bytes()
  cut = tmp_path / "cut.gguf"
  cut.write_bytes(data[: len(data) - 100])
  with pytest.raises(ValueError, match="truncated or corrupt"):
    read_gguf(cut)
  cut.write_bytes(data[:200])
  with pytest.raises(ValueError, match="corrupt GGUF header"):
    read_gguf(cut)

  other = tmp_path / "other.gguf"
  _write(other, cfg, {}, arch="falcon")
  with pytest.raises(ValueError, match="'falcon' is not supported"):
    read_gguf(other)

  tensors = random_hf_checkpoint(cfg)
  tensors["model.layers.0.mlp.up_proj.weight"] = np.zeros((48, 16), np.float32)
  bad = tmp_path / "bad_shape.gguf"
  _write(bad, cfg, tensors)
  with pytest.raises(ValueError, match="up_proj.weight.*expected"):
    read_gguf(bad)

  tensors = random_hf_checkpoint(cfg)
  del tensors["model.layers.2.mlp.down_proj.weight"]
  missing = tmp_path / "missing.gguf"
  _write(missing, cfg, tensors)
  with pytest.raises(ValueError, match="missing 1 tensors"):
    read_gguf(missing)
