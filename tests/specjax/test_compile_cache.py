"""The persistent compilation cache on CPU: executables written by one compile are loaded
by the next, in this process after ``jax.clear_caches()`` and in a fresh process."""

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.compilation_cache import compilation_cache

from specjax.compile_cache import CACHE_ENV, default_compilation_cache_dir, enable_compilation_cache

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HITS, MISSES = "/jax/compilation_cache/cache_hits", "/jax/compilation_cache/cache_misses"
OPTIONS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
           "jax_persistent_cache_min_entry_size_bytes")

# Run by the fresh process: the same `_program` on the same input, compiled from the cache.
CHILD = textwrap.dedent("""
    import json
    import sys
    import jax
    import jax.numpy as jnp
    import numpy as np
    from specjax.compile_cache import enable_compilation_cache
    jax.config.update("jax_default_matmul_precision", sys.argv[2])  # as in conftest
    events = []
    jax.monitoring.register_event_listener(lambda event, **kw: events.append(event))
    x = jnp.asarray(np.arange(48, dtype=np.float32).reshape(6, 8) / 48)
    def _program(x):
      return jnp.tanh(x @ x.T).sum(axis=0) * 3.0
    enable_compilation_cache(sys.argv[1])
    y = jax.jit(_program)(x)
    print(events.count("{hits}"), events.count("{misses}"), json.dumps(y.tolist()))
""").format(hits=HITS, misses=MISSES)


def _program(x):
  return jnp.tanh(x @ x.T).sum(axis=0) * 3.0


@pytest.fixture
def events():
  """Compilation-cache events recorded while the test runs; the cache is then put back."""
  saved = {name: getattr(jax.config, name) for name in OPTIONS}
  seen = []

  def listener(event, **kwargs):
    del kwargs
    seen.append(event)

  jax.monitoring.register_event_listener(listener)
  yield seen
  jax.monitoring.unregister_event_listener(listener)
  for name, value in saved.items():
    jax.config.update(name, value)
  compilation_cache.reset_cache()


def _entries(path) -> set[str]:
  return {name for name in os.listdir(path) if name.endswith("-cache")}


def test_cpu_executables_are_written_and_loaded_again(tmp_path, events):
  assert jax.default_backend() == "cpu"
  x = jnp.asarray(np.arange(48, dtype=np.float32).reshape(6, 8) / 48)
  cache = str(tmp_path / "cache")
  assert enable_compilation_cache(cache) == cache
  assert jax.config.jax_compilation_cache_dir == cache
  jax.clear_caches()
  first = jax.jit(_program)(x)
  written = _entries(cache)
  assert any(name.startswith("jit__program-") for name in written)
  assert events.count(MISSES) >= 1 and events.count(HITS) == 0

  jax.clear_caches()  # drop the in-memory executables: the next compile reads the files
  del events[:]
  again = jax.jit(_program)(x)
  assert events.count(HITS) >= 1 and events.count(MISSES) == 0
  assert _entries(cache) == written
  np.testing.assert_array_equal(np.asarray(again), np.asarray(first))

  child = subprocess.run([sys.executable, "-c", CHILD, cache, jax.config.jax_default_matmul_precision], capture_output=True, text=True,
                         cwd=ROOT, timeout=120, check=False)
  assert child.returncode == 0, child.stderr[-4000:]
  hits, misses, values = child.stdout.split(maxsplit=2)
  assert int(hits) >= 1 and int(misses) == 0, child.stdout
  np.testing.assert_array_equal(np.asarray(json.loads(values), np.float32), np.asarray(first))
  assert _entries(cache) == written


def test_env_turns_the_cache_off(tmp_path, monkeypatch, events):
  before = jax.config.jax_compilation_cache_dir
  monkeypatch.setenv(CACHE_ENV, "off")
  assert default_compilation_cache_dir() is None
  assert enable_compilation_cache(str(tmp_path / "cache")) is None
  assert jax.config.jax_compilation_cache_dir == before
  assert not (tmp_path / "cache").exists()
  assert not events


def test_default_directory(tmp_path, monkeypatch):
  monkeypatch.delenv(CACHE_ENV, raising=False)
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
  assert default_compilation_cache_dir() == str(tmp_path / "jax_compilation_cache")
  monkeypatch.setenv(CACHE_ENV, str(tmp_path / "elsewhere"))
  assert default_compilation_cache_dir() == str(tmp_path / "elsewhere")
