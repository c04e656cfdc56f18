"""``harness.cli.option_value``: how a ``KEY=VALUE`` option's VALUE is read."""

import pytest

from harness.cli import option_value


@pytest.mark.parametrize("raw, want", [
    ("3", 3), ("0.5", 0.5), ("true", True), ("null", None), ('"x"', "x"),
    ("[1, 2]", (1, 2)), ("default", "default"), ("/heads/e3", "/heads/e3"), ("", ""),
])
def test_option_value_reads_json_else_keeps_the_string(raw, want):
  got = option_value(raw)
  assert got == want and type(got) is type(want)
