"""Tokenizers rebuilt from GGUF metadata or loaded from an HF ``tokenizer.json``.

GGUF files carry their tokenizer as ``tokenizer.ggml.*`` arrays; ``Tokenizer`` rebuilds
it exactly (checked against llama.cpp, see ``shared/models.md``):

- ``tokenizer.ggml.model == "gpt2"``: byte-level BPE from vocab + merges with the
  ``tokenizers`` library. The pre-tokenizer follows ``tokenizer.ggml.pre``: "smollm"
  splits individual digits, then byte-level with its GPT-2 regex; "qwen2" splits with
  the Qwen2 regex (isolated), then byte-level without a regex. Tokens of type CONTROL
  (3) or USER_DEFINED (4) are matched verbatim in the text (HF added tokens; CONTROL
  ones are special).
- ``tokenizer.ggml.model == "llama"`` (Gemma 3): SentencePiece BPE with scores,
  rebuilt as a ``sentencepiece`` ``ModelProto`` (byte fallback, identity normalizer,
  no dummy prefix unless ``tokenizer.ggml.add_space_prefix``, whitespace kept). Control
  tokens written in the text (``<start_of_turn>``) are split off first, as HF does.

``eos_token_ids`` lists every id that ends generation: the file's EOS plus the chat
turn terminators present in the vocabulary (``<|im_end|>``, ``<end_of_turn>``, ...).
Chat templates are rendered with a sandboxed jinja2 environment configured like HF
``transformers`` (``trim_blocks``, ``lstrip_blocks``, ``raise_exception``).
"""

from __future__ import annotations

import datetime
import json
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

__all__ = ["STOP_TOKEN_NAMES", "Tokenizer", "stop_token_ids"]

# Token strings that end a generation when present as control tokens.
STOP_TOKEN_NAMES = ("<|im_end|>", "<|endoftext|>", "<end_of_turn>", "<|eot_id|>",
                    "<|end_of_text|>", "<|eom_id|>", "<eos>")

# GGUF token types (gguf.TokenType); SentencePiece's ModelProto uses the same numbers.
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
                r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}"
                 r"\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_BPE_PRE = ("default", "gpt-2", "gpt2", "smollm", "qwen2", "llama-bpe", "llama3")


def _md(metadata: Mapping[str, Any], key: str, default: Any = None) -> Any:
  return metadata.get("tokenizer.ggml." + key, default)


def _token_types(metadata: Mapping[str, Any], n: int) -> np.ndarray:
  types = _md(metadata, "token_type")
  if types is None:
    return np.full((n,), _NORMAL, np.int32)
  types = np.asarray(types, np.int32)
  if types.shape != (n,):
    raise ValueError(f"tokenizer.ggml.token_type has shape {types.shape}, expected ({n},)")
  return types


def stop_token_ids(metadata: Mapping[str, Any]) -> tuple[int, ...]:
  """Ids that end generation for a GGUF tokenizer (EOS first, then turn terminators).

  Args:
    metadata: GGUF key/values (only ``tokenizer.ggml.*`` are read).

  Returns:
    Distinct ids: ``tokenizer.ggml.eos_token_id`` / ``eot_token_id`` / ``eom_token_id``,
    then every control token named in ``STOP_TOKEN_NAMES`` that the vocabulary has.
  """
  ids: list[int] = []
  for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
    v = _md(metadata, key)
    if v is not None and int(v) not in ids:
      ids.append(int(v))
  tokens = _md(metadata, "tokens")
  if tokens is not None:
    types = _token_types(metadata, len(tokens))
    index = {t: i for i, t in enumerate(tokens) if t in STOP_TOKEN_NAMES}
    for name in STOP_TOKEN_NAMES:
      i = index.get(name)
      if i is not None and types[i] == _CONTROL and i not in ids:
        ids.append(i)
  return tuple(ids)


class _Backend(Protocol):
  def encode(self, text: str, add_special_tokens: bool) -> list[int]: ...
  def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str: ...
  def token_to_id(self, token: str) -> int | None: ...


class _HFBackend:
  """A ``tokenizers.Tokenizer`` (GGUF byte-level BPE or an HF ``tokenizer.json``)."""

  def __init__(self, tok):
    self.tok = tok

  def encode(self, text: str, add_special_tokens: bool) -> list[int]:
    return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

  def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
    return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

  def token_to_id(self, token: str) -> int | None:
    return self.tok.token_to_id(token)


class _SentencePieceBackend:
  """SentencePiece processor plus HF-style splitting of control tokens in the text."""

  def __init__(self, proto: bytes, pieces: Sequence[str], types: np.ndarray):
    import sentencepiece

    self.sp = sentencepiece.SentencePieceProcessor(model_proto=proto)
    self.pieces = list(pieces)
    specials = np.flatnonzero((types == _CONTROL) | (types == _UNKNOWN)).tolist()
    self.special_ids = frozenset(specials)
    self.special_index = {self.pieces[i]: i for i in specials if self.pieces[i]}
    # Longest first so "<end_of_turn>" wins over any shorter special prefix.
    alternatives = sorted(self.special_index, key=len, reverse=True)
    self.special_re = re.compile("|".join(map(re.escape, alternatives))) if alternatives else None

  def encode(self, text: str, add_special_tokens: bool) -> list[int]:
    del add_special_tokens  # BOS is added by ``Tokenizer``
    if self.special_re is None:
      return list(self.sp.encode(text))
    ids: list[int] = []
    pos = 0
    for m in self.special_re.finditer(text):
      if m.start() > pos:
        ids.extend(self.sp.encode(text[pos : m.start()]))
      ids.append(self.special_index[m.group()])
      pos = m.end()
    if pos < len(text):
      ids.extend(self.sp.encode(text[pos:]))
    return ids

  def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
    out: list[str] = []
    run: list[int] = []
    for i in ids:
      i = int(i)
      if i in self.special_ids:
        if run:
          out.append(self.sp.decode(run))
          run = []
        if not skip_special_tokens:
          out.append(self.pieces[i])
      else:
        run.append(i)
    if run:
      out.append(self.sp.decode(run))
    return "".join(out)

  def token_to_id(self, token: str) -> int | None:
    i = self.sp.piece_to_id(token)
    return i if self.sp.id_to_piece(i) == token else None


def _bpe_backend(metadata: Mapping[str, Any]) -> _HFBackend:
  from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
  from tokenizers import Tokenizer as HFTokenizer

  tokens = list(_md(metadata, "tokens"))
  merges = _md(metadata, "merges", [])  # GGUF writers drop an empty array
  pre = _md(metadata, "pre", "default")
  if pre not in _BPE_PRE:
    raise ValueError(f"tokenizer.ggml.pre={pre!r} must be one of {_BPE_PRE}")
  vocab = {t: i for i, t in enumerate(tokens)}
  pairs = []
  for m in merges:
    a, sep, b = m.partition(" ")
    if not sep:
      raise ValueError(f"tokenizer.ggml.merges entry {m!r} must be two tokens separated by ' '")
    pairs.append((a, b))
  tok = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
  if pre == "smollm":
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
  elif pre in ("qwen2", "llama-bpe", "llama3"):
    pattern = _QWEN2_SPLIT if pre == "qwen2" else _LLAMA3_SPLIT
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
  else:
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  tok.decoder = decoders.ByteLevel()
  # Both kinds are matched verbatim in the text; only CONTROL ones are skipped by
  # ``decode(skip_special_tokens=True)`` (HF's special vs. non-special added tokens).
  types = _token_types(metadata, len(tokens))
  tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                  for i in np.flatnonzero(types == _USER_DEFINED).tolist()])
  tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                          for i in np.flatnonzero(types == _CONTROL).tolist()])
  return _HFBackend(tok)


def _sentencepiece_backend(metadata: Mapping[str, Any]) -> _SentencePieceBackend:
  from sentencepiece import sentencepiece_model_pb2 as pb

  tokens = list(_md(metadata, "tokens"))
  n = len(tokens)
  scores = _md(metadata, "scores")
  scores = np.zeros((n,), np.float32) if scores is None else np.asarray(scores, np.float32)
  types = _token_types(metadata, n).copy()
  types[(types < _NORMAL) | (types > _BYTE)] = _NORMAL
  unk = _md(metadata, "unknown_token_id")
  if unk is not None:
    types[int(unk)] = _UNKNOWN
  elif not (types == _UNKNOWN).any():
    raise ValueError("a SentencePiece tokenizer needs tokenizer.ggml.unknown_token_id")
  proto = pb.ModelProto()
  for piece, score, kind in zip(tokens, scores.tolist(), types.tolist()):
    p = proto.pieces.add()
    p.piece = piece.replace(" ", "\u2581") if kind == _USER_DEFINED else piece
    p.score = score
    p.type = kind
  spec = proto.trainer_spec
  spec.model_type = pb.TrainerSpec.BPE
  spec.vocab_size = n
  spec.byte_fallback = bool((types == _BYTE).any())
  spec.unk_id = int(np.flatnonzero(types == _UNKNOWN)[0])
  for field, key in (("bos_id", "bos_token_id"), ("eos_id", "eos_token_id"),
                     ("pad_id", "padding_token_id")):
    v = _md(metadata, key)
    setattr(spec, field, -1 if v is None else int(v))
  norm = proto.normalizer_spec
  norm.name = "identity"
  norm.add_dummy_prefix = bool(_md(metadata, "add_space_prefix", False))
  norm.remove_extra_whitespaces = False
  norm.escape_whitespaces = True
  return _SentencePieceBackend(proto.SerializeToString(), tokens, types)


def _raise_exception(message: str):
  raise ValueError(f"chat template error: {message}")


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                    sort_keys=sort_keys)


def _as_ids(x) -> list[int]:
  if x is None:
    return []
  if isinstance(x, (list, tuple)):
    return [int(i) for i in x]
  return [int(x)]


def _token_content(x) -> str | None:
  """HF ``tokenizer_config.json`` token entry: a string or ``{"content": ...}``."""
  if isinstance(x, Mapping):
    return x.get("content")
  return x


class Tokenizer:
  """Text <-> token ids, stop ids and chat template of one model.

  Build with ``Tokenizer.from_gguf_metadata`` or ``Tokenizer.from_hf``.

  Attributes:
    vocab_size: number of token ids V (the size of the embedding table).
    bos_token_id: the BOS id (or None).
    eos_token_ids: ids that end generation (the EOS and turn terminators).
    chat_template: the jinja2 chat template source, or None.
  """

  def __init__(
      self,
      backend: _Backend,
      *,
      vocab_size: int,
      bos_token_id: int | None,
      eos_token_ids: Sequence[int],
      add_bos: bool,
      chat_template: str | None,
      bos_token: str | None = None,
      eos_token: str | None = None,
  ):
    if not eos_token_ids:
      raise ValueError(f"{eos_token_ids=} must name at least one id")
    if add_bos and bos_token_id is None:
      raise ValueError(f"{add_bos=} needs a bos_token_id")
    self._backend = backend
    self.vocab_size = int(vocab_size)
    self.bos_token_id = None if bos_token_id is None else int(bos_token_id)
    self.eos_token_ids = tuple(int(i) for i in eos_token_ids)
    self.add_bos = bool(add_bos)
    self.chat_template = chat_template
    self.bos_token = bos_token
    self.eos_token = eos_token

  @classmethod
  def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
    """Rebuilds the tokenizer from GGUF ``tokenizer.*`` key/values.

    Args:
      metadata: GGUF key/values (``GGUFCheckpoint.tokenizer_metadata``, or the same
        dict after a JSON round trip: arrays may be lists).

    Raises:
      ValueError: missing vocabulary, or an unsupported ``tokenizer.ggml.model``/``pre``.
    """
    tokens = _md(metadata, "tokens")
    if tokens is None:
      raise ValueError("GGUF metadata has no tokenizer.ggml.tokens")
    kind = _md(metadata, "model")
    if kind == "gpt2":
      backend = _bpe_backend(metadata)
    elif kind == "llama":
      backend = _sentencepiece_backend(metadata)
    else:
      raise ValueError(f"tokenizer.ggml.model={kind!r} must be 'gpt2' (BPE) or 'llama' "
                       "(SentencePiece)")
    bos = _md(metadata, "bos_token_id")
    eos = _md(metadata, "eos_token_id")
    add_bos = bool(_md(metadata, "add_bos_token", kind == "llama"))
    if bos is None:
      add_bos = False
    return cls(
        backend,
        vocab_size=len(tokens),
        bos_token_id=bos,
        eos_token_ids=stop_token_ids(metadata),
        add_bos=add_bos,
        chat_template=metadata.get("tokenizer.chat_template"),
        bos_token=None if bos is None else tokens[int(bos)],
        eos_token=None if eos is None else tokens[int(eos)],
    )

  @classmethod
  def from_hf(cls, path: str | os.PathLike) -> Tokenizer:
    """Loads an HF tokenizer: a ``tokenizer.json`` file or a directory holding one.

    ``tokenizer_config.json`` (chat template, BOS/EOS), ``chat_template.jinja``,
    ``generation_config.json`` and ``config.json`` next to it are read when present.
    BOS handling is left to the file's post-processor.

    Raises:
      ValueError: no ``tokenizer.json`` at ``path``, or no EOS id can be found.
    """
    from tokenizers import Tokenizer as HFTokenizer

    path = os.fspath(path)
    directory, file = (path, os.path.join(path, "tokenizer.json")) if os.path.isdir(path) else (
        os.path.dirname(path), path)
    if not os.path.isfile(file):
      raise ValueError(f"{path=} must be a tokenizer.json file or a directory holding one")
    tok = HFTokenizer.from_file(file)

    def read_json(name):
      p = os.path.join(directory, name)
      if not os.path.isfile(p):
        return {}
      with open(p, encoding="utf-8") as f:
        return json.load(f)

    tcfg, gen, mcfg = (read_json("tokenizer_config.json"), read_json("generation_config.json"),
                       read_json("config.json"))
    template = tcfg.get("chat_template")
    if isinstance(template, list):  # named templates; take "default"
      template = {t["name"]: t["template"] for t in template}.get("default")
    jinja = os.path.join(directory, "chat_template.jinja")
    if template is None and os.path.isfile(jinja):
      with open(jinja, encoding="utf-8") as f:
        template = f.read()
    bos_token, eos_token = _token_content(tcfg.get("bos_token")), _token_content(tcfg.get("eos_token"))
    bos_id = tok.token_to_id(bos_token) if bos_token else mcfg.get("bos_token_id")
    eos = _as_ids(gen.get("eos_token_id")) + _as_ids(mcfg.get("eos_token_id"))
    if eos_token and tok.token_to_id(eos_token) is not None:
      eos.append(tok.token_to_id(eos_token))
    specials = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    eos += [tok.token_to_id(n) for n in STOP_TOKEN_NAMES if n in specials]
    eos = list(dict.fromkeys(eos))
    return cls(
        _HFBackend(tok),
        vocab_size=max(tok.get_vocab_size(with_added_tokens=True), mcfg.get("vocab_size", 0)),
        bos_token_id=bos_id,
        eos_token_ids=eos,
        add_bos=False,
        chat_template=template,
        bos_token=bos_token,
        eos_token=eos_token,
    )

  def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
    """Tokenizes ``text``; special tokens written in it (``<|im_start|>``) are matched.

    Args:
      text: the string.
      add_special_tokens: prepend BOS when the model wants one (Gemma). Pass False for
        text from ``apply_chat_template``, whose templates write BOS themselves.

    Returns:
      Token ids.
    """
    ids = self._backend.encode(text, add_special_tokens)
    if add_special_tokens and self.add_bos:
      ids = [self.bos_token_id, *ids]
    return ids

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
    """Detokenizes ``ids`` (special tokens rendered as text unless skipped)."""
    return self._backend.decode([int(i) for i in ids], skip_special_tokens)

  def token_to_id(self, token: str) -> int | None:
    """The id of a vocabulary string, or None."""
    return self._backend.token_to_id(token)

  def apply_chat_template(
      self,
      messages: Sequence[Mapping[str, Any]],
      add_generation_prompt: bool = True,
      **kwargs: Any,
  ) -> str:
    """Renders a conversation with the model's chat template (as HF ``transformers`` does).

    Args:
      messages: ``[{"role": "user", "content": "..."}, ...]``.
      add_generation_prompt: end with the assistant turn header.
      **kwargs: extra template variables (``tools``, ...).

    Returns:
      The prompt text; encode it with ``add_special_tokens=False``.

    Raises:
      ValueError: the model has no chat template, a malformed message, or the template
        called ``raise_exception``.
    """
    if not self.chat_template:
      raise ValueError("this model has no chat template (tokenizer.chat_template is unset); "
                       "format the prompt yourself")
    for i, m in enumerate(messages):
      if not isinstance(m, Mapping) or "role" not in m:
        raise ValueError(f"messages[{i}]={m!r} must be a mapping with a 'role'")
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    template = env.from_string(self.chat_template)
    return template.render(
        messages=[dict(m) for m in messages],
        add_generation_prompt=add_generation_prompt,
        bos_token=self.bos_token or "",
        eos_token=self.eos_token or "",
        **kwargs,
    )
