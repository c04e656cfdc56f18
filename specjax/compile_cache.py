"""JAX's persistent compilation cache, on by default for specjax's binaries.

Compiled executables are written under the cache directory and reused by later
processes with the same program, JAX version and device (``jax_compilation_cache_dir``),
so a second run of the same evaluation skips most XLA compiles.
"""

from __future__ import annotations

import os

import jax

__all__ = ["default_compilation_cache_dir", "enable_compilation_cache"]


def default_compilation_cache_dir() -> str:
  """``$SPECJAX_CACHE/jax_compilation_cache`` (``~/.cache/specjax`` by default)."""
  root = os.environ.get("SPECJAX_CACHE", os.path.join(os.path.expanduser("~"), ".cache",
                                                      "specjax"))
  return os.path.join(root, "jax_compilation_cache")


def enable_compilation_cache(path: str | None = None) -> str | None:
  """Turns the persistent cache on at ``path`` (default above); every compile is cached
  (no minimum compile time or size). Returns the directory, or ``None`` on the CPU
  back end, where the cache stays off: writing CPU executables segfaulted inside
  ``jax._src.compilation_cache.put_executable_and_time`` (JAX 0.10.2, CI run of the
  test suite), and CPU compiles are the cheap ones."""
  if jax.default_backend() == "cpu":
    return None
  path = path or default_compilation_cache_dir()
  os.makedirs(path, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
  return path
