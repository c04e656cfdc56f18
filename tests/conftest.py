"""Test-wide setup: f32 matmuls at highest precision so exact comparisons are meaningful,
and compiled executables released after every test module.

A single pytest process that held every executable of the whole suite segfaulted inside
XLA:CPU's compiler near the end of the run (CI, and here at the same test), while that
module alone passed; the likely cause is resource exhaustion by accumulated executables
(their memory mappings count against ``vm.max_map_count``), not proven.
``jax.clear_caches()`` after each module drops them; with it the suite passes and the
process stays under 1,700 mappings (``SPECJAX_TEST_MAPS_LOG=file`` logs the count).
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
