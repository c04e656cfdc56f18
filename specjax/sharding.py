"""Device meshes and the logical -> mesh axis rules of the models (one place for both).

The layout follows tpu-inference's and sglang-jax's (``methods_reference.md`` §2.6): a
2-D mesh ``("data", "model")``; on ``model``, q/k/v and gate/up are column-parallel
(split on their output heads / ffn columns), o and down row-parallel (split on their
input heads / ffn rows: GSPMD all-reduces their partial sums), the embedding and LM head
split on the vocabulary; norms replicated. The KV pool
``[num_layers * num_pages, page_size, 2K', H]`` is split on its head axis (k and v of
one head stay on one device: they are adjacent, ``2k`` and ``2k + 1``), and each layer's
KV write and paged attention run under ``jax.shard_map`` over ``model``
(``models.llama.TensorParallel``), so the Pallas kernels see whole heads per device.
``model`` larger than the KV head count K replicates KV heads (``kv_cache_heads``;
memory cost ``m / K`` times the pool). ``data`` counts engine replicas
(``specjax.data_parallel``): each replica owns one row of the mesh, its own weights
copy and KV pool.

Everything else (embedding gather, norms, argmax / softmax over vocab-split logits) is
left to GSPMD, which follows the weights' ``NamedSharding`` s.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from models.llama import TensorParallel, kv_cache_heads

__all__ = [
    "AXES",
    "LOGICAL_RULES",
    "PARAM_AXES",
    "DRAFT_SHARDINGS",
    "default_mesh",
    "describe",
    "init_kv_pool",
    "kv_cache_sharding",
    "loader_placement",
    "make_mesh",
    "param_sharding_fn",
    "param_spec",
    "parse_mesh",
    "place_state",
    "replica_meshes",
    "replicate",
    "shard_model",
    "tensor_parallel_of",
]

AXES = ("data", "model")
DRAFT_SHARDINGS = ("replicated", "sharded")

# Parameter (last path name) -> logical axes of its dims, without the stacked layer axis.
PARAM_AXES: dict[str, tuple[str | None, ...]] = {
    "embed": ("vocab", None),  # [V, D]
    "lm_head": (None, "vocab"),  # [D, V]
    "q": (None, "heads", None),  # [D, N, H]   column-parallel
    "k": (None, "kv_heads", None),  # [D, K, H]
    "v": (None, "kv_heads", None),
    "o": ("heads", None, None),  # [N, H, D]   row-parallel
    "q_bias": ("heads", None),
    "k_bias": ("kv_heads", None),
    "v_bias": ("kv_heads", None),
    "gate": (None, "mlp"),  # [D, F]      column-parallel
    "up": (None, "mlp"),
    "down": ("mlp", None),  # [F, D]      row-parallel
}
# Logical axis -> mesh axis (None: replicated). ``kv_heads`` maps to None instead when
# the model axis exceeds K (k/v weights replicated, the KV pool's heads repeated).
LOGICAL_RULES: dict[str, str | None] = {
    "vocab": "model", "heads": "model", "kv_heads": "model", "mlp": "model",
}


def parse_mesh(text: str) -> dict[str, int]:
  """``"data:1,model:2"`` -> ``{"data": 1, "model": 2}`` (a missing axis is 1).

  Raises:
    ValueError: an axis other than ``AXES``, a repeated axis, or a size that is not a
      positive int.
  """
  sizes = {a: 1 for a in AXES}
  seen = set()
  for part in (p.strip() for p in text.split(",")):
    name, sep, value = part.partition(":")
    if not sep or name not in AXES or name in seen:
      raise ValueError(f"mesh={text!r}: each part must be AXIS:SIZE with AXIS one of {AXES}, "
                       f"each once (e.g. 'data:1,model:2'); got {part!r}")
    if not re.fullmatch(r"[1-9][0-9]*", value):
      raise ValueError(f"mesh={text!r}: size {value!r} of axis {name!r} must be an int >= 1")
    sizes[name] = int(value)
    seen.add(name)
  return sizes


def make_mesh(sizes: dict[str, int] | str, devices: Sequence | None = None) -> Mesh:
  """A ``("data", "model")`` mesh of the first ``data * model`` of ``devices``.

  Args:
    sizes: from ``parse_mesh`` (or its string).
    devices: default ``jax.devices()`` (all processes' devices: multi-host meshes span
      hosts; a host's devices are consecutive, so a ``model`` axis within one host's
      device count stays on that host's fast links).

  Raises:
    ValueError: more devices asked for than there are.
  """
  if isinstance(sizes, str):
    sizes = parse_mesh(sizes)
  devices = list(jax.devices() if devices is None else devices)
  need = sizes["data"] * sizes["model"]
  if need > len(devices):
    raise ValueError(f"mesh data:{sizes['data']},model:{sizes['model']} needs {need} devices; "
                     f"{len(devices)} available ({devices[0].platform})")
  grid = np.asarray(devices[:need], dtype=object).reshape(sizes["data"], sizes["model"])
  return Mesh(grid, AXES)


def default_mesh(param_bytes: int, devices: Sequence | None = None,
                 headroom: float = 0.8) -> Mesh:
  """One device, unless ``param_bytes`` exceed ``headroom`` of its memory: then every
  device on the model axis (the issue's default). Devices without a memory limit
  (CPU) count as large enough."""
  devices = list(jax.devices() if devices is None else devices)
  stats = devices[0].memory_stats() or {}
  limit = stats.get("bytes_limit")
  model = 1 if limit is None or param_bytes <= headroom * limit else len(devices)
  return make_mesh({"data": 1, "model": model}, devices)


def replica_meshes(mesh: Mesh) -> list[Mesh]:
  """One ``(1, model)`` mesh per row of ``mesh``'s data axis (one engine replica each)."""
  return [Mesh(mesh.devices[i : i + 1], AXES) for i in range(mesh.shape["data"])]


def _model_axis(mesh: Mesh) -> tuple[str, int]:
  if tuple(mesh.axis_names) != AXES:
    raise ValueError(f"mesh axes {mesh.axis_names} must be {AXES} (specjax.sharding.make_mesh)")
  return "model", int(mesh.shape["model"])


def param_spec(name: str, shape: tuple[int, ...], cfg, mesh: Mesh, *, stacked: bool) -> P:
  """The ``PartitionSpec`` of parameter ``name`` (last path entry) of shape ``shape``.

  Names outside ``PARAM_AXES`` (norms, heads' own fusion layers), or of another rank,
  are replicated; a dim the table splits must divide by the model axis size.

  Raises:
    ValueError: a sharded dim not divisible by the model axis size.
  """
  axis, m = _model_axis(mesh)
  logical = PARAM_AXES.get(name)
  lead = (None,) if stacked else ()
  if logical is None or len(logical) + len(lead) != len(shape):
    return P()
  spec = []
  for dim, ax in zip(shape[len(lead):], logical):
    mesh_ax = LOGICAL_RULES.get(ax) if ax else None
    if ax == "kv_heads" and m > cfg.num_kv_heads:
      mesh_ax = None  # fewer KV heads than devices: k/v weights replicated
    if mesh_ax is not None and dim % m:
      raise ValueError(f"parameter {name!r} dim {dim} ({ax}) must divide by the model axis "
                       f"size {m}")
    spec.append(mesh_ax)
  return P(*lead, *spec)


def _spec_fn(cfg, mesh: Mesh, sharded: bool) -> Callable[[tuple, tuple[int, ...]], P]:
  def spec(path, shape):
    if not sharded:
      return P()
    name = str(path[-1])
    return param_spec(name, shape, cfg, mesh, stacked=path[0] == "layers")
  return spec


def _place_flat(flat, mesh: Mesh, spec_of) -> dict:
  """device_put each variable of a flat state on its sharding (tuples: per layer)."""
  out = {}
  for path, var in flat.items():
    value = var.get_value()
    if isinstance(value, (tuple, list)):  # unrolled layers: per-layer arrays
      spec = spec_of(path[:-1] + (path[-1],), (len(value), *value[0].shape))
      inner = P(*tuple(spec)[1:]) if len(spec) else P()
      value = type(value)(jax.device_put(v, NamedSharding(mesh, inner)) for v in value)
    else:
      value = jax.device_put(value, NamedSharding(mesh, spec_of(path, tuple(value.shape))))
    out[path] = var.replace(value)
  return out


def shard_model(model, mesh: Mesh, *, replicated: bool = False):
  """Places a model's weights on ``mesh`` and returns it as a ``SplitModel``.

  Args:
    model: a ``models.llama.Transformer`` or a ``specjax.steps.SplitModel`` of one.
    mesh: a ``("data", "model")`` mesh with data size 1 (one replica).
    replicated: every weight whole on every device and attention unpartitioned (a
      draft model's "replicated" option); else the ``PARAM_AXES`` rules and
      ``TensorParallel`` attention over ``model``.

  Returns:
    ``SplitModel`` whose graphdef carries the layout (``Transformer.tensor_parallel``).
    Each array is put on its shards one at a time; weights already on the device are
    resharded on it (``load_model(..., place=...)`` avoids the full first copy).

  Raises:
    ValueError: data axis > 1, or dims that do not divide by the model axis.
  """
  from specjax.steps import SplitModel, split_model  # noqa: PLC0415

  if mesh.shape["data"] != 1:
    raise ValueError(f"shard_model needs a one-replica mesh (data size 1), got "
                     f"{dict(mesh.shape)}; specjax.data_parallel splits the data axis")
  split = model if isinstance(model, SplitModel) else split_model(model)
  cfg = split.config
  module = nnx.merge(split.graphdef, split.params)
  module.tensor_parallel = None if replicated else TensorParallel(mesh, "model")
  if not replicated:
    kv_cache_heads(cfg, module.tensor_parallel)  # validates K, N against the axis
  graphdef, params = nnx.split(module)
  flat = _place_flat(dict(nnx.to_flat_state(params)), mesh, _spec_fn(cfg, mesh, not replicated))
  return SplitModel(cfg, graphdef, nnx.from_flat_state(flat))


def param_sharding_fn(cfg, mesh: Mesh, *, replicated: bool = False):
  """``(path, shape) -> NamedSharding`` of a ``Transformer(cfg)`` parameter (flat-state
  path, e.g. ``("layers", "q")`` with the stacked shape) on ``mesh``: for
  ``models.random_weights.random_transformer(shardings=...)``."""
  spec_of = _spec_fn(cfg, mesh, not replicated)
  return lambda path, shape: NamedSharding(mesh, spec_of(path, tuple(shape)))


def loader_placement(cfg, mesh: Mesh, *, replicated: bool = False):
  """``place(path, value) -> jax.Array`` for ``models.zoo.load_model(place=...)``: each
  loaded tensor goes straight to its shards (no whole-model copy on one device)."""
  spec_of = _spec_fn(cfg, mesh, not replicated)

  def place(path, value):
    return jax.device_put(value, NamedSharding(mesh, spec_of(path, tuple(np.shape(value)))))
  return place


def kv_cache_sharding(mesh: Mesh, *, replicated: bool = False) -> NamedSharding:
  """The KV pool ``[num_layers * num_pages, page_size, 2K', H]``: heads on ``model``."""
  return NamedSharding(mesh, P() if replicated else P(None, None, "model", None))


def tensor_parallel_of(split) -> TensorParallel | None:
  """The ``TensorParallel`` layout a ``SplitModel``'s graphdef carries (None: unsharded)."""
  return getattr(nnx.merge(split.graphdef, split.params), "tensor_parallel", None)


def commit(tree):
  """``tree`` with every ``jax.Array`` leaf committed to the placement it has.

  A fresh array (``jnp.zeros``) is uncommitted; a jitted function's outputs are
  committed once any input is (e.g. weights loaded with ``device_put``). jit compiles
  one executable per placement signature, so an engine whose KV pool, slots or method
  state start uncommitted and come back committed from their first call compiles each
  shape twice. Committing them at creation keeps one signature. A committed leaf is
  returned as is; non-array leaves are untouched.
  """
  return jax.tree.map(lambda x: jax.device_put(x, x.sharding) if isinstance(x, jax.Array)
                      else x, tree)


def init_kv_pool(split, num_pages: int, page_size: int, mesh: Mesh | None):
  """The zeroed KV pool of ``split`` (``models.llama.init_kv_caches``), allocated on its
  shards by a jitted zeros with ``out_shardings`` (as tpu-inference's
  ``create_kv_caches``): heads on ``model``, repeated when the model axis exceeds K."""
  from models.llama import init_kv_caches  # noqa: PLC0415

  cfg = split.config
  if mesh is None:
    return commit(init_kv_caches(cfg, num_pages, page_size))
  tp = tensor_parallel_of(split)
  heads = kv_cache_heads(cfg, tp)
  out = kv_cache_sharding(mesh, replicated=tp is None)
  return jax.jit(lambda: init_kv_caches(cfg, num_pages, page_size, num_kv_heads=heads),
                 out_shardings=out)()


def replicate(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def _on_mesh(x, mesh: Mesh) -> bool:
  return set(x.sharding.device_set) == set(mesh.devices.flat)


def place_state(state, mesh: Mesh, cfg=None, *, sharded: bool = False):
  """Puts the device arrays of a method's state on ``mesh`` (in place for dataclasses).

  Arrays already on the mesh (e.g. the target's weights) are left alone; the others
  (a draft model's KV pool, a learned head's weights) are replicated, or, with
  ``sharded`` and ``cfg``, laid out by the ``PARAM_AXES`` rules of their path (names
  outside the table stay replicated). Returns the state.

  Raises:
    ValueError: (sharded) a tabled dim that does not divide by the model axis.
  """
  def put(path, x):
    if not isinstance(x, jax.Array) or _on_mesh(x, mesh):
      return x
    spec = P()
    if sharded and cfg is not None:
      keys = [getattr(k, "key", getattr(k, "name", getattr(k, "idx", None))) for k in path]
      names = [k for k in keys if isinstance(k, str)]
      if names:
        spec = param_spec(names[-1], tuple(x.shape), cfg, mesh, stacked=False)
    return jax.device_put(x, NamedSharding(mesh, spec))

  def tree(value):
    return jax.tree_util.tree_map_with_path(put, value)

  if dataclasses.is_dataclass(state) and not isinstance(state, type):
    for f in dataclasses.fields(state):
      object.__setattr__(state, f.name, tree(getattr(state, f.name)))
    return state
  return tree(state)


def describe(mesh: Mesh | None, draft_sharding: str = "replicated", cfg=None) -> dict:
  """Result-row columns: ``mesh`` ("data:1,model:2" or "none"), ``mesh_devices``, and
  ``replicated``: what each replica holds whole on every one of its devices (norms
  always; "draft/heads" under the replicated draft option; "kv_heads xR" when the
  model axis exceeds K and the pool stores each KV head R times)."""
  if mesh is None:
    return {"mesh": "none", "mesh_devices": 1, "replicated": "all (no mesh)"}
  whole = ["norms"]
  if draft_sharding == "replicated":
    whole.append("draft/heads")
  m = int(mesh.shape["model"])
  if cfg is not None and m > cfg.num_kv_heads:
    whole.append(f"k/v weights, kv_heads x{m // cfg.num_kv_heads}")
  return {"mesh": f"data:{mesh.shape['data']},model:{m}",
          "mesh_devices": int(mesh.devices.size), "replicated": "+".join(whole)}
