"""KV-cache memory per token of context: the target's, and what each SD method adds.

The target's paged KV holds, per token and per layer, one key and one value vector per
KV head: ``num_layers * 2 * num_kv_heads * head_dim * itemsize`` bytes (the layout of
``models.llama.init_kv_caches``: ``[num_pages, page_size, 2K, H]`` per layer). Example:
Llama-3-8B in bf16 is ``32 * 2 * 8 * 128 * 2 = 131,072`` bytes (128 KiB) per token.

What a method adds is read from its declared capabilities and config, never from its
name (``method_memory``):
  * ``Capabilities.needs_draft_model``: the draft model's own paged KV, per token of
    context (``methods.draft_model`` shares the target's page table, so one draft KV
    slot per target slot). Qwen3-0.6B drafting for Qwen3-8B (bf16): 114,688 + 147,456
    bytes, 1.78 x the target alone (the seed paper's "1.77x").
  * ``Capabilities.target_hidden_layers`` (learned heads, ``methods.learned``): fused
    (``runs_on == "fused"``), a device feature pool paged like the KV, ``len(layers) *
    hidden_size * itemsize`` bytes per token of context (``methods.learned.FeaturePool``);
    host-called, per sequence a host buffer of ``window * len(layers) * hidden_size * 4``
    bytes (f32).
  * Host n-gram lookup keeps nothing beyond the token ids the scheduler already holds.
  * Suffix trees (SuffixDecoding, methods_reference.md 1.1): host memory; estimated by
    ``suffix_tree_bytes_per_token`` when the method config has a ``max_depth`` field
    (one node per inserted suffix position, up to ``max_depth`` per token, of
    ``node_bytes`` each: an upper bound, shared prefixes make it smaller).
"""

from __future__ import annotations

import dataclasses
import math

from models.config import ModelConfig
from specjax.method import Method

__all__ = ["MethodMemory", "dtype_bytes", "kv_tokens_that_fit", "method_kv_bytes_per_token",
           "memory_table", "method_memory",
           "suffix_tree_bytes_per_token", "target_kv_bytes_per_token"]

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "int8": 1}

# Bytes of one suffix-tree node (token id, count, parent/child links, a small child map):
# an estimate, not a measurement.
SUFFIX_NODE_BYTES = 64


def dtype_bytes(dtype: str) -> int:
  """Bytes per element of a dtype name, e.g. ``"bfloat16" -> 2``.

  Raises:
    ValueError: an unknown dtype name.
  """
  if dtype not in _DTYPE_BYTES:
    raise ValueError(f"{dtype=} must be one of {sorted(_DTYPE_BYTES)}")
  return _DTYPE_BYTES[dtype]


def target_kv_bytes_per_token(cfg: ModelConfig, dtype: str | None = None) -> int:
  """``num_layers * 2 * num_kv_heads * head_dim * itemsize`` (``dtype`` defaults to
  ``cfg.dtype``)."""
  return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * dtype_bytes(dtype or cfg.dtype)


def suffix_tree_bytes_per_token(max_depth: int, node_bytes: int = SUFFIX_NODE_BYTES) -> int:
  """Upper-bound host bytes per history token of a suffix tree of depth ``max_depth``."""
  if max_depth < 1:
    raise ValueError(f"{max_depth=} must be >= 1")
  return max_depth * node_bytes


@dataclasses.dataclass(frozen=True)
class MethodMemory:
  """Memory of one method next to its target.

  Attributes:
    target_per_token: bytes of target KV per context token (device).
    extra_per_token: name -> extra bytes per context token (device unless named host_*).
    extra_per_sequence: name -> bytes per running sequence, independent of its length.
  """

  target_per_token: int
  extra_per_token: dict
  extra_per_sequence: dict

  @property
  def device_per_token(self) -> int:
    """Target KV plus the method's device bytes per token (host_* entries excluded)."""
    return self.target_per_token + sum(
        v for k, v in self.extra_per_token.items() if not k.startswith("host_"))

  @property
  def ratio_to_target(self) -> float:
    """``device_per_token / target_per_token``."""
    return self.device_per_token / self.target_per_token


def method_memory(method: Method, target: ModelConfig, draft: ModelConfig | None = None,
                  dtype: str | None = None) -> MethodMemory:
  """Memory of ``method`` running on ``target`` (and ``draft``); see the module docstring.

  Raises:
    ValueError: the method needs a draft model and ``draft`` is None.
  """
  caps = method.capabilities()
  per_token, per_seq = {}, {}
  if caps.needs_draft_model:
    if draft is None:
      raise ValueError(f"method {method.name!r} needs a draft model: draft=None")
    per_token["draft_kv"] = target_kv_bytes_per_token(draft, dtype)
  config = method.describe()
  if caps.target_hidden_layers and caps.runs_on == "fused":
    per_token["device_features"] = (len(caps.target_hidden_layers) * target.hidden_size
                                    * dtype_bytes(dtype or target.dtype))
  elif caps.target_hidden_layers:
    window = int(getattr(method, "drafting_window", None) or config.get("window") or 1)
    per_seq["host_features"] = (window * len(caps.target_hidden_layers) * target.hidden_size
                                * 4)
  if "max_depth" in config:
    per_token["host_suffix_tree"] = suffix_tree_bytes_per_token(int(config["max_depth"]))
  return MethodMemory(target_kv_bytes_per_token(target, dtype), per_token, per_seq)


def method_kv_bytes_per_token(method: Method, runtime) -> int:
  """Device KV bytes per context token of ``method`` with the engine's models.

  ``runtime`` is a ``specjax.method.RuntimeInfo`` (``Engine.runtime``): its ``target``
  and ``draft`` carry ``.config``. This is the ``kv_bytes_per_token`` column of
  ``harness.evaluation`` rows.
  """
  draft = runtime.draft.config if runtime.draft is not None else None
  return method_memory(method, runtime.target.config, draft).device_per_token


def kv_tokens_that_fit(memory: MethodMemory, hbm_bytes: float, weight_bytes: float) -> int:
  """Context tokens whose device KV fits in ``hbm_bytes - weight_bytes``."""
  return max(0, math.floor((hbm_bytes - weight_bytes) / memory.device_per_token))


# (target shape, draft shape or None) pairs of the table: the seed paper's Qwen3 pair and
# the zoo's same-tokenizer pairs.
DEFAULT_PAIRS = (("qwen3-8b", "qwen3-0.6b"), ("llama3-8b", "llama3.2-1b"),
                 ("llama3.3-70b", "llama3.2-1b"), ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"),
                 ("smollm2-135m", None))


def memory_table(pairs=DEFAULT_PAIRS, method_names=("ar", "ngram", "draft_model", "eagle3"),
                 dtype: str | None = None, k: int = 4):
  """One row per (target, method): bytes per token and the ratio to the target's KV.

  ``pairs`` are ``models.shapes.SHAPES`` names; ``draft_model`` rows are skipped for a
  pair without a draft; learned heads get EAGLE-3's three feature layers (2, L/2, L-3)
  and their default window. Returns a ``pandas.DataFrame``.
  """
  import pandas as pd  # noqa: PLC0415

  from methods.registry import make_method  # noqa: PLC0415
  from models.shapes import SHAPES  # noqa: PLC0415

  rows = []
  for target_name, draft_name in pairs:
    target = SHAPES[target_name]
    draft = SHAPES[draft_name] if draft_name else None
    for name in method_names:
      options = {}
      if name in ("eagle", "eagle3", "mtp", "medusa"):
        layers = target.num_layers
        options["feature_layers"] = (2, layers // 2, layers - 3) if name == "eagle3" else (
            layers,)
      method = make_method(name, k, **options)
      if method.capabilities().needs_draft_model and draft is None:
        continue
      mem = method_memory(method, target, draft, dtype)
      rows.append(dict(
          target=target_name, draft=draft_name if method.capabilities().needs_draft_model
          else None, method=name, dtype=dtype or target.dtype,
          target_kv_bytes_per_token=mem.target_per_token,
          extra_device_bytes_per_token=mem.device_per_token - mem.target_per_token,
          kv_bytes_per_token=mem.device_per_token, ratio_to_target=mem.ratio_to_target,
          host_bytes_per_sequence=sum(mem.extra_per_sequence.values()),
          host_bytes_per_token=sum(v for key, v in mem.extra_per_token.items()
                                   if key.startswith("host_"))))
  return pd.DataFrame(rows)
