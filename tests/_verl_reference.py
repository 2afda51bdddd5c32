"""verl's own loss functions, for comparing memopd's verl hooks with them.

`load_verl_core()` returns `(core_algos, torch_functional)`: the modules
`verl.trainer.ppo.core_algos` and `verl.utils.torch_functional` of the installed verl
(tested with 0.9.1), executed from their own files. Importing them the ordinary way
runs `verl/__init__.py`, which needs ray, tensordict, transformers and more; the
functions compared here (`agg_loss`, `compute_policy_loss_vanilla`,
`logprobs_from_logits`, `entropy_from_logits`, `masked_mean`) need only torch and
omegaconf, so the package `__init__` files are skipped and the few names those two
files import but these functions never call are given placeholders. None if verl (or
omegaconf) is not installed: the tests skip with that reason.
"""
from __future__ import annotations

import importlib.util
import os
import sys
import types

_CACHE: dict = {}


def _namespace(name: str, path: str | None) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__path__ = [path] if path else []
    return mod


def _exec_file(name: str, path: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def load_verl_core():
    """(core_algos, torch_functional) of the installed verl, or raise ImportError why not."""
    if "core" in _CACHE:
        return _CACHE["core"]
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("verl is not installed (pip install --no-deps 'verl==0.9.*')")
    importlib.import_module("omegaconf")  # core_algos imports DictConfig
    root = list(spec.submodule_search_locations)[0]
    saved = {k: v for k, v in sys.modules.items() if k == "verl" or k.startswith("verl.") or k == "tensordict"}
    placeholders = {
        "verl": _namespace("verl", root),
        "verl.utils": _namespace("verl.utils", os.path.join(root, "utils")),
        "verl.trainer": _namespace("verl.trainer", os.path.join(root, "trainer")),
        "verl.trainer.ppo": _namespace("verl.trainer.ppo", os.path.join(root, "trainer", "ppo")),
        "verl.trainer.config": _namespace("verl.trainer.config", None),
        "verl.workers": _namespace("verl.workers", None),
        "verl.workers.config": _namespace("verl.workers.config", None),
        "verl.utils.device": _namespace("verl.utils.device", None),
    }
    placeholders["verl.trainer.config"].AlgoConfig = type("AlgoConfig", (), {})
    placeholders["verl.workers.config"].ActorConfig = type("ActorConfig", (), {})
    placeholders["verl.utils.device"].get_device_name = lambda: "cpu"
    placeholders["verl.utils.device"].get_torch_device = lambda: None
    if importlib.util.find_spec("tensordict") is None:
        placeholders["tensordict"] = _namespace("tensordict", None)
        placeholders["tensordict"].TensorDict = type("TensorDict", (), {})
    try:
        sys.modules.update(placeholders)
        _exec_file("verl.utils.import_utils", os.path.join(root, "utils", "import_utils.py"))
        groupwise = _exec_file("verl.utils.groupwise", os.path.join(root, "utils", "groupwise.py"))
        placeholders["verl.utils"].as_torch_index = groupwise.as_torch_index
        placeholders["verl.utils"].group_mean_std = groupwise.group_mean_std
        tf = _exec_file("verl.utils.torch_functional", os.path.join(root, "utils", "torch_functional.py"))
        core = _exec_file("verl.trainer.ppo.core_algos", os.path.join(root, "trainer", "ppo", "core_algos.py"))
    finally:  # nothing of this partial verl stays importable for other tests
        for k in [k for k in sys.modules if k == "verl" or k.startswith("verl.") or k == "tensordict"]:
            del sys.modules[k]
        sys.modules.update(saved)
    _CACHE["core"] = (core, tf)
    return core, tf


def verl_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("verl")
    except PackageNotFoundError:
        return None
