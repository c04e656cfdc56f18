"""The head registry and the checkpoint format of every head kind (no compiles).

The parameter paths and config keys below are the ones heads were saved with before the
heads became a package; a head directory written then must still load.
"""

import dataclasses
import json

import jax
import numpy as np
import pytest
from flax import nnx

import models.heads
from models.heads import (
    HEAD_CLASSES,
    HEAD_KINDS,
    DraftHead,
    EagleHead,
    HeadConfig,
    head_class,
    make_head,
)
from models.testing import tiny_config

_LAYER = ["layer/down", "layer/ffn_norm", "layer/gate", "layer/k", "layer/o", "layer/q",
          "layer/up", "layer/v"]
_MTP_MODULE = ["attn_norm", "embed_norm", "hidden_norm", *_LAYER, "out_norm", "proj"]
PARAM_PATHS = {
    "eagle": ["attn_norm", "fc", *_LAYER],
    "eagle3": ["embed_norm", "fc", "hidden_norm", *_LAYER, "out_norm"],
    "mtp": [f"modules/{j}/{p}" for j in range(2) for p in _MTP_MODULE],
    "medusa": ["blocks/0/b", "blocks/0/w", "blocks/1/b", "blocks/1/w"],
    "early_exit": ["proj", "scale"],
}
CONFIG_KEYS = ["draft_vocab_size", "feature_layers", "head_dim", "hidden_size",
               "intermediate_size", "kind", "num_heads", "num_kv_heads", "num_modules",
               "rms_norm_eps", "rope_scaling", "rope_theta", "vocab_size", "window"]


def _paths(head):
  flat = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(head, nnx.Param)))[0]
  return sorted("/".join(str(getattr(k, "key", k)) for k in path) for path, _ in flat)


def test_registry_names_every_kind_once():
  assert HEAD_KINDS == ("eagle", "eagle3", "mtp", "medusa", "early_exit")
  assert tuple(HEAD_CLASSES) == HEAD_KINDS
  assert all(issubclass(c, DraftHead) for c in HEAD_CLASSES.values())
  assert issubclass(head_class("eagle"), EagleHead) and issubclass(head_class("eagle3"), EagleHead)
  with pytest.raises(ValueError, match="kind='nope' must be one of"):
    head_class("nope")
  with pytest.raises(ValueError, match="kind='nope' must be one of"):
    HeadConfig.for_target("nope", tiny_config("llama"))


@pytest.mark.parametrize("kind", HEAD_KINDS)
def test_each_kind_keeps_its_param_tree_and_config_keys(kind):
  extra = {"num_modules": 2} if head_class(kind).has_modules else {}
  cfg = HeadConfig.for_target(kind, tiny_config("llama"), **extra)
  head = make_head(cfg, seed=0)
  assert type(head) is head_class(kind)
  assert _paths(head) == sorted(PARAM_PATHS[kind])
  assert sorted(json.loads(cfg.to_json())) == CONFIG_KEYS
  assert HeadConfig.from_json(cfg.to_json()) == cfg


def test_reduced_vocab_eagle3_adds_lm_head_and_only_eagle3_may():
  target = tiny_config("llama")
  cfg = HeadConfig.for_target("eagle3", target, draft_vocab_size=8)
  head = make_head(cfg, 0, np.arange(8) * 3)
  assert _paths(head) == sorted([*PARAM_PATHS["eagle3"], "lm_head"])
  with pytest.raises(ValueError, match="draft_vocab_size=8 is only for kind='eagle3'"):
    HeadConfig.for_target("eagle", target, draft_vocab_size=8)
  with pytest.raises(ValueError, match="draft_to_target is only for eagle3 heads"):
    make_head(dataclasses.replace(cfg, kind="mtp", feature_layers=(2,),
                                  draft_vocab_size=None), 0, np.arange(8))


def test_a_class_rejects_a_config_of_another_kind():
  cfg = HeadConfig.for_target("medusa", tiny_config("llama"))
  with pytest.raises(ValueError, match="kind='medusa' must name MTPHead"):
    head_class("mtp")(cfg, np.random.default_rng(0))


def test_package_exports_resolve():
  assert all(hasattr(models.heads, name) for name in models.heads.__all__)


def test_every_registered_class_names_its_own_kind():
  for name, cls in HEAD_CLASSES.items():
    assert cls.kind == name
