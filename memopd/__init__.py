"""memopd: Memory-Aligned On-Policy Distillation for compact-memory LLM agents.

Records (`Invocation`, `Trajectory`), memory policies, the pack compiler (`pack`,
`PackedBatch`), the ops (`memopd.ops`), the HF packed forward, the RCE audit and the
trainer are all reachable from here. Heavy submodules load on first use.

`memopd.kernels` and `memopd.trainer` live at the repository root (kernels/, trainer/),
which is the project's required layout, so they are mapped rather than moved: the build
maps them into the package (setup.py). When this `memopd/` is a source
checkout (e.g. `python -m pytest` from the repository root puts it first on sys.path,
even after a non-editable `pip install .`), `_CheckoutFinder` resolves exactly those two
subpackages to the checkout's kernels/ and trainer/, and `memopd._C`, when it was not
built in place, to the compiled core of an installed copy.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

from .memory import (
    POLICIES,
    ContextUpdate,
    FullRetention,
    MemoryPolicy,
    RetrievalRefresh,
    SlidingWindow,
    SuffixRetention,
    SummaryReplacement,
    drive,
    make_policy,
    random_trajectories,
)
from .records import (
    Invocation,
    RecordError,
    Source,
    Trajectory,
    load_trajectories,
    save_trajectories,
    validate_trajectories,
)

_HERE = os.path.dirname(os.path.abspath(__file__))
# subpackages whose sources sit at the repository root, next to memopd/ (setup.py maps them)
_ROOT_PACKAGES = {"memopd.kernels": "kernels", "memopd.trainer": "trainer"}


def _installed_copy_file(wanted) -> str | None:
    """Path of the first file of an installed memopd distribution, outside this directory,
    for which `wanted(relative_path)` holds; None when there is none. The checkout's own
    build metadata (memopd.egg-info, found first from the root) lists files that live in
    this directory, and an editable install lists none of the package's files."""
    import importlib.metadata

    for dist in importlib.metadata.distributions(name="memopd"):
        for f in dist.files or ():
            if not wanted(str(f).replace("\\", "/")):
                continue
            path = os.path.abspath(str(dist.locate_file(f)))
            if os.path.isfile(path) and not path.startswith(_HERE + os.sep):
                return path
    return None


def _is_compiled_core(name: str) -> bool:
    return name.startswith("memopd/_C.") and name.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))


class _CheckoutFinder(importlib.abc.MetaPathFinder):
    """Finds `memopd.kernels`, `memopd.trainer` and `memopd._C` for a source checkout, whose
    `memopd/` holds none of them.

    Two instances: the first, at the front of `sys.meta_path`, maps the two subpackages to
    `kernels/` and `trainer/` beside this `memopd/` (so an editable install of another
    checkout cannot mix its subpackages into this one); the last, after the standard
    finders, falls back to an installed copy's subpackages and compiled core (a core built
    in place with `pip install -e .` is found first by the standard finders)."""

    def __init__(self, front: bool):
        self.front = front

    def find_spec(self, fullname, path=None, target=None):
        if fullname in _ROOT_PACKAGES:
            init = os.path.join(os.path.dirname(_HERE), _ROOT_PACKAGES[fullname], "__init__.py")
            if not os.path.isfile(init):
                if self.front:
                    return None
                wanted = fullname.replace(".", "/") + "/__init__.py"
                init = _installed_copy_file(lambda name: name == wanted)
            if init is None:
                return None
            return importlib.util.spec_from_file_location(fullname, init, submodule_search_locations=[os.path.dirname(init)])
        if fullname == "memopd._C" and not self.front:
            core = _installed_copy_file(_is_compiled_core)
            return None if core is None else importlib.util.spec_from_file_location(fullname, core)
        return None


# an installed copy holds kernels/ and trainer/ itself and needs no finder
if not os.path.isdir(os.path.join(_HERE, "kernels")) and not any(type(f).__name__ == "_CheckoutFinder" for f in sys.meta_path):
    sys.meta_path.insert(0, _CheckoutFinder(front=True))
    sys.meta_path.append(_CheckoutFinder(front=False))


__version__ = "0.1.0"

__all__ = [
    "Invocation", "RecordError", "Source", "Trajectory", "load_trajectories", "save_trajectories",
    "validate_trajectories", "POLICIES", "ContextUpdate", "FullRetention", "MemoryPolicy", "RetrievalRefresh",
    "SlidingWindow", "SuffixRetention", "SummaryReplacement", "drive", "make_policy", "random_trajectories",
    "pack", "LAYOUTS", "PackedBatch", "AttentionMeta", "PackError", "__version__",
]

_LAZY = {
    "pack": "memopd.packing",
    "LAYOUTS": "memopd.packing",
    "PackedBatch": "memopd.layout",
    "AttentionMeta": "memopd.layout",
    "PackError": "memopd.packing",
}
_SUBMODULES = ("ops", "kernels", "trainer", "hf", "rce", "env", "packing", "layout", "planner")


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"memopd.{name}")
    raise AttributeError(f"module 'memopd' has no attribute {name!r}")
