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


COMPOSITES = sorted(name for name, cls in METHODS.items() if cls.inner_methods)


def test_composites_declare_their_inner_methods():
  assert COMPOSITES == ["adaptive", "hsddw", "sv", "svip", "turbospec", "verify_skip"]


@pytest.mark.parametrize("name", [n for n in COMPOSITES if n != "sv"])  # sv needs a companion
def test_inner_methods_are_built_by_the_registry(name):
  method = make_method(name, 3)
  for spec in type(method).inner_methods:
    value = getattr(method, spec.option)
    inner = value if spec.many else (value,)
    defaults = spec.default if spec.many else (spec.default,)
    assert [m.name for m in inner] == list(defaults)
    assert all(m.num_speculative_tokens == 3 for m in inner)
  hash(method)


@pytest.mark.parametrize("name, options, match", [
    ("verify_skip", {"drafter": "nope"}, r"^option drafter='nope' of method 'verify_skip' "),
    ("hsddw", {"m1": 3}, r"^option m1=3 of method 'hsddw' must be a method name"),
    ("adaptive", {"drafters": "suffix,nope"}, r"'nope' is neither"),
    ("svip", {"drafter_options": 5}, r"^option drafter_options=5 of method 'svip' must be"),
    ("svip", {"drafter": NGram(k=4), "drafter_options": {"n_max": 3}}, "named drafter only"),
    ("svip", {"drafter_options": {"nope": 1}}, r"\['nope'\] are not options of method"),
    ("hsddw", {"drafter_options": {}}, r"\['drafter_options'\] are not options of method"),
])
def test_bad_inner_methods_are_one_line_errors(name, options, match):
  with pytest.raises(ValueError, match=match) as info:
    make_method(name, 4, **options)
  assert "\n" not in str(info.value)


def test_named_and_given_inner_methods_agree():
  assert make_method("verify_skip", 4, drafter="draft_model") == \
      make_method("verify_skip", 4, drafter=DraftModel(k=4))
  svip = make_method("svip", 4, drafter="draft_model", drafter_options=[("fused", False)])
  assert svip.drafter == DraftModel(k=4, fused=False)
  with pytest.raises(ValueError, match="drafter=None must be a Method"):
    METHODS["svip"](k=4)  # built directly, not through the registry: no names to resolve
