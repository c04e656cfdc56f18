"""Tokenizers rebuilt from GGUF metadata match the tokenizers they were written from."""

import io
import json

import numpy as np
import pytest
from gguf_helpers import chatml_template, write_gguf
from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from models.loaders.gguf import read_gguf_metadata
from models.loaders.tokenizer import Tokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "In 2024, 1234567 people counted to 99 and back.",
    "Speculative decoding drafts tokens and verifies them in one pass.",
    "def f(x):\n    return x * 2  # double it\n\n",
    "Ünïcödé façade — naïve café, 日本語のテキスト, emoji 🙂🚀.",
    "  leading spaces\ttabs\r\nand CRLF lines  ",
    "She's here; they'll go; we've done; I'm fine; you'd see.",
] * 4
TEXTS = [
    "Hello world!",
    "The year 2024 was 12345 days long?",
    "  spaces   and\n\nnewlines\t\ttabs ",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "Ünïcödé 日本語 🙂 unseen: Ωμέγα ☃",
    "",
    "x",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
               r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _train_bpe(pre: str) -> HFTokenizer:
  ref = HFTokenizer(models.BPE())
  if pre == "smollm":
    ref.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
  else:
    ref.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
  ref.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=SPECIALS, show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  ref.train_from_iterator(CORPUS, trainer)
  return ref


def _bpe_gguf(tmp_path, ref: HFTokenizer, pre: str, chat_template: str | None = None):
  model = json.loads(ref.to_str())["model"]
  vocab = model["vocab"]
  tokens = [None] * len(vocab)
  for t, i in vocab.items():
    tokens[i] = t
  merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
  types = [3 if t in SPECIALS else 1 for t in tokens]
  path = tmp_path / f"tok-{pre}.gguf"
  write_gguf(path, arch="llama", tokens=tokens, token_types=types, merges=merges,
             tokenizer_model="gpt2", tokenizer_pre=pre, bos=SPECIALS.index("<|im_start|>"),
             eos=SPECIALS.index("<|endoftext|>"), add_bos=False, chat_template=chat_template)
  return path


@pytest.mark.parametrize("pre", ["smollm", "qwen2"])
def test_bpe_matches_reference(tmp_path, pre):
  ref = _train_bpe(pre)
  path = _bpe_gguf(tmp_path, ref, pre, chat_template=chatml_template())
  tok = Tokenizer.from_gguf_metadata(read_gguf_metadata(path))
  assert tok.vocab_size == ref.get_vocab_size()
  assert tok.bos_token_id == 1 and not tok.add_bos
  assert tok.eos_token_ids == (0, 2)  # file EOS <|endoftext|>, then <|im_end|>
  for text in TEXTS + CORPUS[:7]:
    ids = tok.encode(text)
    assert ids == ref.encode(text).ids, text
    assert tok.decode(ids) == text
  ids = tok.encode("<|im_start|>hi<|im_end|>")
  assert ids[0] == 1 and ids[-1] == 2
  assert tok.decode(ids, skip_special_tokens=True) == "hi"
  assert len(tok.encode("2024")) == 4  # both pre-tokenizers split digits one by one


def test_chat_template(tmp_path):
  ref = _train_bpe("smollm")
  tok = Tokenizer.from_gguf_metadata(read_gguf_metadata(
      _bpe_gguf(tmp_path, ref, "smollm", chat_template=chatml_template())))
  messages = [{"role": "system", "content": "Be brief."},
              {"role": "user", "content": "What is the capital of France?"}]
  text = tok.apply_chat_template(messages)
  assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is the "
                  "capital of France?<|im_end|>\n<|im_start|>assistant\n")
  assert tok.apply_chat_template(messages, add_generation_prompt=False).endswith("<|im_end|>\n")
  assert tok.encode(text, add_special_tokens=False).count(1) == 3  # <|im_start|> x3
  with pytest.raises(ValueError, match="must be a mapping"):
    tok.apply_chat_template(["hi"])

  plain = Tokenizer.from_gguf_metadata(read_gguf_metadata(_bpe_gguf(tmp_path, ref, "smollm")))
  with pytest.raises(ValueError, match="no chat template"):
    plain.apply_chat_template(messages)


def test_chat_template_raise_exception(tmp_path):
  ref = _train_bpe("smollm")
  template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
  tok = Tokenizer.from_gguf_metadata(read_gguf_metadata(
      _bpe_gguf(tmp_path, ref, "smollm", chat_template=template)))
  with pytest.raises(ValueError, match="user first"):
    tok.apply_chat_template([{"role": "assistant", "content": "x"}])


def _train_sentencepiece():
  import sentencepiece as spm

  buf = io.BytesIO()
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(CORPUS), model_writer=buf, model_type="bpe", vocab_size=400,
      hard_vocab_limit=False, byte_fallback=True, normalization_rule_name="identity",
      add_dummy_prefix=False, remove_extra_whitespaces=False, split_digits=True,
      allow_whitespace_only_pieces=True, pad_id=0, eos_id=1, bos_id=2, unk_id=3,
      control_symbols=["<start_of_turn>", "<end_of_turn>"], user_defined_symbols=["▁▁"],
      minloglevel=2,
  )
  return buf.getvalue()


def test_sentencepiece_matches_reference(tmp_path):
  import sentencepiece as spm
  from sentencepiece import sentencepiece_model_pb2 as pb

  proto_bytes = _train_sentencepiece()
  ref = spm.SentencePieceProcessor(model_proto=proto_bytes)
  proto = pb.ModelProto()
  proto.ParseFromString(proto_bytes)
  # As llama.cpp writes Gemma 3: <unk> typed CONTROL, user-defined pieces with ' '.
  tokens = [p.piece.replace("▁", " ") if p.type == 4 else p.piece for p in proto.pieces]
  types = [3 if p.type == 2 else p.type for p in proto.pieces]
  scores = [p.score for p in proto.pieces]
  path = tmp_path / "sp.gguf"
  write_gguf(path, arch="gemma3", tokens=tokens, token_types=types, scores=scores,
             tokenizer_model="llama", tokenizer_pre="default", bos=2, eos=1, unk=3,
             add_bos=True)
  tok = Tokenizer.from_gguf_metadata(read_gguf_metadata(path))
  assert tok.vocab_size == ref.get_piece_size()
  sot, eot = ref.piece_to_id("<start_of_turn>"), ref.piece_to_id("<end_of_turn>")
  assert tok.eos_token_ids == (1, eot)
  for text in TEXTS[:3] + TEXTS[4:] + CORPUS[:7]:
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == ref.encode(text), text
    assert tok.encode(text) == [2, *ids]
    assert tok.decode(ids) == text
  assert any(i >= 4 and ref.id_to_piece(i).startswith("<0x") for i in tok.encode("☃"))
  ids = tok.encode("<start_of_turn>user\nhi<end_of_turn>", add_special_tokens=False)
  assert ids == [sot, *ref.encode("user\nhi"), eot]
  assert tok.decode(ids) == "<start_of_turn>user\nhi<end_of_turn>"
  assert tok.decode(ids, skip_special_tokens=True) == "user\nhi"


def test_from_hf_directory(tmp_path):
  ref = _train_bpe("qwen2")
  ref.save(str(tmp_path / "tokenizer.json"))
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({
      "chat_template": chatml_template(), "eos_token": "<|im_end|>", "bos_token": None}))
  (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
  tok = Tokenizer.from_hf(tmp_path)
  assert tok.eos_token_ids == (2, 0)
  assert tok.bos_token_id is None
  for text in TEXTS:
    assert tok.encode(text) == ref.encode(text).ids
  assert tok.apply_chat_template([{"role": "user", "content": "x"}]).startswith("<|im_start|>user")
  with pytest.raises(ValueError, match="tokenizer.json"):
    Tokenizer.from_hf(tmp_path / "nowhere")


def test_errors(tmp_path):
  path = tmp_path / "bad.gguf"
  write_gguf(path, arch="llama", tokens=["a", "b"], tokenizer_model="rwkv", tokenizer_pre=None)
  with pytest.raises(ValueError, match="tokenizer.ggml.model='rwkv'"):
    Tokenizer.from_gguf_metadata(read_gguf_metadata(path))
  write_gguf(path, arch="llama", tokens=["a", "b"], merges=["a b"], tokenizer_pre="mystery")
  with pytest.raises(ValueError, match="pre='mystery'"):
    Tokenizer.from_gguf_metadata(read_gguf_metadata(path))
  with pytest.raises(ValueError, match="no tokenizer.ggml.tokens"):
    Tokenizer.from_gguf_metadata({})
  assert np.array_equal(read_gguf_metadata(path)["tokenizer.ggml.token_type"], [1, 1])
