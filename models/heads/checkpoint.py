"""Saving and loading a head directory: ``head_config.json``, ``params/`` (orbax) and, for
a reduced-vocabulary EAGLE-3 head, ``vocab_map.npy``; and counting a head's parameters."""

from __future__ import annotations

import math
import os

import jax
import numpy as np
from flax import nnx

from models.config import ModelConfig
from models.heads.base import DraftHead
from models.heads.config import HeadConfig
from models.heads.registry import make_head
from models.heads.vocab import validate_vocab_map

__all__ = ["load_head", "num_params", "save_head"]

_CONFIG_FILE, _MAP_FILE, _PARAMS_DIR = "head_config.json", "vocab_map.npy", "params"


def save_head(path: str, head: DraftHead) -> None:
  """Writes ``head_config.json``, ``params/`` (orbax) and, for a reduced-vocabulary
  EAGLE-3 head, ``vocab_map.npy`` (``i32[V_draft]`` draft -> target ids)."""
  import orbax.checkpoint as ocp  # noqa: PLC0415

  path = os.path.abspath(path)
  os.makedirs(path, exist_ok=True)
  cfg = head.cfg
  with open(os.path.join(path, _CONFIG_FILE), "w") as f:
    f.write(cfg.to_json())
  params = nnx.to_pure_dict(nnx.state(head, nnx.Param))
  with ocp.StandardCheckpointer() as ckpt:
    ckpt.save(os.path.join(path, _PARAMS_DIR), params, force=True)
  if cfg.draft_vocab_size is not None:
    np.save(os.path.join(path, _MAP_FILE), np.asarray(head.d2t[...]))


def load_head(path: str, target: ModelConfig | None = None) -> DraftHead:
  """Reads a head written by ``save_head``.

  Args:
    path: the head directory.
    target: if given, the head must fit it (``HeadConfig.check_target``).

  Raises:
    ValueError: no config; a reduced-vocabulary EAGLE-3 head whose ``vocab_map.npy``
      is missing or inconsistent; a head that does not fit ``target``.
  """
  import orbax.checkpoint as ocp  # noqa: PLC0415

  path = os.path.abspath(path)
  cfg_file = os.path.join(path, _CONFIG_FILE)
  if not os.path.exists(cfg_file):
    raise ValueError(f"{path=} must contain {_CONFIG_FILE}")
  with open(cfg_file) as f:
    cfg = HeadConfig.from_json(f.read())
  if target is not None:
    cfg.check_target(target)
  d2t = None
  if cfg.draft_vocab_size is not None:
    map_file = os.path.join(path, _MAP_FILE)
    if not os.path.exists(map_file):
      raise ValueError(f"head at {path=} has draft_vocab_size={cfg.draft_vocab_size} but no "
                       f"draft -> target map ({_MAP_FILE})")
    d2t = validate_vocab_map(np.load(map_file), cfg.draft_vocab_size, cfg.vocab_size)
  head = make_head(cfg, 0, d2t)
  abstract = nnx.to_pure_dict(nnx.state(head, nnx.Param))
  with ocp.StandardCheckpointer() as ckpt:
    params = ckpt.restore(os.path.join(path, _PARAMS_DIR), abstract)
  state = nnx.state(head, nnx.Param)
  nnx.replace_by_pure_dict(state, params)
  nnx.update(head, state)
  return head


def num_params(head: nnx.Module) -> int:
  """Trainable parameter count."""
  return sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(head, nnx.Param)))
