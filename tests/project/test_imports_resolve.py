"""Every `import memopd...` / `from memopd... import` in the repository's Python files,
function-level and relative ones included, names a module that exists: a moved module
leaves no lazy import behind that only fails when its branch first runs."""
from __future__ import annotations

import ast
import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TREES = ("memopd", "trainer", "kernels", "benchmarks", "tests", "examples")


def _module_of(rel: str) -> tuple[str, bool]:
    name = rel[:-3].replace(os.sep, ".")
    if name.split(".")[0] in ("kernels", "trainer"):
        name = "memopd." + name  # installed as memopd.kernels / memopd.trainer
    is_pkg = name.endswith(".__init__")
    return (name[: -len(".__init__")] if is_pkg else name), is_pkg


def _imports(rel: str):
    me, is_pkg = _module_of(rel)
    pkg = me if is_pkg else me.rpartition(".")[0]
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        tree = ast.parse(f.read(), rel)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = pkg.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                yield node.lineno, ".".join(parts + ([node.module] if node.module else []))
            elif node.module:
                yield node.lineno, node.module
        elif isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name


def _files():
    for tree in TREES:
        for dirpath, _, names in os.walk(os.path.join(ROOT, tree)):
            for n in sorted(names):
                if n.endswith(".py"):
                    yield os.path.relpath(os.path.join(dirpath, n), ROOT)


@pytest.mark.parametrize("tree", TREES)
def test_every_memopd_import_names_an_existing_module(tree):
    missing = []
    for rel in _files():
        if not rel.startswith(tree + os.sep):
            continue
        for line, mod in _imports(rel):
            if mod.split(".")[0] != "memopd":
                continue
            try:
                found = importlib.util.find_spec(mod) is not None
            except ModuleNotFoundError:
                found = False
            if not found:
                missing.append(f"{rel}:{line}: {mod}")
    assert not missing, "imports of modules that do not exist:\n" + "\n".join(missing)
