"""The product packages' import graph, read from their source (no import runs): no
cycle among their modules, the experiments (trainer/experiments/) one-way on top of the
trainer, and no private name imported across modules.

Every import counts, those inside functions too: a lazy import hides a cycle from the
interpreter, not from a reader. `kernels/` and `trainer/` sit at the repository root and
are installed as `memopd.kernels` and `memopd.trainer` (setup.py), so they are read under
those names.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# package name -> its folder in the checkout
PACKAGES = {"memopd": ROOT / "memopd", "memopd.kernels": ROOT / "kernels", "memopd.trainer": ROOT / "trainer"}
EXPERIMENTS = "memopd.trainer.experiments"


def _modules() -> dict[str, Path]:
    """{dotted module name: source file} of every module of the product packages."""
    out = {}
    for pkg, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([pkg, *parts])
            if name.startswith("memopd.") and path.is_relative_to(ROOT / "memopd") and \
                    any(name.startswith(p + ".") or name == p for p in ("memopd.kernels", "memopd.trainer")):
                continue  # not a path that exists: memopd/ holds no kernels/ or trainer/ folder
            out[name] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, list[str], int]]:
    """(imported module, names taken from it, line) for every import statement of a module."""
    is_pkg = path.name == "__init__.py"
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, [], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base[: len(base) - node.level + 1]
                target = ".".join(anchor + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append((target, [a.name for a in node.names], node.lineno))
    return found


def _is_extension(package: str, name: str, modules: dict[str, Path]) -> bool:
    """`package.name` is a compiled extension module that setup.py builds (memopd._C),
    not a private name (built or not in this checkout)."""
    return f"{package}.{name}" in set(re.findall(r'CMakeExtension\("([\w.]+)"\)', (ROOT / "setup.py").read_text()))


def import_graph() -> tuple[dict[str, set[str]], list[str]]:
    """({module: the product modules it imports}, the private cross-module imports as
    'module:line: from X import _name')."""
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    private = []
    for name, path in modules.items():
        for target, names, line in _imports(name, path, modules):
            if target in modules:
                graph[name].add(target)
            for n in names:
                sub = f"{target}.{n}"
                if sub in modules:
                    graph[name].add(sub)  # `from package import module`
                elif target in modules and n.startswith("_") and not n.startswith("__") and target != name \
                        and not _is_extension(target, n, modules):
                    private.append(f"{name}:{line}: from {target} import {n}")
        graph[name].discard(name)
    return graph, private


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _is_package_init(a: str, b: str, modules: dict[str, Path]) -> bool:
    """`a` is a package whose __init__ re-exports from its own submodule `b` (an edge of
    the package's public face, not of the code's layering)."""
    return modules[a].name == "__init__.py" and b.startswith(a + ".")


def _layering_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph, _ = import_graph()
    # a package's __init__ re-exporting its submodules, and a submodule importing a sibling
    # through the package, is not a cycle of the code: drop the package -> own-submodule edges
    return {a: {b for b in bs if not _is_package_init(a, b, modules)} for a, bs in graph.items()}


def test_the_walk_reads_every_product_module_and_sees_real_edges():
    graph = _layering_graph()
    assert {"memopd.env.rollout", "memopd.env.qa.world", "memopd.trainer.loop", "memopd.kernels.fused_distill",
            "memopd.trainer.experiments.paper",
            "memopd.trainer.experiments.infogap_protocol", "memopd.trainer.experiments.runs"} <= set(graph)
    assert "memopd.env.qa.notes" in graph["memopd.env.qa.world"]
    assert "memopd.env.qa.retriever" in graph["memopd.env.qa.world"]  # the lazy import of the search index counts
    assert "memopd.trainer.loop" in graph["memopd.trainer.experiments.rulegap"]
    # the walk finds a cycle when there is one
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle_in_the_product_packages():
    found = cycles(_layering_graph())
    assert found == [], "import cycles (every import counts, lazy ones too):\n" + "\n".join(" <-> ".join(c) for c in found)


def test_no_private_name_is_imported_across_modules():
    """A name that another module needs is public (no leading underscore) where it lives:
    `from X import _name` across modules is refused (modules of the package itself, such
    as memopd._C, are modules, not names)."""
    _, private = import_graph()
    assert private == [], "private names imported across modules:\n" + "\n".join(private)


def test_the_walk_finds_a_private_import(tmp_path, monkeypatch):
    pkg = tmp_path / "memopd"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("_hidden = 1\n")
    (pkg / "b.py").write_text("def f():\n    from memopd.a import _hidden\n    return _hidden\n")
    monkeypatch.setitem(globals(), "PACKAGES", {"memopd": pkg})
    graph, private = import_graph()
    assert graph["memopd.b"] == {"memopd.a"} and private == ["memopd.b:2: from memopd.a import _hidden"]


def test_the_experiments_sit_on_top_of_the_product():
    graph = _layering_graph()
    up = sorted(f"{a} -> {b}" for a, bs in graph.items() if not a.startswith(EXPERIMENTS)
                for b in bs if b.startswith(EXPERIMENTS))
    assert up == [], "product modules importing the experiments:\n" + "\n".join(up)
