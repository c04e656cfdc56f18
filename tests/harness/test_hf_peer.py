"""The HF peer loads the same local weights and agrees with specjax's greedy AR."""

import types

import pytest

from harness import hf_peer
from methods.registry import make_method
from models.loaders.hf_safetensors import load_hf_directory
from specjax.config import EngineConfig, SamplingParams
from specjax.engine import Engine
from specjax.request import Request


@pytest.mark.slow  # ~75 s on a loaded 2-core CPU (torch import, two generate variants)
def test_hf_peer_agrees_with_specjax_ar(tmp_path, monkeypatch):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  torch.manual_seed(0)
  config = transformers.LlamaConfig(
      vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
      tie_word_embeddings=False, eos_token_id=None, bos_token_id=None)
  model = transformers.LlamaForCausalLM(config).eval()
  with torch.no_grad():  # O(1) logits: varied greedy outputs, no near-ties
    model.lm_head.weight.mul_(8.0)
  model.save_pretrained(tmp_path)
  _, target = load_hf_directory(tmp_path)
  engine = Engine(target, make_method("ar", 0),
                  EngineConfig(max_num_seqs=1, max_model_len=64, page_size=8))
  sp = SamplingParams(max_tokens=12, ignore_eos=True)
  requests = [Request(i, tuple(int(t) for t in torch.randint(0, 64, (9,))), sp)
              for i in range(3)]
  outs, _ = engine.generate(requests)
  records = [{"method": "ar", "batch_size": 1, "repeat": 0, "request_id": o.request_id,
              "output_token_ids": o.output_token_ids} for o in outs]
  monkeypatch.setattr(hf_peer, "hf_checkpoint_dir", lambda target: str(tmp_path))
  cfg = types.SimpleNamespace(target="tiny", dtype="float32", ignore_eos=True, batch_sizes=(1,),
                              max_new_tokens=12, num_speculative_tokens=3)
  df = hf_peer.run_peer(cfg, requests, records)
  assert df.peer.tolist() == ["hf_greedy", "hf_prompt_lookup"]
  assert (df.num_output_tokens == 36).all() and (df.tokens_per_s > 0).all()
  assert df.exact_match_vs_specjax_ar.tolist() == [1.0, 1.0]
  assert df.prefix_agreement_vs_specjax_ar.tolist() == [1.0, 1.0]


def test_agreement_counts_leading_matches():
  assert hf_peer._agreement([[1, 2, 3, 4]], [[1, 2, 9, 4]]) == (0.0, 0.5)
  with pytest.raises(ValueError, match="random weights"):
    hf_peer.hf_checkpoint_dir("random:tiny")
