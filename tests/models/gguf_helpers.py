"""Writes tiny GGUF files from HF-form checkpoints the way llama.cpp's converter does.

Independent of ``models.loaders.gguf`` on purpose (its own name table and its own
copy of llama.cpp's q/k permutation), so a round trip checks the loader against the
converter's conventions rather than against itself:

- llama: ``LlamaModel.permute`` on ``q_proj``/``k_proj`` rows (from
  ``convert_hf_to_gguf.py``: ``w.reshape(n_head, 2, rows // n_head // 2, *rest)
  .swapaxes(1, 2).reshape(w.shape)``);
- gemma3: ``+ 1`` on every ``*norm.weight``;
- tied embeddings: no ``output.weight``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import gguf
import numpy as np

__all__ = ["ARCH_OF", "chatml_template", "random_hf_checkpoint", "tiny_hf_config", "write_gguf"]

ARCH_OF = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3"}

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\n' }}{% endif %}")


def chatml_template() -> str:
  return CHATML


def tiny_hf_config(model_type: str, vocab_size: int = 64, tied: bool = False) -> dict:
  """An HF-style config dict of a 2-3 layer model (D=32, N=4, K=2, H=8, F=48)."""
  cfg = {
      "model_type": model_type,
      "vocab_size": vocab_size,
      "hidden_size": 32,
      "intermediate_size": 48,
      "num_hidden_layers": 3,
      "num_attention_heads": 4,
      "num_key_value_heads": 2,
      "head_dim": 8,
      "rms_norm_eps": 1e-5,
      "rope_theta": 5000.0,
      "max_position_embeddings": 128,
      "tie_word_embeddings": tied,
  }
  if model_type == "gemma3_text":
    cfg.update(num_hidden_layers=7, sliding_window=16, rope_local_base_freq=10000.0,
               query_pre_attn_scalar=8, tie_word_embeddings=True)
  return cfg


def random_hf_checkpoint(cfg: Mapping, seed: int = 0) -> dict[str, np.ndarray]:
  """Random ``f32`` HF tensors with HF names and ``[out, in]`` layouts."""
  rng = np.random.default_rng(seed)
  d, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
  n, k, h = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
  mt = cfg["model_type"]
  r = lambda *shape: rng.standard_normal(shape).astype(np.float32)
  t = {"model.embed_tokens.weight": r(v, d), "model.norm.weight": r(d)}
  if not cfg["tie_word_embeddings"]:
    t["lm_head.weight"] = r(v, d)
  for i in range(cfg["num_hidden_layers"]):
    p = f"model.layers.{i}."
    t.update({
        p + "input_layernorm.weight": r(d),
        p + "post_attention_layernorm.weight": r(d),
        p + "self_attn.q_proj.weight": r(n * h, d),
        p + "self_attn.k_proj.weight": r(k * h, d),
        p + "self_attn.v_proj.weight": r(k * h, d),
        p + "self_attn.o_proj.weight": r(d, n * h),
        p + "mlp.gate_proj.weight": r(f, d),
        p + "mlp.up_proj.weight": r(f, d),
        p + "mlp.down_proj.weight": r(d, f),
    })
    if mt == "qwen2":
      t.update({p + "self_attn.q_proj.bias": r(n * h), p + "self_attn.k_proj.bias": r(k * h),
                p + "self_attn.v_proj.bias": r(k * h)})
    if mt in ("qwen3", "gemma3_text"):
      t.update({p + "self_attn.q_norm.weight": r(h), p + "self_attn.k_norm.weight": r(h)})
    if mt == "gemma3_text":
      t.update({p + "pre_feedforward_layernorm.weight": r(d),
                p + "post_feedforward_layernorm.weight": r(d)})
  return t


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
  return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
          .swapaxes(1, 2).reshape(w.shape))


def _gguf_name(hf: str, model_type: str) -> str:
  top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
         "lm_head.weight": "output.weight"}
  if hf in top:
    return top[hf]
  _, _, i, rest = hf.split(".", 3)
  table = {
      "input_layernorm.weight": "attn_norm.weight",
      "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
      "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
      "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
      "self_attn.o_proj.weight": "attn_output.weight",
      "self_attn.q_norm.weight": "attn_q_norm.weight",
      "self_attn.k_norm.weight": "attn_k_norm.weight",
      "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
      "mlp.down_proj.weight": "ffn_down.weight",
      "pre_feedforward_layernorm.weight": "ffn_norm.weight",
      "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
      "post_attention_layernorm.weight": ("post_attention_norm.weight"
                                          if model_type == "gemma3_text" else "ffn_norm.weight"),
  }
  return f"blk.{i}.{table[rest]}"


def write_gguf(
    path,
    cfg: Mapping | None = None,
    tensors: Mapping[str, np.ndarray] | None = None,
    *,
    arch: str | None = None,
    tokens: Sequence[str] | None = None,
    token_types: Sequence[int] | None = None,
    merges: Sequence[str] | None = None,
    scores: Sequence[float] | None = None,
    tokenizer_model: str = "gpt2",
    tokenizer_pre: str | None = "smollm",
    bos: int | None = None,
    eos: int = 0,
    unk: int | None = None,
    add_bos: bool | None = None,
    chat_template: str | None = None,
    quantize: gguf.GGMLQuantizationType | None = None,
) -> None:
  """Writes ``tensors`` (HF names/layouts) and tokenizer metadata as llama.cpp would.

  ``cfg`` None writes a tokenizer-only file (architecture ``arch``, no tensors).
  ``quantize`` stores 2-D weights whose input dim is a multiple of 32 in that type.
  """
  model_type = cfg["model_type"] if cfg else None
  arch = arch or ARCH_OF[model_type]
  w = gguf.GGUFWriter(str(path), arch=arch)
  if cfg:
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if model_type == "llama":
      w.add_rope_dimension_count(cfg["head_dim"])
      w.add_vocab_size(cfg["vocab_size"])
    else:
      w.add_key_length(cfg["head_dim"])
      w.add_value_length(cfg["head_dim"])
    if model_type == "gemma3_text":
      w.add_sliding_window(cfg["sliding_window"])
  if tokens is not None:
    w.add_tokenizer_model(tokenizer_model)
    if tokenizer_pre is not None:
      w.add_tokenizer_pre(tokenizer_pre)
    w.add_token_list(list(tokens))
    if scores is not None:
      w.add_token_scores(list(scores))
    w.add_token_types(list(token_types) if token_types is not None else [1] * len(tokens))
    if merges is not None:
      w.add_token_merges(list(merges))
    if bos is not None:
      w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    if unk is not None:
      w.add_unk_token_id(unk)
    if add_bos is not None:
      w.add_add_bos_token(add_bos)
    w.add_add_space_prefix(False)
    if chat_template is not None:
      w.add_chat_template(chat_template)
  for name, t in (tensors or {}).items():
    t = np.asarray(t, np.float32)
    if model_type == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
      heads = cfg["num_attention_heads"] if "q_proj" in name else cfg["num_key_value_heads"]
      t = _llama_cpp_permute(t, heads)
    if model_type == "gemma3_text" and name.endswith("norm.weight"):
      t = t + 1.0
    gname = _gguf_name(name, model_type)
    if quantize is not None and t.ndim == 2 and t.shape[1] % 32 == 0:
      q = gguf.quants.quantize(t, quantize)
      w.add_tensor(gname, q, raw_shape=q.shape, raw_dtype=quantize)
    else:
      w.add_tensor(gname, t)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
