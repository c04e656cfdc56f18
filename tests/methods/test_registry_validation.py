"""Bad method options fail early with a ValueError that names the offending value."""

import pytest

from methods.draft_model import DraftModel
from methods.ngram import NGram
from methods.registry import METHODS, make_method


@pytest.mark.parametrize("k", [0, -1, -7])
@pytest.mark.parametrize("name", ["ngram", "draft_model"])
def test_make_method_rejects_nonpositive_k(name, k):
  with pytest.raises(ValueError, match=rf"num_speculative_tokens={k}\b"):
    make_method(name, k)


@pytest.mark.parametrize("cls", [NGram, DraftModel])
def test_method_classes_reject_nonpositive_k(cls):
  with pytest.raises(ValueError, match=r"k=0\b"):
    cls(k=0)


def test_unknown_method_name():
  with pytest.raises(ValueError, match="'eagle9'") as info:
    make_method("eagle9", 4)
  assert all(name in str(info.value) for name in METHODS)  # lists the known ones


def test_ngram_sizes_validated():
  with pytest.raises(ValueError, match="n_min=3, n_max=2"):
    NGram(k=2, n_min=3, n_max=2)


def test_valid_methods_build():
  assert make_method("ar").num_speculative_tokens == 0
  assert make_method("ngram", 3).num_speculative_tokens == 3
  assert make_method("draft_model", 5).capabilities().needs_draft_model
  hash(make_method("ngram", 3))  # frozen: usable as a static jit argument
