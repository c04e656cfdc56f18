"""Learned draft heads (Flax NNX): one class per kind behind one interface (``DraftHead``).

Kinds (``HEAD_KINDS``; ``registry.HEAD_CLASSES`` maps each name to its class):
  * ``"eagle"``, ``"eagle3"``: EAGLE-1 and EAGLE-3 (``eagle.py``; ``Eagle1Head``,
    ``Eagle3Head``, both ``EagleHead``).
  * ``"mtp"``: DeepSeek-V3 multi-token prediction (``mtp.py``; ``MTPHead``).
  * ``"medusa"``: Medusa-1 (``medusa.py``; ``MedusaHead``).
  * ``"early_exit"``: the LayerSkip exit adapter (``early_exit.py``; ``EarlyExitHead``).

Every head reads target features and shares the target's token embedding and LM head
(EAGLE-3 may instead own a reduced-vocabulary LM head with a draft -> target id map).
The target is passed to each call; the head never stores it. The modules: ``base``
(the interface), ``blocks`` (attention and decoder layer shared by kinds), ``vocab``
(EAGLE-3's draft -> target map), ``config`` (``HeadConfig``), ``registry`` (name ->
class, ``make_head``), ``checkpoint`` (``save_head`` / ``load_head``).
"""

from models.heads.base import DraftFn, DraftHead
from models.heads.blocks import HeadLayer, band_mask, dense_attention
from models.heads.checkpoint import load_head, num_params, save_head
from models.heads.config import HeadConfig
from models.heads.eagle import (
    Eagle1Head,
    Eagle3Head,
    EagleHead,
    default_eagle3_layers,
    restrict_draft_vocab,
)
from models.heads.early_exit import EarlyExitHead
from models.heads.medusa import MedusaHead
from models.heads.mtp import MTPHead
from models.heads.registry import HEAD_CLASSES, HEAD_KINDS, head_class, make_head
from models.heads.vocab import VocabMap, validate_vocab_map

__all__ = [
    "HEAD_CLASSES",
    "HEAD_KINDS",
    "DraftFn",
    "DraftHead",
    "Eagle1Head",
    "Eagle3Head",
    "EagleHead",
    "EarlyExitHead",
    "HeadConfig",
    "HeadLayer",
    "MTPHead",
    "MedusaHead",
    "VocabMap",
    "band_mask",
    "default_eagle3_layers",
    "dense_attention",
    "head_class",
    "load_head",
    "make_head",
    "num_params",
    "restrict_draft_vocab",
    "save_head",
    "validate_vocab_map",
]
