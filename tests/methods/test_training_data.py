"""ShareGPT prompt reading for head training (from a path: which file a name means is
``harness.workloads.sharegpt_path``, tested in tests/harness/test_workloads.py)."""

from __future__ import annotations

import json

import pytest

from methods.training.data import read_sharegpt_prompts


def _write(tmp_path, suffix):
  recs = [
      {"conversations": [{"from": "human", "value": "a1"}, {"from": "gpt", "value": "x"},
                         {"from": "human", "value": "a2"}]},
      {"conversations": [{"from": "human", "value": "  "}, {"from": "human", "value": "b2"}]},
      {"conversations": [{"from": "human", "value": "c1"}]},
  ]
  path = tmp_path / f"d{suffix}"
  if suffix == ".json":  # a JSON array cut mid-record, like the package's file
    path.write_text(json.dumps(recs)[:-20])
  else:
    path.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
  return str(path)


def test_first_or_all_turns(tmp_path):
  path = _write(tmp_path, ".jsonl")
  # Empty turns are skipped; without all_turns a record with an empty first turn gives none.
  assert read_sharegpt_prompts(path) == ["a1", "c1"]
  assert read_sharegpt_prompts(path, all_turns=True) == ["a1", "a2", "b2", "c1"]
  assert read_sharegpt_prompts(path, 3, all_turns=True) == ["a1", "a2", "b2"]
  with pytest.raises(ValueError, match="holds 2 prompts"):  # never silently fewer
    read_sharegpt_prompts(path, 3)
  # The truncated JSON array stops quietly before its cut record.
  assert read_sharegpt_prompts(_write(tmp_path, ".json"), all_turns=True) == ["a1", "a2", "b2"]


def test_bad_data_fails_before_the_model_loads(tmp_path):
  from methods.training.pipeline import DraftHeadJob, train_draft_head  # noqa: PLC0415
  from methods.training.trainer import TrainConfig  # noqa: PLC0415

  out = tmp_path / "out"
  job = DraftHeadJob(target="no-such-model", data=str(tmp_path / "nope.json"),
                     train=TrainConfig(kind="eagle3", output_dir=str(out)))
  with pytest.raises(FileNotFoundError, match="nope.json"):  # not the model's error
    train_draft_head(job)
  assert not out.exists()
  job = DraftHeadJob(target="no-such-model", data=_write(tmp_path, ".jsonl"), num_prompts=3,
                     num_held_out=1, train=TrainConfig(kind="eagle3", output_dir=str(out)))
  with pytest.raises(ValueError, match="holds 2 prompts"):
    train_draft_head(job)
