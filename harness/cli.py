"""How the absl binaries in ``experiments/`` start, fail and log.

``run(main)`` wraps ``absl.app.run``:

- ``--help``/``--helpshort``/``--helpfull`` print the help and exit 0 (absl exits 1);
- a bad flag value, or a ``ValueError``/``FileNotFoundError`` raised by ``main`` (the
  library's caller errors), prints one line ``error: ...`` to stderr and exits 2: no
  traceback, no help dump;
- absl (and orbax, which logs through it) INFO lines are hidden unless ``--verbosity``
  is given (``--verbosity=0`` shows INFO).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable

from absl import app, flags, logging

__all__ = ["key_value_options", "option_value", "run"]

_HELP_FLAGS = ("--help", "-help", "-h", "--helpshort", "--helpfull", "--helpxml", "-?")


def option_value(raw: str) -> object:
  """The value of a ``KEY=VALUE`` option entry: ``raw`` read as JSON when it parses
  (``"3"`` -> 3, ``"true"`` -> True, ``"[1, 2]"`` -> ``(1, 2)``: lists become tuples, so
  method configs stay hashable static jit arguments), else the string itself."""
  try:
    value = json.loads(raw)
  except json.JSONDecodeError:
    return raw
  return tuple(value) if isinstance(value, list) else value


def key_value_options(entries, flag: str) -> dict:
  """``["window=16", "matmul_precision=default"]`` -> ``{"window": 16, ...}`` (values by
  ``option_value``), e.g. a repeatable ``--drafter_option``.

  Raises:
    ValueError: an entry not of the form KEY=VALUE (naming ``--flag``).
  """
  out = {}
  for entry in entries:
    key, sep, raw = entry.partition("=")
    if not (sep and key):
      raise ValueError(f"--{flag}={entry!r} must look like KEY=VALUE")
    out[key] = option_value(raw)
  return out


def int_list(flag) -> tuple[int, ...]:
  """A list flag's values as ints (``flags.DEFINE_list``). Raises ValueError naming the
  flag and its value when one is not an integer."""
  try:
    return tuple(int(v) for v in flag.value)
  except ValueError:
    raise ValueError(f"--{flag.name}={','.join(flag.value)} must be a comma-separated list "
                     "of integers") from None


def _fail(message: str) -> None:
  print(f"error: {message}", file=sys.stderr)
  sys.exit(2)


def _parse(argv: list[str]) -> list[str]:
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    _fail(str(e))
  except SystemExit:  # absl's help flags exit 1 after printing the help
    if any(a.split("=")[0] in _HELP_FLAGS for a in argv[1:]):
      sys.exit(0)
    raise
  return []


def run(main: Callable[[list[str]], object]) -> None:
  """``absl.app.run(main)`` with the behaviour above."""

  def wrapped(argv):
    if not flags.FLAGS["verbosity"].present:
      logging.set_verbosity(logging.WARNING)
    try:
      return main(argv)
    except app.UsageError as e:
      _fail(str(e))
    except (ValueError, FileNotFoundError, NotADirectoryError) as e:
      _fail(" ".join(str(e).split()) or type(e).__name__)

  app.run(wrapped, flags_parser=_parse)
