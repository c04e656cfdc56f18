"""Test-wide setup: f32 matmuls at highest precision so exact comparisons are meaningful,
and compiled executables released after every test module.

A single pytest process that held every executable of the whole suite segfaulted inside
XLA:CPU's compiler near the end of the run (CI, and here at the same test), while that
module alone passed; the likely cause is resource exhaustion by accumulated executables
(their memory mappings count against ``vm.max_map_count``), not proven.
``jax.clear_caches()`` after each module drops them; with it the suite passes and the
process stays under 1,700 mappings (``SPECJAX_TEST_MAPS_LOG=file`` logs the count).

The persistent compilation cache (``specjax.compile_cache``, which the evaluation runs turn
on) writes to a fresh directory per session, never to the user's ``~/.cache/specjax``,
unless ``SPECJAX_COMPILATION_CACHE`` is already set (``0`` runs the suite without it).

XLA:CPU compiles dominate the suite's time on tiny models, so the tests compile with
LLVM's backend optimization level 0 (``--xla_backend_optimization_level=0``; about a
quarter less time per engine test module on a 2-core CPU, same outputs: the equality
tests compare programs compiled alike). A level already in ``XLA_FLAGS`` is kept
(``XLA_FLAGS=--xla_backend_optimization_level=3`` runs the suite at XLA's default).
"""

import gc
import os

import jax
import pytest

from specjax.compile_cache import CACHE_ENV

# Before the CPU backend starts (the first computation); subprocesses inherit it.
XLA_OPT_FLAG = "--xla_backend_optimization_level"
if XLA_OPT_FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {XLA_OPT_FLAG}=0".strip()

jax.config.update("jax_default_matmul_precision", "highest")


def _num_mappings() -> int:
  try:
    with open(f"/proc/{os.getpid()}/maps") as f:
      return sum(1 for _ in f)
  except OSError:
    return -1


@pytest.fixture(autouse=True, scope="session")
def _session_compilation_cache(tmp_path_factory):
  if os.environ.get(CACHE_ENV):
    yield
    return
  os.environ[CACHE_ENV] = str(tmp_path_factory.mktemp("jax_compilation_cache"))
  yield
  del os.environ[CACHE_ENV]


@pytest.fixture(autouse=True, scope="module")
def _release_executables(request):
  yield
  jax.clear_caches()
  gc.collect()
  log = os.environ.get("SPECJAX_TEST_MAPS_LOG")
  if log:
    with open(log, "a") as f:
      f.write(f"{request.module.__name__} {_num_mappings()}\n")
