"""The architecture as the imports show it: lower layers import nothing above them, and an import
inside a function says why it is deferred.

Layers, lowest first: ``models`` < ``components`` < ``monitoring`` < ``deploy`` < ``lifecycle`` and
``recipes`` (siblings: neither imports the other) < ``flows`` and ``benchmarks``. Inside
``components`` the subpackages are layered too (``COMPONENT_ORDER``). An import inside a function is
allowed only for a dependency that is heavy or optional, with a ``# deferred: <why>`` comment on the
import or above its group; one hidden inside a function to dodge a cycle is exactly what this forbids.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {"models": 0, "components": 1, "monitoring": 2, "deploy": 3, "lifecycle": 4, "recipes": 4,
          "flows": 5, "benchmarks": 5}
COMPONENT_ORDER = ["services", "pipeline", "data", "metrics", "registry", "decoding", "parsing", "curation",
                   "training", "evaluation"]


def imports_of(path: Path) -> list[tuple[ast.stmt, str, bool]]:
    """(node, imported module, inside a function) for every absolute import of ``path``."""
    tree = ast.parse(path.read_text())
    in_function: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            in_function.update(id(sub) for sub in ast.walk(node))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node, node.module, id(node) in in_function))
        elif isinstance(node, ast.Import):
            found.extend((node, alias.name, id(node) in in_function) for alias in node.names)
    return found


def rank(module: str) -> tuple[int, int] | None:
    """A module's place: (layer, component sub-layer); None outside the project."""
    parts = module.split(".")
    if parts[0] not in LAYERS:
        return None
    sub = COMPONENT_ORDER.index(parts[1]) if parts[0] == "components" and len(parts) > 1 and parts[1] in COMPONENT_ORDER else -1
    return LAYERS[parts[0]], sub


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def upward_edges(paths: list[Path], root: Path = ROOT) -> list[str]:
    edges = []
    for path in paths:
        source = module_name(path, root)
        here = rank(source)
        for node, target, _ in imports_of(path):
            there = rank(target)
            if there is None or (target.split(".")[0] == source.split(".")[0] and there[1] == here[1]):
                continue
            sibling = there[0] == here[0] and target.split(".")[0] != source.split(".")[0]
            if there > here or sibling:
                edges.append(f"{path.relative_to(root)}:{node.lineno}: {source} imports {target}")
    return edges


def unexplained_deferred_imports(paths: list[Path], root: Path = ROOT) -> list[str]:
    found = []
    for path in paths:
        lines = path.read_text().splitlines()
        for node, target, inside in imports_of(path):
            if not inside:
                continue
            index = node.lineno - 1
            while index >= 0 and "deferred:" not in lines[index]:  # the group's reason sits above its first import
                above = lines[index - 1].strip() if index else ""
                if not above.startswith(("import ", "from ", "# deferred:")):
                    break
                index -= 1
            if index < 0 or "deferred:" not in lines[index]:
                found.append(f"{path.relative_to(root)}:{node.lineno}: import of {target} inside a function, no reason")
    return found


def project_files() -> list[Path]:
    return sorted(p for layer in LAYERS for p in (ROOT / layer).rglob("*.py") if "model_repository" not in p.parts)


def test_no_layer_imports_a_layer_above_it():
    assert upward_edges(project_files()) == []


def test_every_import_inside_a_function_says_why_it_is_deferred():
    assert unexplained_deferred_imports(project_files()) == []


@pytest.mark.parametrize(("file", "text", "complaint"), [
    ("components/data/upward.py", "from components.parsing.layout import rapid\n", "components.data.upward imports"),
    ("models/upward.py", "def f():\n    from components.data import pages  # deferred: heavy\n", "models.upward imports"),
    ("lifecycle/sibling.py", "import recipes.pretrain\n", "lifecycle.sibling imports recipes"),
    ("components/data/hidden.py", "def f():\n    import torch\n", "import of torch inside a function, no reason"),
])
def test_the_checks_catch_an_upward_edge_a_sibling_edge_and_a_hidden_import(tmp_path, file, text, complaint):
    path = tmp_path / file
    path.parent.mkdir(parents=True)
    path.write_text(text)
    complaints = upward_edges([path], tmp_path) + unexplained_deferred_imports([path], tmp_path)
    assert any(complaint in line for line in complaints), complaints
