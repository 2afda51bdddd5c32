"""Gives the top-level names `kernels` and `trainer` back to the distributions that own them.

memopd's `kernels/` and `trainer/` sit at the repository root (they are `memopd.kernels` and
`memopd.trainer`). When the root is on sys.path, as under `python -m ...` or `python -m
pytest` from a checkout, a plain `import kernels` finds that folder first and shadows any
installed top-level package of the same name: transformers >= 5.25 imports Hugging Face's
`kernels` distribution at `import transformers.activations`, and would get memopd's folder
and fail with "cannot import name 'CUDAProperties'". Each root package's `__init__` calls
`hand_over` when it is imported under its bare name; the `kernels/` one then only holds
its docstring, so as a stand-in it is empty.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys


def hand_over(name: str, folder: str, *, keep_if_missing: bool) -> None:
    """Replace the bare-name module `name` (memopd's root `folder`, imported by mistake) in
    sys.modules by the same name found on sys.path outside the checkout, and run it; the
    import statement then returns that module. With no other package of that name: keep
    the bare module as an empty stand-in when `keep_if_missing` (transformers probes for
    `kernels` by importing it, and takes a module without a version for "not installed"),
    else ImportError naming the mix-up."""
    root = os.path.dirname(os.path.abspath(folder))
    elsewhere = [p for p in sys.path if os.path.abspath(p or os.curdir) != root]
    spec = importlib.machinery.PathFinder.find_spec(name, elsewhere)
    if spec is None or spec.loader is None:
        if keep_if_missing:
            return
        raise ImportError(
            f"no installed top-level package {name!r}: {folder} is memopd's own "
            f"(import it as memopd.{name}); it is only visible as {name!r} because the "
            f"repository root is on sys.path",
            name=name,
        )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
