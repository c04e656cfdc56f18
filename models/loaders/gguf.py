"""Reads a GGUF file (llama.cpp's format) into HF ``transformers`` checkpoint form.

``read_gguf(path)`` parses the header, dequantizes every tensor to f32 with
``gguf.quants.dequantize`` and renames/reshapes it to the HF name and ``(out, in)``
layout that ``models.loaders.hf_safetensors.model_from_hf_tensors`` takes, undoing what
llama.cpp's ``convert_hf_to_gguf.py`` did:

- llama arch: the rows of ``attn_q``/``attn_k`` were permuted (per head, the two
  rotate-half halves interleaved for GGML's GPT-J-style RoPE); they are un-permuted so
  HF rotate-half RoPE is right again.
- gemma3 arch: every ``*norm.weight`` was stored as ``1 + w``; 1 is subtracted to get
  HF's ``w`` (HF Gemma RMSNorm scales by ``1 + w``).
- qwen2 arch: q/k/v biases are carried over; qwen3: per-head q/k norms.

The header parser is our own (Gemma 3's 262k-token vocabulary parses in about a second,
where ``gguf.GGUFReader`` takes 20-35 s); tensor decoding is the ``gguf`` package's.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import struct
from collections.abc import Mapping
from typing import Any

import gguf
import numpy as np
from tqdm.auto import tqdm

from models.loaders.tokenizer import stop_token_ids

__all__ = ["GGUFCheckpoint", "SUPPORTED_ARCHS", "read_gguf", "read_gguf_metadata"]

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "gemma3")

_MODEL_TYPE = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text"}
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
# Gemma 3 facts llama.cpp hard-codes when the file does not carry them.
_GEMMA3_SLIDING_WINDOW_PATTERN = 6
_GEMMA3_ROPE_LOCAL_BASE = 10000.0

_V = gguf.GGUFValueType
_SCALAR_FORMATS = {
    _V.UINT8: "<B", _V.INT8: "<b", _V.UINT16: "<H", _V.INT16: "<h",
    _V.UINT32: "<I", _V.INT32: "<i", _V.FLOAT32: "<f", _V.BOOL: "<?",
    _V.UINT64: "<Q", _V.INT64: "<q", _V.FLOAT64: "<d",
}
_ARRAY_DTYPES = {
    _V.UINT8: "<u1", _V.INT8: "<i1", _V.UINT16: "<u2", _V.INT16: "<i2",
    _V.UINT32: "<u4", _V.INT32: "<i4", _V.FLOAT32: "<f4", _V.BOOL: "?",
    _V.UINT64: "<u8", _V.INT64: "<i8", _V.FLOAT64: "<f8",
}


@dataclasses.dataclass(frozen=True)
class GGUFCheckpoint:
  """A GGUF file converted to HF checkpoint form.

  Attributes:
    hf_config: an HF ``config.json``-style dict (``model_type`` "llama", "qwen2",
      "qwen3" or "gemma3_text"), accepted by
      ``models.loaders.hf_safetensors.config_from_hf``.
    tensors: HF parameter name -> ``f32`` array in HF layout (linear weights
      ``[out, in]``, e.g. ``model.layers.0.self_attn.q_proj.weight: f32[N*H, D]``).
    tokenizer_metadata: every ``tokenizer.*`` key of the file (``tokenizer.ggml.tokens``
      as ``list[str]``, numeric arrays as numpy arrays, ``tokenizer.chat_template``);
      ``models.loaders.tokenizer.Tokenizer.from_gguf_metadata`` builds the tokenizer.
    metadata: the other key/value pairs (``general.*``, ``{arch}.*``).
  """

  hf_config: dict[str, Any]
  tensors: dict[str, np.ndarray]
  tokenizer_metadata: dict[str, Any]
  metadata: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class _TensorInfo:
  name: str
  shape: tuple[int, ...]  # GGUF order: shape[0] is the innermost (contiguous) axis
  qtype: gguf.GGMLQuantizationType
  offset: int  # from the start of the data section


class _Cursor:
  """Little-endian reader over an mmap; raises ``ValueError`` past the end."""

  def __init__(self, buf: mmap.mmap):
    self.buf, self.pos = buf, 0

  def take(self, n: int) -> bytes:
    if n < 0 or self.pos + n > len(self.buf):
      raise ValueError(f"unexpected end of file reading {n} bytes at offset {self.pos}")
    out = self.buf[self.pos : self.pos + n]
    self.pos += n
    return out

  def scalar(self, fmt: str):
    return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

  def string(self) -> str:
    return self.take(self.scalar("<Q")).decode("utf-8")

  def value(self, vtype: int):
    if vtype == _V.STRING:
      return self.string()
    if vtype == _V.ARRAY:
      etype, count = self.scalar("<I"), self.scalar("<Q")
      if etype == _V.STRING:
        return [self.string() for _ in range(count)]
      if etype in _ARRAY_DTYPES:
        dt = np.dtype(_ARRAY_DTYPES[etype])
        return np.frombuffer(self.take(count * dt.itemsize), dtype=dt).copy()
      raise ValueError(f"unsupported GGUF array element type {etype}")
    if vtype in _SCALAR_FORMATS:
      return self.scalar(_SCALAR_FORMATS[vtype])
    raise ValueError(f"unsupported GGUF value type {vtype}")


def _parse(path: str) -> tuple[dict[str, Any], list[_TensorInfo], int]:
  """Parses the header: (key/values, tensor infos, absolute offset of the data section)."""
  with open(path, "rb") as f:
    size = os.fstat(f.fileno()).st_size
    if size < 24:
      raise ValueError(f"{path=} is not a GGUF file: only {size} bytes")
    with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
      cur = _Cursor(buf)
      magic = cur.take(4)
      if magic != b"GGUF":
        raise ValueError(f"{path=} is not a GGUF file: magic {magic!r} != b'GGUF'")
      version = cur.scalar("<I")
      if version not in (2, 3):
        raise ValueError(f"{path=} has GGUF {version=}; only little-endian v2/v3 are supported")
      n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
      try:
        kv = {}
        for _ in range(n_kv):
          key = cur.string()
          kv[key] = cur.value(cur.scalar("<I"))
        infos = []
        for _ in range(n_tensors):
          name = cur.string()
          n_dims = cur.scalar("<I")
          shape = tuple(cur.scalar("<Q") for _ in range(n_dims))
          qtype = gguf.GGMLQuantizationType(cur.scalar("<I"))
          infos.append(_TensorInfo(name, shape, qtype, cur.scalar("<Q")))
      except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path=} has a corrupt GGUF header: {e}") from e
      alignment = int(kv.get("general.alignment", 32))
      data_start = -(-cur.pos // alignment) * alignment
  for t in infos:
    block, type_size = gguf.GGML_QUANT_SIZES[t.qtype]
    nbytes = int(np.prod(t.shape, dtype=np.int64)) // block * type_size
    if t.shape[0] % block or data_start + t.offset + nbytes > size:
      raise ValueError(
          f"{path=} is truncated or corrupt: tensor {t.name!r} ({t.qtype.name}, {t.shape}) "
          f"needs bytes up to {data_start + t.offset + nbytes}, file has {size}"
      )
  return kv, infos, data_start


def _dequantize(data: np.memmap, data_start: int, t: _TensorInfo) -> np.ndarray:
  """One tensor as ``f32`` in numpy order (``reversed(t.shape)``, i.e. ``[out, in]``)."""
  block, type_size = gguf.GGML_QUANT_SIZES[t.qtype]
  row_bytes = t.shape[0] // block * type_size
  n_rows = int(np.prod(t.shape[1:], dtype=np.int64))
  start = data_start + t.offset
  raw = data[start : start + n_rows * row_bytes].reshape(*reversed(t.shape[1:]), row_bytes)
  out = gguf.quants.dequantize(np.asarray(raw), t.qtype)
  return np.array(out, dtype=np.float32, copy=True)


def read_gguf_metadata(path: str | os.PathLike) -> dict[str, Any]:
  """All key/value pairs of a GGUF file (no tensor data is read).

  Raises:
    ValueError: not a (little-endian v2/v3) GGUF file, or a corrupt header.
  """
  return _parse(os.fspath(path))[0]


def _unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
  """Inverts llama.cpp's ``LlamaModel.permute`` of q/k rows.

  Per head of H rows, HF stores the rotate-half halves ``[x_0..x_{H/2-1}, y_0..]``;
  llama.cpp stores them interleaved ``[x_0, y_0, x_1, y_1, ...]``. With H = 4:
  stored rows ``[x0, y0, x1, y1]`` -> view ``[H/2=2, 2]`` -> swap -> ``[x0, x1, y0, y1]``.
  """
  rows = w.shape[0]
  return (w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:])
          .swapaxes(1, 2).reshape(w.shape))


def _get(kv: Mapping[str, Any], key: str, default: Any = KeyError) -> Any:
  if key in kv:
    return kv[key]
  if default is KeyError:
    raise ValueError(f"GGUF metadata is missing required key {key!r}")
  return default


def _hf_config(kv: Mapping[str, Any], arch: str, vocab_size: int, tied: bool) -> dict[str, Any]:
  p = f"{arch}."
  d_model = int(_get(kv, p + "embedding_length"))
  n_heads = int(_get(kv, p + "attention.head_count"))
  n_kv = _get(kv, p + "attention.head_count_kv", n_heads)
  if isinstance(n_kv, np.ndarray):  # per-layer array in some files
    if len(set(n_kv.tolist())) != 1:
      raise ValueError(f"per-layer head_count_kv={n_kv.tolist()} must be uniform")
    n_kv = n_kv[0]
  n_kv = int(n_kv)
  head_dim = int(_get(kv, p + "attention.key_length", d_model // n_heads))
  value_dim = int(_get(kv, p + "attention.value_length", head_dim))
  if value_dim != head_dim:
    raise ValueError(f"{arch}: attention.value_length={value_dim} must equal key_length={head_dim}")
  rope_dims = int(_get(kv, p + "rope.dimension_count", head_dim))
  if rope_dims != head_dim:
    raise ValueError(f"{arch}: rope.dimension_count={rope_dims} must equal head_dim={head_dim}"
                     " (partial rotary is not supported)")
  scaling = _get(kv, p + "rope.scaling.type", "none")
  if scaling not in ("none", ""):
    raise ValueError(f"{arch}: rope.scaling.type={scaling!r} is not supported")
  rope_theta = float(_get(kv, p + "rope.freq_base", 10000.0))
  tok = "tokenizer.ggml."
  cfg: dict[str, Any] = {
      "architectures": [_ARCHITECTURES[arch]],
      "model_type": _MODEL_TYPE[arch],
      "vocab_size": vocab_size,
      "hidden_size": d_model,
      "intermediate_size": int(_get(kv, p + "feed_forward_length")),
      "num_hidden_layers": int(_get(kv, p + "block_count")),
      "num_attention_heads": n_heads,
      "num_key_value_heads": n_kv,
      "head_dim": head_dim,
      "rms_norm_eps": float(_get(kv, p + "attention.layer_norm_rms_epsilon", 1e-6)),
      "max_position_embeddings": int(_get(kv, p + "context_length", 8192)),
      "rope_theta": rope_theta,
      "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
      "tie_word_embeddings": tied,
      "bos_token_id": _get(kv, tok + "bos_token_id", None),
      "eos_token_id": list(stop_token_ids(kv)),
      "pad_token_id": _get(kv, tok + "padding_token_id", None),
      "torch_dtype": "float32",
  }
  if arch in ("llama", "qwen2", "qwen3"):
    cfg["hidden_act"] = "silu"
  if arch == "llama":
    cfg.update(attention_bias=False, mlp_bias=False)
  if arch in ("qwen2", "qwen3"):
    cfg.update(use_sliding_window=False, sliding_window=None)
  if arch == "gemma3":
    window = int(_get(kv, p + "attention.sliding_window"))
    pattern = _get(kv, p + "attention.sliding_window_pattern", _GEMMA3_SLIDING_WINDOW_PATTERN)
    n_layers = cfg["num_hidden_layers"]
    if isinstance(pattern, np.ndarray):  # per-layer bools: True = sliding
      if len(pattern) != n_layers:
        raise ValueError(f"gemma3: sliding_window_pattern has {len(pattern)} entries, "
                         f"expected {n_layers=}")
      layer_types = ["sliding_attention" if s else "full_attention" for s in pattern.tolist()]
    else:
      pattern = int(pattern)
      layer_types = ["full_attention" if i % pattern == pattern - 1 else "sliding_attention"
                     for i in range(n_layers)]
    local_theta = float(_get(kv, p + "rope.freq_base_swa", _GEMMA3_ROPE_LOCAL_BASE))
    softcap = _get(kv, p + "final_logit_softcapping", None)
    attn_softcap = _get(kv, p + "attn_logit_softcapping", None)
    cfg.update(
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=head_dim,
        sliding_window=window,
        sliding_window_pattern=pattern if isinstance(pattern, int) else None,
        layer_types=layer_types,
        rope_local_base_freq=local_theta,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": rope_theta},
            "sliding_attention": {"rope_type": "default", "rope_theta": local_theta},
        },
        rope_scaling=None,
        final_logit_softcapping=None if softcap is None else float(softcap),
        attn_logit_softcapping=None if attn_softcap is None else float(attn_softcap),
    )
  return cfg


def _layer_name_map(arch: str) -> dict[str, str]:
  """GGUF per-block tensor suffix -> HF per-layer suffix."""
  names = {
      "attn_norm.weight": "input_layernorm.weight",
      "attn_q.weight": "self_attn.q_proj.weight",
      "attn_k.weight": "self_attn.k_proj.weight",
      "attn_v.weight": "self_attn.v_proj.weight",
      "attn_output.weight": "self_attn.o_proj.weight",
      "ffn_gate.weight": "mlp.gate_proj.weight",
      "ffn_up.weight": "mlp.up_proj.weight",
      "ffn_down.weight": "mlp.down_proj.weight",
  }
  if arch == "gemma3":
    names.update({
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "ffn_norm.weight": "pre_feedforward_layernorm.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    })
  else:
    names["ffn_norm.weight"] = "post_attention_layernorm.weight"
  if arch in ("gemma3", "qwen3"):
    names["attn_q_norm.weight"] = "self_attn.q_norm.weight"
    names["attn_k_norm.weight"] = "self_attn.k_norm.weight"
  if arch == "qwen2":
    for x in "qkv":
      names[f"attn_{x}.bias"] = f"self_attn.{x}_proj.bias"
  return names


def _expected_shapes(cfg: Mapping[str, Any], arch: str) -> dict[str, tuple[int, ...]]:
  """HF name -> shape for every tensor the HF checkpoint must hold."""
  d, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
  n, k, h = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
  per_layer = {
      "input_layernorm.weight": (d,),
      "post_attention_layernorm.weight": (d,),
      "self_attn.q_proj.weight": (n * h, d),
      "self_attn.k_proj.weight": (k * h, d),
      "self_attn.v_proj.weight": (k * h, d),
      "self_attn.o_proj.weight": (d, n * h),
      "mlp.gate_proj.weight": (f, d),
      "mlp.up_proj.weight": (f, d),
      "mlp.down_proj.weight": (d, f),
  }
  if arch == "gemma3":
    per_layer["pre_feedforward_layernorm.weight"] = (d,)
    per_layer["post_feedforward_layernorm.weight"] = (d,)
  if arch in ("gemma3", "qwen3"):
    per_layer["self_attn.q_norm.weight"] = (h,)
    per_layer["self_attn.k_norm.weight"] = (h,)
  if arch == "qwen2":
    per_layer.update({"self_attn.q_proj.bias": (n * h,), "self_attn.k_proj.bias": (k * h,),
                      "self_attn.v_proj.bias": (k * h,)})
  shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
  if not cfg["tie_word_embeddings"]:
    shapes["lm_head.weight"] = (v, d)
  for i in range(cfg["num_hidden_layers"]):
    for suffix, shape in per_layer.items():
      shapes[f"model.layers.{i}.{suffix}"] = shape
  return shapes


def _hf_name(gguf_name: str, layer_map: Mapping[str, str]) -> str | None:
  top = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
         "output.weight": "lm_head.weight"}
  if gguf_name in top:
    return top[gguf_name]
  parts = gguf_name.split(".", 2)
  if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer_map:
    return f"model.layers.{parts[1]}.{layer_map[parts[2]]}"
  return None


def read_gguf(path: str | os.PathLike, *, progress: bool = False) -> GGUFCheckpoint:
  """Reads and dequantizes a GGUF checkpoint into HF names, layouts and config.

  Args:
    path: a ``.gguf`` file of architecture llama, qwen2, qwen3 or gemma3.
    progress: show a tqdm bar over the tensors being dequantized.

  Returns:
    ``GGUFCheckpoint`` whose ``tensors`` are ``f32`` HF tensors (linear weights
    ``[out, in]``), ``lm_head.weight`` only when the file has ``output.weight``
    (otherwise ``hf_config["tie_word_embeddings"]`` is True).

  Raises:
    ValueError: not a GGUF file, truncated/corrupt data, unsupported architecture,
      missing metadata, unknown/missing tensors or a tensor of the wrong shape.
  """
  path = os.fspath(path)
  kv, infos, data_start = _parse(path)
  arch = kv.get("general.architecture")
  if arch not in SUPPORTED_ARCHS:
    raise ValueError(f"{path=}: architecture {arch!r} is not supported; supported: {SUPPORTED_ARCHS}")
  by_name = {t.name: t for t in infos}
  if "token_embd.weight" not in by_name:
    raise ValueError(f"{path=} has no token_embd.weight tensor")
  embd_rows = by_name["token_embd.weight"].shape[1]
  tokens = kv.get("tokenizer.ggml.tokens")
  vocab_size = len(tokens) if tokens is not None else int(kv.get(f"{arch}.vocab_size", embd_rows))
  if vocab_size != embd_rows:
    raise ValueError(f"{path=}: tokenizer has {vocab_size} tokens but token_embd.weight has "
                     f"{embd_rows} rows")
  tied = "output.weight" not in by_name
  cfg = _hf_config(kv, arch, vocab_size, tied)
  layer_map = _layer_name_map(arch)
  expected = _expected_shapes(cfg, arch)
  names = {}
  for t in infos:
    hf = _hf_name(t.name, layer_map)
    if hf is None or hf not in expected:
      raise ValueError(f"{path=}: unexpected tensor {t.name!r} for architecture {arch!r}")
    names[t.name] = hf
  missing = sorted(set(expected) - set(names.values()))
  if missing:
    raise ValueError(f"{path=}: missing {len(missing)} tensors, e.g. {missing[:4]}")
  data = np.memmap(path, dtype=np.uint8, mode="r")
  iterator = infos
  if progress:
    iterator = tqdm(infos, desc=f"dequantizing {os.path.basename(path)}", unit="tensor")
  tensors = {}
  for t in iterator:
    hf = names[t.name]
    w = _dequantize(data, data_start, t)
    if w.shape != expected[hf]:
      raise ValueError(f"{path=}: tensor {t.name!r} has shape {w.shape} (HF {hf}), "
                       f"expected {expected[hf]}")
    if arch == "llama" and hf.endswith(("q_proj.weight", "k_proj.weight")):
      n = cfg["num_attention_heads"] if "q_proj" in hf else cfg["num_key_value_heads"]
      w = _unpermute_rope_rows(w, n)
    if arch == "gemma3" and t.name.endswith("norm.weight"):
      w -= 1.0
    tensors[hf] = w
  del data
  tokenizer_metadata = {k: v for k, v in kv.items() if k.startswith("tokenizer.")}
  metadata = {k: v for k, v in kv.items() if not k.startswith("tokenizer.")}
  return GGUFCheckpoint(cfg, tensors, tokenizer_metadata, metadata)
