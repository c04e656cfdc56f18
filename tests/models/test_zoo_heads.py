"""Named draft heads: resolution by name, and clear errors for unknown or untrained ones."""

import os

import pytest

from models.zoo import HEADS, head_dir, resolve_head_path


def test_untrained_named_head_error_gives_the_training_command(tmp_path):
  with pytest.raises(ValueError, match="not trained yet") as err:
    resolve_head_path("smollm2-135m-eagle3", cache_dir=tmp_path)
  assert HEADS["smollm2-135m-eagle3"].command in str(err.value)
  assert "--head_name=smollm2-135m-eagle3" in HEADS["smollm2-135m-eagle3"].command


def test_unknown_head_name_lists_known_ones(tmp_path):
  with pytest.raises(ValueError, match="smollm2-135m-medusa"):
    resolve_head_path("no-such-head", cache_dir=tmp_path)
  with pytest.raises(ValueError, match="unknown head name"):
    head_dir("no-such-head", cache_dir=tmp_path)


def test_trained_named_head_and_plain_directory_resolve(tmp_path):
  path = os.path.join(head_dir("smollm2-135m-mtp", cache_dir=tmp_path), "head")
  os.makedirs(path)
  with open(os.path.join(path, "head_config.json"), "w") as f:
    f.write("{}")
  assert resolve_head_path("smollm2-135m-mtp", cache_dir=tmp_path) == path
  assert resolve_head_path(path) == path  # a head directory
  run_dir = os.path.dirname(path)  # a training run's output_dir: its head/
  assert resolve_head_path(run_dir) == path
  with pytest.raises(ValueError, match="holds no head_config.json"):
    resolve_head_path(str(tmp_path))
