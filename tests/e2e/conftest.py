"""Session fixtures of the engine tests: one target, one draft, engine factories."""

import jax
import pytest
from e2e_lib import ENGINE_CONFIG, build_model, decode, greedy_reference, model_config

from methods.registry import make_method
from specjax.engine import Engine

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="session")
def target():
  return build_model(model_config(), seed=0)


@pytest.fixture(scope="session")
def draft():
  # Same graph as the target (shares its compiled steps), layer weights perturbed:
  # greedy acceptance is roughly one half.
  return build_model(model_config(), seed=0, perturb=0.15)


@pytest.fixture(scope="session")
def make_engine(target, draft):
  """``make_engine(method_or_name, config=ENGINE_CONFIG, **engine_kwargs) -> Engine``."""

  def make(method, config=ENGINE_CONFIG, **kwargs):
    if isinstance(method, str):
      method = make_method(method, 4)
    kwargs.setdefault("decode", decode)
    return Engine(target, method, config, draft=draft, **kwargs)

  return make


@pytest.fixture(scope="session")
def reference(target):
  """``reference(requests, eos_ids=()) -> greedy outputs`` of the uncached forward, cached."""
  cache = {}

  def ref(requests, eos_ids=()):
    key = (tuple(requests), tuple(eos_ids))
    if key not in cache:
      cache[key] = greedy_reference(target, list(requests), eos_ids=tuple(eos_ids))
    return cache[key]

  return ref
