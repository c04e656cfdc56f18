"""Every absl binary (``experiments``, ``benchmarks``) starts through ``harness.cli.run``:
``--help`` prints its flags and exits 0 (absl alone exits 1), and a bad flag is one
``error:`` line, exit 2."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _binaries(package: str) -> list[str]:
  """``package.module`` names of the package's absl binaries (modules defining flags)."""
  folder = os.path.join(ROOT, package)
  return sorted(f"{package}.{f[:-3]}" for f in os.listdir(folder)
                if f.endswith(".py") and not f.startswith("_")
                and "flags.DEFINE" in open(os.path.join(folder, f)).read())


BINARIES = _binaries("experiments") + _binaries("benchmarks")


def _start(*args):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  return subprocess.Popen([sys.executable, "-m", *args], cwd=ROOT, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_every_binary_uses_the_cli_runner():
  for name in BINARIES:
    text = open(os.path.join(ROOT, *name.split(".")) + ".py").read()
    assert "cli.run(main)" in text and "app.run(" not in text, name


@pytest.mark.slow
def test_help_exits_0_and_bad_flags_exit_2():
  """Run in parallel: one interpreter start per binary."""
  helps = {name: _start(name, "--help") for name in BINARIES}
  bad = _start("experiments.simulate_bounds", "--batch_sizes=x", "--traces=y")
  for name, proc in helps.items():
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, (name, err[-500:])
    assert "flags:" in out + err, name
  _, err = bad.communicate(timeout=300)
  assert bad.returncode == 2 and err.strip().startswith("error:"), err[-500:]
