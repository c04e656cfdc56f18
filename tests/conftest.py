"""Test-wide setup: f32 matmuls at highest precision so exact comparisons are meaningful,
and compiled executables released after every test module.

Each XLA:CPU executable keeps its own memory mappings; a single pytest process that
holds every executable of the whole suite ran past the kernel's ``vm.max_map_count``
(65530) and segfaulted inside XLA's compiler (CI, and locally at the same test), while
the same module alone passed. ``jax.clear_caches()`` after each module drops them.
"""

import gc
import os

import jax
import pytest

jax.config.update("jax_default_matmul_precision", "highest")


def _num_mappings() -> int:
  try:
    with open(f"/proc/{os.getpid()}/maps") as f:
      return sum(1 for _ in f)
  except OSError:
    return -1


@pytest.fixture(autouse=True, scope="module")
def _release_executables(request):
  yield
  jax.clear_caches()
  gc.collect()
  log = os.environ.get("SPECJAX_TEST_MAPS_LOG")
  if log:
    with open(log, "a") as f:
      f.write(f"{request.module.__name__} {_num_mappings()}\n")
