"""JAX's persistent compilation cache, on by default for specjax's binaries.

Compiled executables are written under the cache directory and reused by later
processes with the same program, JAX version and device (``jax_compilation_cache_dir``),
so a second run of the same evaluation skips most XLA compiles. ``SPECJAX_COMPILATION_CACHE``
names another directory, or turns the cache off (``0``, ``off``, ``false``, ``no``).
"""

from __future__ import annotations

import os

import jax
from jax.experimental.compilation_cache import compilation_cache

__all__ = ["CACHE_ENV", "default_compilation_cache_dir", "enable_compilation_cache"]

CACHE_ENV = "SPECJAX_COMPILATION_CACHE"
_OFF = ("0", "off", "false", "no")


def default_compilation_cache_dir() -> str | None:
  """``$SPECJAX_COMPILATION_CACHE`` if set, else ``$SPECJAX_CACHE/jax_compilation_cache``
  (``~/.cache/specjax`` by default); ``None`` when ``SPECJAX_COMPILATION_CACHE`` is off."""
  override = os.environ.get(CACHE_ENV, "").strip()
  if override.lower() in _OFF:
    return None
  if override:
    return override
  home_cache = os.path.join(os.path.expanduser("~"), ".cache", "specjax")
  root = os.environ.get("SPECJAX_CACHE") or home_cache
  return os.path.join(root, "jax_compilation_cache")


def enable_compilation_cache(path: str | None = None) -> str | None:
  """Turns the persistent cache on at ``path``, every compile cached (no minimum compile
  time or size), on every back end, CPU included.

  CPU was left out for a while: a CI run of the whole test suite segfaulted inside
  ``jax._src.compilation_cache.put_executable_and_time`` (JAX 0.10.2) once the evaluation
  tests had turned the cache on. The suite later traced that crash to one process holding
  every executable of the suite (memory mappings against ``vm.max_map_count``, 65,530; see
  ``tests/conftest.py``), and the cache does not add to it: 400 held CPU executables take
  the same ~6 mappings each with the cache off, writing, or loading (JAX 0.10.2, 2,469 /
  2,470 / 2,459 in all). Re-tested there: CPU executables load in a fresh process with
  bit-identical results; ``experiments.evaluate --target=random:tiny --dataset=random
  --input_len=64 --methods=ar,ngram,suffix,draft_model --draft=random:tiny --num_prompts=8
  --batch_sizes=1,2,4,8 --max_new_tokens=32`` writes 82 entries (3.6 MB) and warms up in
  54.5 s from an empty cache (62.6 s without one), 8.7 s the second time (84 of 84
  compiles hit), with the same tokens. Keys cover the program, jaxlib, XLA flags, compile
  options and device kind, so a cache directory belongs on one machine.

  Args:
    path: the cache directory (default: ``default_compilation_cache_dir()``).

  Returns:
    The directory, or ``None`` when ``SPECJAX_COMPILATION_CACHE`` turns the cache off
    (then nothing changes).
  """
  if os.environ.get(CACHE_ENV, "").strip().lower() in _OFF:
    return None
  path = path or default_compilation_cache_dir()
  os.makedirs(path, exist_ok=True)
  if jax.config.jax_compilation_cache_dir != path:
    # JAX opens the cache at the first directory it compiles with and keeps it.
    compilation_cache.reset_cache()
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
  return path
