"""Random-weight ``Transformer`` s of any shape, built on the device in their dtype.

For step-cost benchmarks and engine runs at real model sizes without a checkpoint
(``models.zoo.load_model("random:llama3-8b")``). The module is built abstractly
(``nnx.eval_shape``) and one jitted function draws every parameter on the default
device directly in ``cfg.dtype``: no host copy (a bf16 Llama-3-8B is 16 GB) and one
compile instead of one eager op per parameter. Stacked layer parameters are drawn one
layer at a time (``lax.map``), so the largest temporary is one layer's weights (plus the
embedding and LM head, drawn together).

Values (the same seed gives the same layer ``i`` whatever ``num_layers`` is):
  * projections (q, k, v, o, gate, up, down, lm_head): ``N(0, 1/fan_in)``;
  * the embedding: ``N(0, 1/D)`` (so tied or untied, the logits of a unit-RMS final
    state have std about 1: finite and far from overflow in bf16);
  * norm scales: 1 (0 with ``norm_plus_one``); q/k/v biases: 0.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import ModelConfig
from models.llama import Transformer

__all__ = ["random_transformer"]

# Axes of a (per-layer) weight that its input is contracted over.
_FAN_IN_AXES = {"q": 1, "k": 1, "v": 1, "o": 2, "gate": 1, "up": 1, "down": 1, "lm_head": 1}


def _std(name: str, shape: tuple[int, ...], cfg: ModelConfig) -> float | None:
  """The normal std of a drawn parameter (no layer axis); None for norms and biases."""
  if name.endswith("norm") or name.endswith("bias"):
    return None
  if name == "embed":
    return cfg.hidden_size**-0.5
  if name in _FAN_IN_AXES:
    return math.prod(shape[: _FAN_IN_AXES[name]]) ** -0.5
  raise AssertionError(f"no initializer for parameter {name!r}")


def _draw_group(key: jax.Array, specs: dict[str, jax.ShapeDtypeStruct], cfg: ModelConfig
                ) -> dict[str, jax.Array]:
  """The parameters ``specs`` (name -> shape) from one flat normal draw of their total size.

  One draw per group, not per parameter: XLA CPU took about a second to compile each
  threefry normal of a new shape. Example: ``{"q": (4, 2), "k": (4, 1)}`` draws 12
  values; ``q`` is values ``[0, 8)`` reshaped to (4, 2), ``k`` values ``[8, 12)``.
  """
  drawn = {n: s for n, s in specs.items() if _std(n, s.shape, cfg) is not None}
  total = sum(math.prod(s.shape) for s in drawn.values())
  flat = jax.random.normal(key, (total,), next(iter(specs.values())).dtype) if total else None
  out, offset = {}, 0
  for name, spec in specs.items():
    std = _std(name, spec.shape, cfg)
    if std is None:
      fill = 0.0 if name.endswith("bias") or cfg.norm_plus_one else 1.0
      out[name] = jnp.full(spec.shape, fill, spec.dtype)
      continue
    size = math.prod(spec.shape)
    part = jax.lax.slice_in_dim(flat, offset, offset + size).reshape(spec.shape)
    out[name] = part * jnp.asarray(std, spec.dtype)
    offset += size
  return out


def _abstract(cfg: ModelConfig):
  """``(graphdef, flat abstract state)`` of a ``Transformer(cfg)``; nothing is allocated."""
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0))))
  return graphdef, dict(nnx.to_flat_state(abstract))


def _init_values(cfg: ModelConfig, key: jax.Array):
  """``(top-level values by name, stacked layer values by name)`` of ``Transformer(cfg)``."""
  _, flat = _abstract(cfg)
  assert all(len(path) == 1 for path in flat if path[0] != "layers"), list(flat)
  top = {path[-1]: var.get_value() for path, var in flat.items() if path[0] != "layers"}
  layer = {path[-1]: jax.ShapeDtypeStruct(var.get_value().shape[1:], var.get_value().dtype)
           for path, var in flat.items() if path[0] == "layers"}
  top_key, layers_key = jax.random.split(key)
  layers = jax.lax.map(lambda i: _draw_group(jax.random.fold_in(layers_key, i), layer, cfg),
                       jnp.arange(cfg.num_layers, dtype=jnp.uint32))
  return _draw_group(top_key, top, cfg), layers


_init = jax.jit(_init_values, static_argnums=0)


def random_transformer(cfg: ModelConfig, seed: int = 0, shardings=None) -> Transformer:
  """A ``Transformer`` of config ``cfg`` with seeded random weights on the default device.

  Args:
    cfg: the architecture; parameters are created in ``cfg.dtype``.
    seed: any int; the weights are a deterministic function of it and ``cfg`` (layer
      ``i``'s do not depend on ``num_layers``).
    shardings: None (the default device), or ``(path, shape) -> jax.sharding.Sharding``
      (e.g. ``specjax.sharding.param_sharding_fn``): each parameter is drawn directly
      on its shards (the jitted init's ``out_shardings``), never whole on one device.

  Returns:
    The model, layer parameters stacked as after loading (``unstack_layer_params``
    unrolls them).

  Raises:
    ValueError: ``seed`` is not an int.
  """
  if not isinstance(seed, int) or isinstance(seed, bool):
    raise ValueError(f"{seed=} must be an int")
  graphdef, flat = _abstract(cfg)
  if shardings is None:
    top, layers = _init(cfg, jax.random.key(seed))  # compiled once per config
  else:
    out = ({path[0]: shardings(path, var.get_value().shape)
            for path, var in flat.items() if path[0] != "layers"},
           {path[1]: shardings(path, var.get_value().shape)
            for path, var in flat.items() if path[0] == "layers"})
    top, layers = jax.jit(_init_values, static_argnums=0, out_shardings=out)(
        cfg, jax.random.key(seed))
  state = nnx.from_flat_state({
      path: var.replace(layers[path[1]] if path[0] == "layers" else top[path[0]])
      for path, var in flat.items()})
  return nnx.merge(graphdef, state)
