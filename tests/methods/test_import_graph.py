"""The import graph of the packages has no cycle; in particular no method imports the
registry (composites get their inner methods built: ``Method.inner_methods``). Imports
point down the layers (pallas_kernels < models < specjax < methods < harness <
experiments, benchmarks), and no lower package reaches a higher one's files by path.

Imports are read with ``ast`` from the source (module level and inside functions alike),
so nothing is imported to check them.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("pallas_kernels", "models", "specjax", "methods", "harness", "experiments",
            "benchmarks")
# Package -> its layer (ARCHITECTURE.md section 1): imports go to the same layer or below.
LAYER = {"pallas_kernels": 0, "models": 1, "specjax": 2, "methods": 3, "harness": 4,
         "experiments": 5, "benchmarks": 5}
# Folders whose files a lower layer must not name ("specjax" is also the project's name,
# e.g. its cache directory, so it is left out).
_UPPER_FOLDERS = ("harness", "experiments", "benchmarks")


def _modules() -> dict[str, pathlib.Path]:
  """Dotted module name -> file, for every module of ``PACKAGES``."""
  out = {}
  for package in PACKAGES:
    for path in sorted((ROOT / package).rglob("*.py")):
      parts = path.relative_to(ROOT).with_suffix("").parts
      out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
  return out


def _imported(name: str, path: pathlib.Path) -> set[str]:
  """Dotted names ``path`` (module ``name``) imports: ``from a.b import c`` gives
  ``a.b.c`` (a submodule, or a name defined in ``a.b``: ``_graph`` resolves it). Imports
  under ``if TYPE_CHECKING:`` are left out: annotations only, never run."""
  tree = ast.parse(path.read_text(), str(path))
  typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                 and "TYPE_CHECKING" in ast.unparse(block.test)
                 for stmt in block.body for n in ast.walk(stmt)}
  out = set()
  for node in ast.walk(tree):
    if id(node) in typing_only:
      continue
    if isinstance(node, ast.Import):
      out.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:  # relative: from the module's package, up level - 1 more
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
      out.update(f"{base}.{a.name}" for a in node.names)
  return out


def _graph() -> dict[str, set[str]]:
  """Module -> the modules of ``PACKAGES`` it imports. ``from p import m`` of a submodule
  is an edge to ``p.m`` only (Python imports the parents of every module anyway); of a
  name defined in ``p`` it is an edge to ``p``."""
  modules = _modules()

  def resolve(dotted):
    while dotted and dotted not in modules:
      dotted = dotted.rpartition(".")[0]
    return dotted or None

  graph = {}
  for name, path in modules.items():
    targets = {resolve(d) for d in _imported(name, path)}
    graph[name] = {t for t in targets if t and t != name}
  return graph


def _cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
  """The strongly connected components of more than one module (Tarjan, iterative)."""
  index, low, stack, on_stack, out = {}, {}, [], set(), []
  for root in graph:
    if root in index:
      continue
    work = [(root, iter(sorted(graph[root])))]
    index[root] = low[root] = len(index)
    stack.append(root)
    on_stack.add(root)
    while work:
      node, children = work[-1]
      child = next(children, None)
      if child is not None:
        if child not in index:
          index[child] = low[child] = len(index)
          stack.append(child)
          on_stack.add(child)
          work.append((child, iter(sorted(graph[child]))))
        elif child in on_stack:
          low[node] = min(low[node], index[child])
        continue
      work.pop()
      if work:
        low[work[-1][0]] = min(low[work[-1][0]], low[node])
      if low[node] == index[node]:
        component = set()
        while True:
          member = stack.pop()
          on_stack.discard(member)
          component.add(member)
          if member == node:
            break
        if len(component) > 1:
          out.append(frozenset(component))
  return out


def test_no_method_imports_the_registry():
  offenders = [f"{name} imports {target}" for name, targets in _graph().items()
               if name.startswith("methods.") and name != "methods.registry"
               for target in targets if target == "methods.registry"]
  assert not offenders, offenders


def test_the_import_graph_has_no_new_cycle():
  cycles = _cycles(_graph())
  assert not cycles, [sorted(c) for c in cycles]


def test_imports_point_down_the_layers():
  offenders = [f"{name} imports {target}" for name, targets in _graph().items()
               for target in targets
               if LAYER[target.split(".")[0]] > LAYER[name.split(".")[0]]]
  assert not offenders, offenders


def _upper_folder_names(name: str, path: pathlib.Path) -> list[str]:
  """String constants of ``path`` (module ``name``) that are exactly the folder name of a
  higher layer, e.g. ``"harness"`` in ``os.path.join(here, "..", "harness", "data")``."""
  upper = {f for f in _UPPER_FOLDERS if LAYER[f] > LAYER[name.split(".")[0]]}
  return [f"{name}:{node.lineno} names {node.value!r}"
          for node in ast.walk(ast.parse(path.read_text(), str(path)))
          if isinstance(node, ast.Constant) and node.value in upper]


def test_no_lower_layer_names_a_higher_layers_folder():
  offenders = [o for name, path in _modules().items() for o in _upper_folder_names(name, path)]
  assert not offenders, offenders


def test_the_checker_sees_a_path_into_the_harness(tmp_path):
  path = tmp_path / "m.py"
  path.write_text('import os\nP = os.path.join("..", "harness", "data")  # a path\n')
  assert _upper_folder_names("methods.m", path) == ["methods.m:2 names 'harness'"]
  assert _upper_folder_names("harness.m", path) == []


@pytest.mark.parametrize("graph, expected", [
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [frozenset("abc")]),
    ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
    ({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c"}}, [frozenset("ab"), frozenset("cd")]),
])
def test_cycles_finds_the_components(graph, expected):
  assert sorted(map(sorted, _cycles(graph))) == sorted(map(sorted, expected))


def test_the_checker_sees_a_function_level_registry_import(tmp_path):
  path = tmp_path / "m.py"
  path.write_text("def f():\n  from methods.registry import make_method  # noqa\n")
  assert "methods.registry.make_method" in _imported("methods.m", path)
