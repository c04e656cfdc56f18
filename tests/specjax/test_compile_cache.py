"""The persistent compilation cache stays off on CPU (its executable writes segfaulted in CI)."""

import jax

from specjax.compile_cache import enable_compilation_cache


def test_cache_is_not_enabled_on_cpu(tmp_path):
  assert jax.default_backend() == "cpu"
  before = jax.config.jax_compilation_cache_dir
  assert enable_compilation_cache(str(tmp_path / "cache")) is None
  assert jax.config.jax_compilation_cache_dir == before
  assert not (tmp_path / "cache").exists()
