"""The package layout: `kernels/` and `trainer/` at the repository root are `memopd.kernels`
and `memopd.trainer`, installed (setup.py's package mapping) or imported from a source
checkout (memopd's import hook), each module exactly once; the DeepSpeed examples ship as
package data; a command whose optional dependency is missing names the extra to install.

Runs against whichever memopd this interpreter imports: the checkout (editable install,
or `python -m pytest` from the repository root) or an installed copy (`pip install .`)."""
import ast
import importlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import memopd

REPO = Path(__file__).resolve().parents[2]
PACKAGE = Path(memopd.__file__).resolve().parent
FROM_CHECKOUT = PACKAGE == REPO / "memopd"


def _expected_dir(subpackage: str) -> Path:
    return REPO / subpackage if FROM_CHECKOUT else PACKAGE / subpackage


def test_no_symlinks_in_the_package_tree():
    assert not (REPO / "memopd" / "kernels").exists() and not (REPO / "memopd" / "kernels").is_symlink()
    assert not (REPO / "memopd" / "trainer").exists() and not (REPO / "memopd" / "trainer").is_symlink()
    links = [p for p in (REPO / "memopd").rglob("*") if p.is_symlink()]
    assert links == []


@pytest.mark.parametrize("subpackage", ["kernels", "trainer"])
def test_root_packages_resolve_to_their_sources(subpackage):
    mod = importlib.import_module(f"memopd.{subpackage}")
    assert Path(mod.__file__).resolve() == _expected_dir(subpackage) / "__init__.py"
    assert [Path(p).resolve() for p in mod.__path__] == [_expected_dir(subpackage)]


def test_each_module_is_loaded_once():
    import memopd._C  # noqa: F401
    import memopd.kernels  # noqa: F401
    import memopd.trainer.backend  # noqa: F401
    import memopd.trainer.config  # noqa: F401

    by_file = {}
    for name, mod in list(sys.modules.items()):
        f = getattr(mod, "__file__", None)
        if f and (name == "memopd" or name.startswith("memopd.")):
            by_file.setdefault(os.path.realpath(f), set()).add(name)
    twice = {f: names for f, names in by_file.items() if len(names) > 1}
    assert twice == {}
    # the repository root is on sys.path under `python -m pytest`: nothing may import the
    # sources as top-level `trainer` / `kernels` modules (a top-level `kernels` may be Hugging
    # Face's, which transformers >= 5.25 imports). transformers' probe for that package
    # imports a top-level `kernels` it finds, so kernels/__init__.py imports nothing beyond
    # the standard library.
    def from_our_folders(mod) -> bool:
        f = Path(getattr(mod, "__file__", None) or "/").resolve()
        return f.is_relative_to(REPO / "kernels") or f.is_relative_to(REPO / "trainer")

    # the bare `kernels` may be the empty stand-in (no Hugging Face package installed)
    top_level = [n for n, mod in list(sys.modules.items())
                 if n.split(".")[0] in ("kernels", "trainer") and n != "kernels" and from_our_folders(mod)]
    assert top_level == []
    init = ast.parse((REPO / "kernels" / "__init__.py").read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(init) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(init) if isinstance(node, ast.ImportFrom)}
    assert imported <= {"__future__", "os", "runpy"}


def test_deepspeed_examples_ship_with_the_trainer(tmp_path, monkeypatch):
    import memopd.trainer
    from memopd.trainer.deepspeed_config import load_deepspeed_config

    configs = Path(memopd.trainer.__file__).resolve().parent / "configs"
    for name, stage in (("ds_zero2.json", 2), ("ds_zero3.json", 3)):
        assert json.loads((configs / name).read_text())["zero_optimization"]["stage"] == stage
    # the README's spelling, from a directory that holds no copy of them
    monkeypatch.chdir(tmp_path)
    assert load_deepspeed_config("trainer/configs/ds_zero2.json")["zero_optimization"]["stage"] == 2
    assert load_deepspeed_config("ds_zero3.json")["zero_optimization"]["stage"] == 3
    with pytest.raises(FileNotFoundError):
        load_deepspeed_config("elsewhere/ds_zero2.json")  # another folder is the user's path, not the example
    (tmp_path / "ds_zero2.json").write_text(json.dumps({"zero_optimization": {"stage": 1}}))
    assert load_deepspeed_config("ds_zero2.json")["zero_optimization"]["stage"] == 1  # an existing file wins


def test_imports_from_the_repository_root():
    """What `python -c` (sys.path[0] = '') sees from the root: the checkout's memopd."""
    code = (
        "import json, importlib.util, memopd, memopd._C, memopd.kernels, memopd.trainer.backend\n"
        "out = {n: __import__(n, fromlist=['_']).__file__ for n in ('memopd', 'memopd.kernels', 'memopd.trainer')}\n"
        "out['plan'] = memopd._C.plan_rows([3, 4], [-1, -1], [], 10)\n"
        "if importlib.util.find_spec('triton') is not None:\n"
        "    import memopd.kernels.fused_distill as k\n"
        "    out['triton'] = k.__file__\n"
        "print(json.dumps(out))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(got["memopd"]).resolve() == REPO / "memopd" / "__init__.py"
    assert Path(got["memopd.kernels"]).resolve() == REPO / "kernels" / "__init__.py"
    assert Path(got["memopd.trainer"]).resolve() == REPO / "trainer" / "__init__.py"
    assert got["plan"] == [0, 0]
    if "triton" in got:
        assert Path(got["triton"]).resolve() == REPO / "kernels" / "fused_distill.py"


@pytest.mark.parametrize("name", ["kernels", "trainer"])
def test_bare_root_names_go_to_the_installed_package_of_that_name(tmp_path, name):
    """From the repository root, `import kernels` must not find memopd's kernels/:
    transformers >= 5.25 imports Hugging Face's `kernels` distribution by that name. An
    installed package of the name (here a stand-in behind the root on sys.path) wins; with
    none, the ImportError names the mix-up."""
    other = tmp_path / "site" / name
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("MARK = 'the installed one'\n")
    code = f"import {name}, memopd.{name} as ours; print({name}.MARK, ours.__name__)"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(tmp_path / "site")  # after '' (the root): the shadowing order
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.split() == ["the", "installed", "one", f"memopd.{name}"]



def test_a_bare_root_name_with_no_installed_package_names_the_mix_up(tmp_path):
    from memopd._root_names import hand_over

    folder = tmp_path / "memopd_no_such_package"
    folder.mkdir()
    with pytest.raises(ImportError, match=r"is memopd's own \(import it as memopd.memopd_no_such_package\)"):
        hand_over("memopd_no_such_package", str(folder), keep_if_missing=False)
    assert "memopd_no_such_package" not in sys.modules
    hand_over("memopd_no_such_package", str(folder), keep_if_missing=True)  # no error, no module


def test_transformers_imports_from_the_repository_root():
    """transformers probes for Hugging Face's `kernels` by importing it: from the root that
    name must resolve to the installed distribution, or to an empty stand-in without a
    version (so transformers sees none), never break `import transformers.activations`."""
    pytest.importorskip("transformers")
    code = "import transformers.activations, kernels; print(getattr(kernels, '__version__', 'N/A'))"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    import importlib.metadata

    try:
        expected = importlib.metadata.version("kernels")  # Hugging Face's, a dependency of transformers >= 5.25
    except importlib.metadata.PackageNotFoundError:
        expected = "N/A"
    assert proc.stdout.strip().splitlines()[-1] == expected


class _InstalledCopy:
    """An installed distribution whose file list maps names to the given real files."""

    def __init__(self, files: dict[str, str]):
        self.files = list(files)
        self._where = files

    def locate_file(self, f):
        return self._where[f]


def test_checkout_finder_takes_the_installed_compiled_core(monkeypatch):
    """A checkout whose core is not built in place (a fresh clone after `pip install .`)
    imports the installed copy's `_C`."""
    import importlib.metadata

    import memopd._C as built

    name = "memopd/" + os.path.basename(built.__file__)
    monkeypatch.setattr(importlib.metadata, "distributions", lambda **_: iter([_InstalledCopy({name: built.__file__})]))
    monkeypatch.setattr(memopd, "_HERE", "/nonexistent/checkout/memopd")
    spec = memopd._CheckoutFinder(front=False).find_spec("memopd._C")
    assert spec is not None and Path(spec.origin).resolve() == Path(built.__file__).resolve()
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.plan_rows([3, 4], [-1, -1], [], 10) == [0, 0]


def test_checkout_finder_ignores_the_checkouts_own_files_and_other_names(monkeypatch):
    import importlib.metadata

    import memopd._C as built

    # the only listed core lies in this very directory (the checkout's egg-info): not a copy
    here = os.path.dirname(os.path.abspath(built.__file__))
    name = "memopd/" + os.path.basename(built.__file__)
    monkeypatch.setattr(importlib.metadata, "distributions", lambda **_: iter([_InstalledCopy({name: built.__file__})]))
    monkeypatch.setattr(memopd, "_HERE", here)
    assert memopd._CheckoutFinder(front=False).find_spec("memopd._C") is None
    for other in ("memopd.tests", "memopd.setup", "memopd.benchmarks", "kernels", "trainer"):
        assert memopd._CheckoutFinder(front=False).find_spec(other) is None


def test_checkout_finder_falls_back_to_the_installed_subpackage(monkeypatch, tmp_path):
    """A memopd/ with no kernels/ beside it takes an installed copy's memopd.kernels."""
    import importlib.metadata

    installed = tmp_path / "site" / "memopd" / "kernels"
    installed.mkdir(parents=True)
    (installed / "__init__.py").write_text("")
    lonely = tmp_path / "lonely" / "memopd"
    lonely.mkdir(parents=True)
    monkeypatch.setattr(importlib.metadata, "distributions",
                        lambda **_: iter([_InstalledCopy({"memopd/kernels/__init__.py": str(installed / "__init__.py")})]))
    monkeypatch.setattr(memopd, "_HERE", str(lonely))
    spec = memopd._CheckoutFinder(front=False).find_spec("memopd.kernels")
    assert Path(spec.origin) == installed / "__init__.py"
    assert spec.submodule_search_locations == [str(installed)]
    assert memopd._CheckoutFinder(front=False).find_spec("memopd.trainer") is None  # not installed, not beside it


def test_front_finder_maps_only_the_checkouts_own_subpackages(monkeypatch, tmp_path):
    """The finder at the front of sys.meta_path gives `memopd.kernels` / `memopd.trainer`
    from beside this memopd/ (so another checkout's editable install cannot supply them),
    and leaves everything else, the compiled core included, to the other finders."""
    if os.path.isdir(os.path.join(memopd._HERE, "kernels")):
        pytest.skip("memopd is an installed copy here: it holds its subpackages and registers no finder")
    front = memopd._CheckoutFinder(front=True)
    assert isinstance(sys.meta_path[0], memopd._CheckoutFinder) and sys.meta_path[0].front
    spec = front.find_spec("memopd.trainer")
    assert Path(spec.origin).resolve() == (REPO / "trainer" / "__init__.py").resolve()
    for other in ("memopd._C", "memopd.ops", "memopd.tests", "trainer", "kernels"):
        assert front.find_spec(other) is None
    lonely = tmp_path / "lonely" / "memopd"
    lonely.mkdir(parents=True)
    monkeypatch.setattr(memopd, "_HERE", str(lonely))
    assert front.find_spec("memopd.kernels") is None  # nothing beside it: the fallbacks decide


_BLOCKER = """
import sys
from importlib.abc import MetaPathFinder

class Missing(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == {module!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, Missing())
for name in [m for m in sys.modules if m.split(".")[0] == {module!r}]:
    del sys.modules[name]
from memopd.cli import main
sys.exit(main({argv!r}))
"""


@pytest.mark.parametrize("command, module, package, extra", [
    (["train", "steps=1"], "transformers", "transformers", "train"),
    (["train", "steps=1"], "yaml", "pyyaml", "train"),
    (["sft", "--help"], "transformers", "transformers", "train"),
    (["eval", "--help"], "transformers", "transformers", "train"),
    (["compare", "--help"], "yaml", "pyyaml", "train"),
    (["audit"], "transformers", "transformers", "train"),
    (["plot", "runs/x"], "matplotlib", "matplotlib", "plot"),
])
def test_missing_extra_is_one_line_and_exit_2(tmp_path, command, module, package, extra):
    """Checked before the command starts: nothing is loaded, trained or written."""
    code = _BLOCKER.format(module=module, argv=command)
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(PACKAGE.parent), os.environ.get("PYTHONPATH", "")])})
    assert proc.returncode == 2, (proc.stdout[-2000:], proc.stderr[-4000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-4000:]
    assert lines[0] == (f"memopd {command[0]}: error: this command needs {package}, which is not installed: "
                        f"pip install 'memopd[{extra}]' (in a checkout: pip install '.[{extra}]')")
    assert list(tmp_path.iterdir()) == []


def test_missing_deepspeed_wrapped_by_the_backend_names_its_extra():
    from memopd.cli import _missing_extra

    try:
        try:
            raise ModuleNotFoundError("No module named 'deepspeed'", name="deepspeed")
        except ImportError as e:
            raise ImportError("deepspeed_config given but deepspeed is not installed") from e
    except ImportError as wrapped:
        assert _missing_extra(wrapped) == ("deepspeed", "deepspeed")
    assert _missing_extra(ModuleNotFoundError("No module named 'memopd.nope'", name="memopd.nope")) is None
    assert _missing_extra(ImportError("cannot import name 'x' from 'transformers'")) is None
