"""Every method option is type-checked where options become methods
(``methods.registry.make_method``): a wrong type is a one-line ValueError naming the
option and the type, never a TypeError or AttributeError deep inside a run."""

import dataclasses
import typing

import pytest

from methods.registry import METHODS, _matches, make_method


def _wrong_value(hint):
  """A value that does not fit ``hint``, or None when every value fits (Any)."""
  for candidate in ("abc", 3, 2.5, (object(),)):
    if not _matches(candidate, hint):
      return candidate
  return None


CASES = []
for _name, _cls in METHODS.items():
  _hints = typing.get_type_hints(_cls)
  for _f in dataclasses.fields(_cls):
    if _f.init and _f.name != "k" and _f.name in _hints:
      _bad = _wrong_value(_hints[_f.name])
      if _bad is not None:
        CASES.append(pytest.param(_name, _f.name, _bad, id=f"{_name}.{_f.name}"))


@pytest.mark.parametrize("method,option,value", CASES)
def test_wrong_type_is_one_line_error(method, option, value):
  with pytest.raises(ValueError, match=rf"^option {option}=.* of method '{method}' must be "):
    make_method(method, 4, **{option: value})


@pytest.mark.parametrize("method,options", [
    ("svip", {"h": "abc"}), ("sv", {"num_bins": "abc"}), ("sv", {"companion": 3}),
    ("hsddw", {"initial_threshold": "abc"}), ("hsddw", {"prior_weight": "abc"}),
    ("turbospec", {"beta": "abc"}), ("turbospec", {"cost_model": "abc"}),
    ("verify_skip", {"prior_weight": "abc"}), ("verify_skip", {"confidence_bins": "abc"})])
def test_the_reported_cases(method, options):
  with pytest.raises(ValueError, match="must be"):
    make_method(method, 4, **options)


def test_unknown_options_and_numpy_scalars():
  import numpy as np  # noqa: PLC0415

  with pytest.raises(ValueError, match=r"options \['nope'\] are not options of method 'ngram'"):
    make_method("ngram", 4, nope=1)
  assert make_method("ngram", 4, n_max=np.int64(3)).n_max == 3
  assert make_method("svip", 4, h=np.float32(0.5)).h == 0.5


def test_right_types_pass():
  assert make_method("svip", 4, h=1).h == 1  # an int for a float
  assert make_method("eagle3", 4, feature_layers=[1, 2, 3]).feature_layers is not None
  assert make_method("verify_skip", 4, confidence_bins=(0.5, 0.9)).confidence_bins
  assert make_method("suffix", 4, device=None).device is None
  assert len(CASES) > 40  # every method's typed options are covered
