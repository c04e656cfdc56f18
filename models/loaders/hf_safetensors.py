"""Hugging Face safetensors checkpoints -> ``ModelConfig`` + ``Transformer``.

Supports the ``transformers`` model types llama, qwen2, qwen3, gemma3_text and the
text tower of gemma3 (``text_config``), in both the 4.x ``config.json`` layout
(``rope_theta``, ``rope_scaling``, ``rope_local_base_freq``, ``sliding_window_pattern``)
and the 5.x one (``rope_parameters``, per layer type for Gemma 3, ``layer_types``).

The weight mapping is one table (:func:`hf_param_table`) of checkpoint name ->
parameter path, expected checkpoint shape and layout conversion. HF ``nn.Linear``
weights are ``[out, in]``; our parameters are einsum-ready, e.g. ``q_proj.weight``
``[N*H, D]`` becomes ``q: [D, N, H]`` by ``w.T.reshape(D, N, H)`` and ``o_proj.weight``
``[D, N*H]`` becomes ``o: [N, H, D]`` by ``w.T.reshape(N, H, D)``.

Norm naming differs by family: in Llama/Qwen ``post_attention_layernorm`` is the norm in
front of the MLP (our ``ffn_norm``); in Gemma 3 it is the sandwich norm after attention
(our ``post_attn_norm``) and ``pre_feedforward_layernorm`` is our ``ffn_norm``.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
import safetensors.numpy
from flax import nnx

from models.config import ModelConfig
from models.llama import Transformer

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "TensorSpec",
    "config_from_hf",
    "hf_param_table",
    "load_hf_directory",
    "model_from_hf_tensors",
]

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "gemma3_text", "gemma3")

_FAMILY = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3"}

# Class defaults of the transformers 5.x configs for keys a config.json may omit.
_QWEN_DEFAULTS = {
    "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
    "hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
    "bos_token_id": None, "eos_token_id": None, "tie_word_embeddings": False,
    "rope_theta": 10000.0, "attention_bias": False, "use_sliding_window": False,
    "sliding_window": 4096, "max_window_layers": 28,
}
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {
        "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": None,
        "hidden_act": "silu", "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
        "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
        "rope_theta": 10000.0, "attention_bias": False, "mlp_bias": False, "head_dim": None,
    },
    "qwen2": {**_QWEN_DEFAULTS, "head_dim": None},
    "qwen3": {**_QWEN_DEFAULTS, "head_dim": 128},
    "gemma3_text": {
        "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
        "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "bos_token_id": 2,
        "eos_token_id": 1, "tie_word_embeddings": True, "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0, "attention_bias": False,
        "query_pre_attn_scalar": 256, "sliding_window": 4096, "sliding_window_pattern": 6,
    },
}

_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh",
                "gelu_new": "gelu_tanh"}


def _get(hf: Mapping[str, Any], model_type: str, key: str):
  """``hf[key]``, falling back to the transformers class default (None if null)."""
  if key in hf:
    return hf[key]
  return _DEFAULTS[model_type].get(key)


def _rope_scaling(params: Mapping[str, Any], where: str) -> tuple[tuple[str, Any], ...] | None:
  """HF rope parameters -> ``ModelConfig.rope_scaling`` (``None`` for plain RoPE)."""
  rope_type = params.get("rope_type", params.get("type", "default"))
  if params.get("partial_rotary_factor", 1.0) != 1.0:
    raise ValueError(f"{where}: partial_rotary_factor={params['partial_rotary_factor']} "
                     "must be 1.0 (partial rotary embeddings are not supported)")
  if rope_type == "default":
    return None
  if rope_type == "linear":
    keys = ("factor",)
  elif rope_type == "llama3":
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
  else:
    raise ValueError(f"{where}: {rope_type=} must be 'default', 'linear' or 'llama3'")
  missing = [k for k in keys if k not in params]
  if missing:
    raise ValueError(f"{where}: rope_type {rope_type!r} is missing {missing}")
  return tuple(sorted([(k, float(params[k])) for k in keys] + [("rope_type", rope_type)]))


def _flat_rope_params(hf: Mapping[str, Any], model_type: str) -> dict[str, Any]:
  """One rope dict for llama/qwen configs (5.x ``rope_parameters`` or 4.x keys)."""
  params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
  if "rope_theta" not in params:
    params["rope_theta"] = _get(hf, model_type, "rope_theta")
  return params


def _gemma3_rope_params(hf: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
  """(full_attention, sliding_attention) rope dicts of a Gemma 3 text config."""
  rp = hf.get("rope_parameters")
  if isinstance(rp, Mapping) and ("full_attention" in rp or "sliding_attention" in rp):
    full = dict(rp.get("full_attention") or {})
    local = dict(rp.get("sliding_attention") or {})
  else:  # transformers 4.x: rope_theta / rope_scaling / rope_local_base_freq
    full = dict(rp or hf.get("rope_scaling") or {})
    local = {}
  full.setdefault("rope_theta", _get(hf, "gemma3_text", "rope_theta"))
  local.setdefault("rope_theta", _get(hf, "gemma3_text", "rope_local_base_freq"))
  return full, local


def _attention_pattern(layer_types: list[str], num_layers: int) -> tuple[bool, int | None]:
  """HF ``layer_types`` -> (has sliding layers, ``global_every``).

  ``ModelConfig`` expresses a periodic pattern: with ``global_every = g`` layer ``i`` is
  global iff ``i % g == g - 1``. Example: Gemma 3's pattern 6 is five
  "sliding_attention" layers then one "full_attention" layer, repeated: g = 6.
  """
  if len(layer_types) != num_layers:
    raise ValueError(f"layer_types has {len(layer_types)} entries, must have num_hidden_layers="
                     f"{num_layers}")
  unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
  if unknown:
    raise ValueError(f"layer_types {unknown} must be 'full_attention' or 'sliding_attention'")
  full = [t == "full_attention" for t in layer_types]
  if all(full):
    return False, None
  if not any(full):
    return True, None
  every = full.index(True) + 1
  if any(full[i] != (i % every == every - 1) for i in range(num_layers)):
    raise ValueError(f"{layer_types=} must repeat (every-1) sliding layers then one full layer")
  return True, every


def _eos_ids(value) -> tuple[int, ...]:
  if value is None:
    return ()
  if isinstance(value, int):
    return (value,)
  return tuple(int(v) for v in value)


def config_from_hf(hf_config: Mapping[str, Any], dtype: str = "float32") -> ModelConfig:
  """Maps a ``transformers`` ``config.json`` dict to :class:`ModelConfig`.

  Args:
    hf_config: the parsed ``config.json`` (model_type llama, qwen2, qwen3, gemma3_text,
      or gemma3 with a ``text_config``). Keys it omits take the transformers 5.x class
      defaults of that model type.
    dtype: parameter/activation dtype, "float32" or "bfloat16".

  Returns:
    The frozen ``ModelConfig``.

  Raises:
    ValueError: unknown ``model_type`` or a feature the model does not implement
      (o_proj/MLP biases, logit soft-capping, RoPE types other than default/linear/llama3,
      non-periodic sliding-window layouts, bidirectional attention).
  """
  model_type = hf_config.get("model_type")
  if model_type not in SUPPORTED_MODEL_TYPES:
    raise ValueError(f"{model_type=} must be one of {SUPPORTED_MODEL_TYPES}")
  hf = dict(hf_config)
  if model_type == "gemma3":
    text = hf_config.get("text_config")
    if not isinstance(text, Mapping):
      raise ValueError("model_type='gemma3' config must have a text_config dict")
    hf = {k: hf_config[k] for k in ("bos_token_id", "eos_token_id", "tie_word_embeddings")
          if k in hf_config}
    hf.update(text)
    model_type = "gemma3_text"
  family = _FAMILY[model_type]
  get = lambda key: _get(hf, model_type, key)

  hidden, heads = int(get("hidden_size")), int(get("num_attention_heads"))
  num_layers = int(get("num_hidden_layers"))
  kv_heads = get("num_key_value_heads") or heads
  head_dim = get("head_dim") or hidden // heads
  act_name = hf.get("hidden_activation") or get("hidden_act") or get("hidden_activation")
  if act_name not in _ACTIVATIONS:
    raise ValueError(f"hidden activation {act_name!r} must be one of {sorted(_ACTIVATIONS)}")
  if get("attention_bias") and family != "qwen2":
    raise ValueError(f"{model_type}: attention_bias=True (biases on q/k/v *and* o_proj) is not "
                     "supported; only Qwen2's q/k/v biases are")
  if get("mlp_bias"):
    raise ValueError(f"{model_type}: mlp_bias=True is not supported")

  kw: dict[str, Any] = {}
  if family == "gemma3":
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
      if hf.get(key) is not None:
        raise ValueError(f"gemma3: {key}={hf[key]} is not supported (must be null)")
    if hf.get("use_bidirectional_attention"):
      raise ValueError("gemma3: use_bidirectional_attention=True is not supported")
    full, local = _gemma3_rope_params(hf)
    if _rope_scaling(local, "gemma3 sliding_attention rope") is not None:
      raise ValueError(f"gemma3: sliding_attention rope {local} must be rope_type 'default'")
    rope_theta, rope_local_theta = float(full["rope_theta"]), float(local["rope_theta"])
    rope_scaling = _rope_scaling(full, "gemma3 full_attention rope")
    layer_types = hf.get("layer_types")
    if layer_types is None:
      pattern = hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern"))
      pattern = int(pattern or get("sliding_window_pattern"))
      layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                     for i in range(num_layers)]
    kw.update(qk_norm=True, sandwich_norms=True, norm_plus_one=True, scale_embeddings=True,
              query_pre_attn_scalar=float(get("query_pre_attn_scalar")))
  else:
    rope = _flat_rope_params(hf, model_type)
    rope_theta, rope_local_theta = float(rope["rope_theta"]), None
    rope_scaling = _rope_scaling(rope, f"{model_type} rope")
    layer_types = hf.get("layer_types")
    if layer_types is None and family != "llama" and get("use_sliding_window"):
      first = int(get("max_window_layers"))
      layer_types = ["sliding_attention" if i >= first else "full_attention"
                     for i in range(num_layers)]
    kw.update(attention_bias=family == "qwen2", qk_norm=family == "qwen3")
  has_sliding, global_every = _attention_pattern(
      list(layer_types or ["full_attention"] * num_layers), num_layers)
  sliding_window = None
  if has_sliding:
    sliding_window = get("sliding_window")
    if not sliding_window:
      raise ValueError(f"{model_type}: layer_types has sliding layers but sliding_window="
                       f"{sliding_window}")
    sliding_window = int(sliding_window)
  bos = get("bos_token_id")
  return ModelConfig(
      family=family,
      vocab_size=int(get("vocab_size")),
      hidden_size=hidden,
      intermediate_size=int(get("intermediate_size")),
      num_layers=num_layers,
      num_heads=heads,
      num_kv_heads=int(kv_heads),
      head_dim=int(head_dim),
      rms_norm_eps=float(get("rms_norm_eps")),
      rope_theta=rope_theta,
      rope_local_theta=rope_local_theta,
      rope_scaling=rope_scaling,
      max_position_embeddings=int(get("max_position_embeddings")),
      tie_word_embeddings=bool(get("tie_word_embeddings")),
      hidden_act=_ACTIVATIONS[act_name],
      sliding_window=sliding_window,
      global_every=global_every,
      bos_token_id=None if bos is None else int(bos),
      eos_token_ids=_eos_ids(get("eos_token_id")),
      dtype=dtype,
      **kw,
  )


class TensorSpec(NamedTuple):
  """One checkpoint tensor: name, parameter path, expected shape, layout conversion.

  Attributes:
    name: checkpoint tensor name, e.g. ``model.layers.0.self_attn.q_proj.weight``.
    path: parameter path, e.g. ``("layers", 0, "q")``: the layer index selects a row of
      the stacked ``("layers", "q")`` state entry (leading axis ``num_layers``).
    shape: expected checkpoint shape, e.g. ``(N*H, D)``.
    convert: checkpoint layout -> parameter layout, e.g. ``w.T.reshape(D, N, H)``.
  """

  name: str
  path: tuple[str | int, ...]
  shape: tuple[int, ...]
  convert: Callable[[np.ndarray], np.ndarray]


def _same(w: np.ndarray) -> np.ndarray:
  return w


def _transpose(w: np.ndarray) -> np.ndarray:
  return w.T


def hf_param_table(cfg: ModelConfig) -> list[TensorSpec]:
  """The checkpoint-name -> parameter table of ``cfg``'s architecture (HF names)."""
  d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
  n, k, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

  def heads_in(heads):  # Linear D -> heads*H: [heads*H, D] -> [D, heads, H]
    return lambda w: w.T.reshape(d, heads, h)

  def heads_bias(heads):  # [heads*H] -> [heads, H]
    return lambda w: w.reshape(heads, h)

  table = [TensorSpec("model.embed_tokens.weight", ("embed",), (v, d), _same)]
  for i in range(cfg.num_layers):
    pre = f"model.layers.{i}."
    att = pre + "self_attn."
    table += [
        TensorSpec(pre + "input_layernorm.weight", ("layers", i, "attn_norm"), (d,), _same),
        TensorSpec(att + "q_proj.weight", ("layers", i, "q"), (n * h, d), heads_in(n)),
        TensorSpec(att + "k_proj.weight", ("layers", i, "k"), (k * h, d), heads_in(k)),
        TensorSpec(att + "v_proj.weight", ("layers", i, "v"), (k * h, d), heads_in(k)),
        # o_proj: [D, N*H] -> [N, H, D]
        TensorSpec(att + "o_proj.weight", ("layers", i, "o"), (d, n * h),
                   lambda w: w.T.reshape(n, h, d)),
        TensorSpec(pre + "mlp.gate_proj.weight", ("layers", i, "gate"), (f, d), _transpose),
        TensorSpec(pre + "mlp.up_proj.weight", ("layers", i, "up"), (f, d), _transpose),
        TensorSpec(pre + "mlp.down_proj.weight", ("layers", i, "down"), (d, f), _transpose),
    ]
    if cfg.attention_bias:
      table += [
          TensorSpec(att + "q_proj.bias", ("layers", i, "q_bias"), (n * h,), heads_bias(n)),
          TensorSpec(att + "k_proj.bias", ("layers", i, "k_bias"), (k * h,), heads_bias(k)),
          TensorSpec(att + "v_proj.bias", ("layers", i, "v_bias"), (k * h,), heads_bias(k)),
      ]
    if cfg.qk_norm:
      table += [
          TensorSpec(att + "q_norm.weight", ("layers", i, "q_norm"), (h,), _same),
          TensorSpec(att + "k_norm.weight", ("layers", i, "k_norm"), (h,), _same),
      ]
    if cfg.sandwich_norms:  # Gemma 3
      table += [
          TensorSpec(pre + "post_attention_layernorm.weight", ("layers", i, "post_attn_norm"),
                     (d,), _same),
          TensorSpec(pre + "pre_feedforward_layernorm.weight", ("layers", i, "ffn_norm"),
                     (d,), _same),
          TensorSpec(pre + "post_feedforward_layernorm.weight", ("layers", i, "post_ffn_norm"),
                     (d,), _same),
      ]
    else:  # Llama/Qwen: post_attention_layernorm is the pre-MLP norm
      table.append(TensorSpec(pre + "post_attention_layernorm.weight", ("layers", i, "ffn_norm"),
                              (d,), _same))
  table.append(TensorSpec("model.norm.weight", ("final_norm",), (d,), _same))
  if not cfg.tie_word_embeddings:
    table.append(TensorSpec("lm_head.weight", ("lm_head",), (v, d), _transpose))
  return table


def _state_path(path: tuple[str | int, ...]) -> tuple[tuple[str, ...], int | None]:
  """Table path -> (path in the ``Transformer``'s state, index on the layer axis or None).

  Layer parameters are stacked: ``("layers", 3, "q")`` is row 3 of ``("layers", "q")``.
  """
  if path[0] == "layers":
    return (path[0], path[2]), path[1]
  return path, None


def _ignored(name: str) -> bool:
  """Non-parameter buffers some checkpoints carry."""
  return name.endswith("rotary_emb.inv_freq")


def model_from_hf_tensors(cfg: ModelConfig, tensors: Mapping[str, np.ndarray],
                          place=None) -> Transformer:
  """Builds a ``Transformer`` from HF-named tensors without random initialization.

  Args:
    cfg: the architecture (e.g. from :func:`config_from_hf`).
    tensors: checkpoint name -> array in HF layout (any float dtype; cast to
      ``cfg.dtype``). With tied embeddings an ``lm_head.weight`` may be present; it is
      shape-checked and ignored (the model reuses ``embed``). ``*rotary_emb.inv_freq``
      buffers are ignored.
    place: None (``jnp.asarray``: the default device), or ``(path, host array) ->
      jax.Array`` (``specjax.sharding.loader_placement``), called once per parameter
      (stacked layers: once per stack) so each goes straight to its shards.

  Returns:
    The module with every parameter set from ``tensors``.

  Raises:
    ValueError: a tensor is missing, has the wrong shape, or is not used by the model.
  """
  table = hf_param_table(cfg)
  missing = [s.name for s in table if s.name not in tensors]
  if missing:
    raise ValueError(f"checkpoint is missing {len(missing)} tensor(s) for {cfg.family}: "
                     f"{missing[:8]}{' ...' if len(missing) > 8 else ''}")
  known = {s.name for s in table}
  if cfg.tie_word_embeddings and "lm_head.weight" in tensors:
    known.add("lm_head.weight")
    got = tuple(np.shape(tensors["lm_head.weight"]))
    if got != (cfg.vocab_size, cfg.hidden_size):
      raise ValueError(f"tensor 'lm_head.weight' has shape {got}, expected "
                       f"{(cfg.vocab_size, cfg.hidden_size)}")
  unexpected = sorted(n for n in tensors if n not in known and not _ignored(n))
  if unexpected:
    raise ValueError(f"checkpoint has {len(unexpected)} tensor(s) the {cfg.family} model does "
                     f"not use: {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")

  abstract = nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0)))
  graphdef, abstract_state = nnx.split(abstract)
  flat = dict(nnx.to_flat_state(abstract_state))
  assert set(flat) == {_state_path(s.path)[0] for s in table}, (
      sorted(map(str, set(flat) ^ {_state_path(s.path)[0] for s in table})))
  # Stacked layer parameters are filled layer by layer in host buffers, then moved once.
  buffers: dict[tuple, np.ndarray] = {}
  filled: dict[tuple, list[int]] = {}
  for spec in table:
    w = np.asarray(tensors[spec.name])
    if w.shape != spec.shape:
      raise ValueError(f"tensor {spec.name!r} has shape {w.shape}, expected {spec.shape}")
    path, layer = _state_path(spec.path)
    target = flat[path].get_value()
    value = spec.convert(w)
    if layer is None:
      assert value.shape == target.shape, (spec, value.shape, target.shape)
      buffers[path] = np.asarray(value, dtype=target.dtype)
    else:
      assert value.shape == target.shape[1:], (spec, value.shape, target.shape)
      if path not in buffers:
        buffers[path] = np.empty(target.shape, target.dtype)
      buffers[path][layer] = value
      filled.setdefault(path, []).append(layer)
  for path, layers in filled.items():
    assert sorted(layers) == list(range(cfg.num_layers)), (path, layers)
  for path, value in buffers.items():
    flat[path] = flat[path].replace(jnp.asarray(value) if place is None else place(path, value))
  return nnx.merge(graphdef, nnx.from_flat_state(flat))


_GEMMA3_RENAMES = (  # multimodal checkpoint prefix -> text-only prefix (4.x and 5.x layouts)
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
_GEMMA3_DROPPED = ("model.vision_tower.", "vision_tower.", "model.multi_modal_projector.",
                   "multi_modal_projector.")


def _gemma3_text_tensors(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """Keeps the language model of a Gemma 3 multimodal checkpoint, under text-model names."""
  out = {}
  for name, w in tensors.items():
    if name.startswith(_GEMMA3_DROPPED):
      continue
    for old, new in _GEMMA3_RENAMES:
      if name.startswith(old):
        name = new + name[len(old):]
        break
    out[name] = w
  return out


def _safetensors_files(path: pathlib.Path) -> list[pathlib.Path]:
  index = path / "model.safetensors.index.json"
  if index.is_file():
    names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    files = [path / n for n in names]
    absent = [str(f) for f in files if not f.is_file()]
    if absent:
      raise FileNotFoundError(f"{index} lists shard(s) that do not exist: {absent}")
    return files
  files = sorted(path.glob("*.safetensors"))
  if not files:
    raise FileNotFoundError(f"no *.safetensors files in {path}")
  return files


def load_hf_directory(
    path: str | pathlib.Path, dtype: str = "float32"
) -> tuple[ModelConfig, Transformer]:
  """Loads a ``save_pretrained`` directory: ``config.json`` plus safetensors shards.

  EOS ids from ``generation_config.json`` (if present) are appended to the config's.

  Args:
    path: the checkpoint directory.
    dtype: "float32" or "bfloat16".

  Returns:
    ``(config, model)``.

  Raises:
    FileNotFoundError: the directory, its ``config.json`` or its weights are missing.
    ValueError: see :func:`config_from_hf` and :func:`model_from_hf_tensors`; also a
      tensor name that appears in two shards.
  """
  path = pathlib.Path(path)
  if not path.is_dir():
    raise FileNotFoundError(f"checkpoint directory {str(path)!r} does not exist")
  config_file = path / "config.json"
  if not config_file.is_file():
    raise FileNotFoundError(f"{str(path)!r} has no config.json")
  hf_config = json.loads(config_file.read_text())
  cfg = config_from_hf(hf_config, dtype=dtype)
  gen_file = path / "generation_config.json"
  if gen_file.is_file():
    extra = _eos_ids(json.loads(gen_file.read_text()).get("eos_token_id"))
    eos = cfg.eos_token_ids + tuple(e for e in extra if e not in cfg.eos_token_ids)
    cfg = cfg.replace(eos_token_ids=eos)
  tensors: dict[str, np.ndarray] = {}
  for file in _safetensors_files(path):
    for name, w in safetensors.numpy.load_file(str(file)).items():
      if name in tensors:
        raise ValueError(f"tensor {name!r} appears in more than one shard (again in {file.name})")
      tensors[name] = w
  if hf_config.get("model_type") == "gemma3":
    tensors = _gemma3_text_tensors(tensors)
  return cfg, model_from_hf_tensors(cfg, tensors)
