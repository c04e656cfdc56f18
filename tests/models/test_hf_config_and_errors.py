"""config_from_hf field mapping and the loader's refusals (no forward passes, no torch)."""

import json

import numpy as np
import pytest
import safetensors.numpy

from models import testing
from models.loaders.hf_safetensors import (
    config_from_hf,
    hf_param_table,
    load_hf_directory,
    model_from_hf_tensors,
)

_BASE = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5)


def _tensors(cfg, seed=0):
  rng = np.random.default_rng(seed)
  return {s.name: rng.standard_normal(s.shape).astype(np.float32) for s in hf_param_table(cfg)}


# --- config_from_hf ----------------------------------------------------------------------


def test_unknown_model_type_names_it_and_the_allowed_ones():
  with pytest.raises(ValueError, match=r"model_type='mistral'.*llama.*qwen2.*qwen3.*gemma3_text"):
    config_from_hf({**_BASE, "model_type": "mistral"})
  with pytest.raises(ValueError, match="model_type=None"):
    config_from_hf(dict(_BASE))


def test_llama_5x_config():
  cfg = config_from_hf({**_BASE, "model_type": "llama", "rope_parameters": {
      "rope_type": "default", "rope_theta": 500000.0}, "eos_token_id": [5, 7],
      "bos_token_id": 3, "tie_word_embeddings": True}, dtype="bfloat16")
  assert (cfg.family, cfg.head_dim, cfg.num_kv_heads, cfg.rope_theta) == ("llama", 8, 2, 5e5)
  assert cfg.rope_scaling is None and cfg.sliding_window is None and not cfg.attention_bias
  assert (cfg.eos_token_ids, cfg.bos_token_id, cfg.tie_word_embeddings) == ((5, 7), 3, True)
  assert cfg.rms_norm_eps == 1e-5 and cfg.dtype == "bfloat16" and cfg.hidden_act == "silu"


def test_llama3_rope_scaling_4x_and_5x_layouts_agree():
  scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
             "original_max_position_embeddings": 8192}
  old = config_from_hf({**_BASE, "model_type": "llama", "rope_theta": 5e5,
                        "rope_scaling": {"type": "llama3", **scaling}})
  new = config_from_hf({**_BASE, "model_type": "llama", "rope_parameters": {
      "rope_type": "llama3", "rope_theta": 5e5, **scaling}})
  assert old == new
  assert dict(new.rope_scaling) == {"rope_type": "llama3", **scaling}
  assert new.rope_theta == 5e5


def test_qwen_families():
  q2 = config_from_hf({**_BASE, "model_type": "qwen2", "sliding_window": 4096,
                       "use_sliding_window": False, "max_window_layers": 1})
  assert q2.attention_bias and not q2.qk_norm and q2.sliding_window is None
  q3 = config_from_hf({**_BASE, "model_type": "qwen3"})
  assert q3.qk_norm and not q3.attention_bias and q3.head_dim == 128  # Qwen3Config default
  assert config_from_hf({**_BASE, "model_type": "qwen3", "head_dim": 16}).head_dim == 16


_GEMMA_5X = {**_BASE, "model_type": "gemma3_text", "num_hidden_layers": 5, "head_dim": 8,
             "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 16,
             "sliding_window": 4, "final_logit_softcapping": None,
             "attn_logit_softcapping": None,
             "layer_types": ["sliding_attention", "sliding_attention", "full_attention",
                             "sliding_attention", "sliding_attention"],
             "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                 "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                    "rope_theta": 1e6}}}


def test_gemma3_text_5x_config():
  cfg = config_from_hf(_GEMMA_5X)
  assert cfg.family == "gemma3" and cfg.hidden_act == "gelu_tanh"
  assert cfg.qk_norm and cfg.sandwich_norms and cfg.norm_plus_one and cfg.scale_embeddings
  assert (cfg.sliding_window, cfg.global_every) == (4, 3)
  assert [cfg.is_local_layer(i) for i in range(5)] == [True, True, False, True, True]
  assert (cfg.rope_theta, cfg.rope_local_theta) == (1e6, 1e4)
  assert dict(cfg.rope_scaling) == {"rope_type": "linear", "factor": 8.0}
  assert cfg.query_pre_attn_scalar == 16 and cfg.sm_scale == 0.25
  assert cfg.tie_word_embeddings and cfg.eos_token_ids == (1,) and cfg.bos_token_id == 2


def test_gemma3_4x_layout_and_multimodal_wrapper_agree_with_5x():
  old = {k: v for k, v in _GEMMA_5X.items() if k not in ("layer_types", "rope_parameters")}
  old.update(sliding_window_pattern=3, rope_theta=1e6, rope_local_base_freq=1e4,
             rope_scaling={"rope_type": "linear", "factor": 8.0})
  assert config_from_hf(old) == config_from_hf(_GEMMA_5X)
  wrapped = {"model_type": "gemma3", "eos_token_id": [1, 106],
             "text_config": {k: v for k, v in _GEMMA_5X.items() if k != "model_type"}}
  cfg = config_from_hf(wrapped)
  assert cfg == config_from_hf(_GEMMA_5X).replace(eos_token_ids=(1, 106))


def test_gemma3_pattern_longer_than_the_model_is_all_local():
  cfg = config_from_hf({**{k: v for k, v in _GEMMA_5X.items() if k != "layer_types"},
                        "sliding_window_pattern": 6})
  assert all(cfg.is_local_layer(i) for i in range(5))


@pytest.mark.parametrize("change, match", [
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
    ({"attention_bias": True}, "attention_bias"),
    ({"layer_types": ["full_attention", "sliding_attention", "sliding_attention",
                      "full_attention", "sliding_attention"]}, "layer_types"),
    ({"layer_types": ["full_attention"] * 4}, "layer_types"),
    ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 4.0}}}, "yarn"),
    ({"hidden_activation": "relu"}, "relu"),
])
def test_gemma3_unsupported_features_are_refused(change, match):
  with pytest.raises(ValueError, match=match):
    config_from_hf({**_GEMMA_5X, **change})


@pytest.mark.parametrize("model_type, change, match", [
    ("llama", {"attention_bias": True}, "attention_bias"),
    ("llama", {"mlp_bias": True}, "mlp_bias"),
    ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic"),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 2.0}}, "low_freq_factor"),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
     "layer_types"),
    ("qwen3", {"attention_bias": True}, "attention_bias"),
])
def test_llama_qwen_unsupported_features_are_refused(model_type, change, match):
  with pytest.raises(ValueError, match=match):
    config_from_hf({**_BASE, "model_type": model_type, **change})


# --- model_from_hf_tensors ---------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma3"])
def test_table_places_every_tensor(family):
  cfg = testing.tiny_config(family)
  tensors = _tensors(cfg)
  model = model_from_hf_tensors(cfg, tensors)
  d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  layer = model.layers[1]
  pre = "model.layers.1."
  np.testing.assert_array_equal(
      layer.q[...], tensors[pre + "self_attn.q_proj.weight"].T.reshape(d, n, h))
  # Head j of the einsum-ready weight is rows j*H .. (j+1)*H of the HF weight.
  np.testing.assert_array_equal(
      layer.k[...][:, 1, :], tensors[pre + "self_attn.k_proj.weight"][h:2 * h].T)
  np.testing.assert_array_equal(
      layer.o[...][1], tensors[pre + "self_attn.o_proj.weight"][:, h:2 * h].T)
  np.testing.assert_array_equal(layer.down[...], tensors[pre + "mlp.down_proj.weight"].T)
  ffn_name = "pre_feedforward_layernorm" if family == "gemma3" else "post_attention_layernorm"
  np.testing.assert_array_equal(layer.ffn_norm[...], tensors[pre + ffn_name + ".weight"])
  if family == "gemma3":
    np.testing.assert_array_equal(layer.post_attn_norm[...],
                                  tensors[pre + "post_attention_layernorm.weight"])
  if cfg.attention_bias:
    np.testing.assert_array_equal(layer.v_bias[...],
                                  tensors[pre + "self_attn.v_proj.bias"].reshape(k, h))
  if not cfg.tie_word_embeddings:
    np.testing.assert_array_equal(model.lm_head[...], tensors["lm_head.weight"].T)


def test_wrong_shape_names_the_tensor_and_both_shapes():
  cfg = testing.tiny_config("llama")
  tensors = _tensors(cfg)
  tensors["model.layers.1.self_attn.k_proj.weight"] = np.zeros((32, 32), np.float32)
  with pytest.raises(ValueError, match=r"'model\.layers\.1\.self_attn\.k_proj\.weight' has "
                                       r"shape \(32, 32\), expected \(16, 32\)"):
    model_from_hf_tensors(cfg, tensors)


def test_missing_tensor_is_named():
  cfg = testing.tiny_config("qwen2")
  tensors = _tensors(cfg)
  del tensors["model.layers.0.self_attn.q_proj.bias"]
  with pytest.raises(ValueError, match=r"missing 1 tensor.*model\.layers\.0\.self_attn\.q_proj"):
    model_from_hf_tensors(cfg, tensors)


def test_unexpected_tensor_is_named_but_rotary_buffers_are_ignored():
  cfg = testing.tiny_config("llama")
  tensors = _tensors(cfg)
  tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(4, np.float32)
  model_from_hf_tensors(cfg, tensors)
  tensors["model.layers.0.mlp.gate_proj.bias"] = np.ones(64, np.float32)
  with pytest.raises(ValueError, match=r"does not use.*mlp\.gate_proj\.bias"):
    model_from_hf_tensors(cfg, tensors)


def test_tied_lm_head_is_accepted_but_shape_checked():
  cfg = testing.tiny_config("gemma3")
  tensors = _tensors(cfg)
  tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
  model_from_hf_tensors(cfg, tensors)
  tensors["lm_head.weight"] = np.zeros((3, 3), np.float32)
  with pytest.raises(ValueError, match="'lm_head.weight' has shape"):
    model_from_hf_tensors(cfg, tensors)


# --- load_hf_directory -------------------------------------------------------------------


def test_missing_directory_and_config(tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    load_hf_directory(tmp_path / "nope")
  with pytest.raises(FileNotFoundError, match="no config.json"):
    load_hf_directory(tmp_path)
  (tmp_path / "config.json").write_text(json.dumps({**_BASE, "model_type": "llama"}))
  with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
    load_hf_directory(tmp_path)


def test_sharded_bf16_checkpoint_with_generation_config(tmp_path):
  hf = {**_BASE, "model_type": "qwen3", "head_dim": 8, "eos_token_id": 2}
  cfg = config_from_hf(hf)
  tensors = _tensors(cfg)
  names = sorted(tensors)
  shards = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
  for file, part in shards.items():
    safetensors.numpy.save_file({n: tensors[n] for n in part}, str(tmp_path / file))
  (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
      {"weight_map": {n: f for f, part in shards.items() for n in part}}))
  (tmp_path / "config.json").write_text(json.dumps(hf))
  (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 9]}))
  cfg, model = load_hf_directory(tmp_path, dtype="bfloat16")
  assert cfg.eos_token_ids == (2, 9) and cfg.dtype == "bfloat16"
  assert model.layers[0].q[...].dtype == np.dtype("bfloat16")
  np.testing.assert_array_equal(
      np.asarray(model.embed[...], np.float32),
      tensors["model.embed_tokens.weight"].astype("bfloat16").astype(np.float32))
  # The same tensor in two shards is refused.
  safetensors.numpy.save_file({names[0]: tensors[names[0]]}, str(tmp_path / "c.safetensors"))
  (tmp_path / "model.safetensors.index.json").unlink()
  with pytest.raises(ValueError, match="more than one shard"):
    load_hf_directory(tmp_path)


def test_gemma3_multimodal_checkpoint_loads_its_text_tower(tmp_path):
  text = {k: v for k, v in _GEMMA_5X.items() if k != "model_type"}
  cfg = config_from_hf(_GEMMA_5X)
  tensors = _tensors(cfg)
  renamed = {"model.language_model." + n.removeprefix("model."): w for n, w in tensors.items()}
  renamed["model.vision_tower.encoder.weight"] = np.ones(3, np.float32)
  renamed["model.multi_modal_projector.mm_input_projection_weight"] = np.ones(3, np.float32)
  safetensors.numpy.save_file(renamed, str(tmp_path / "model.safetensors"))
  (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3", "text_config": text}))
  loaded_cfg, model = load_hf_directory(tmp_path)
  assert loaded_cfg == cfg
  np.testing.assert_array_equal(model.layers[4].post_ffn_norm[...],
                                tensors["model.layers.4.post_feedforward_layernorm.weight"])
