"""The safe reader of torch checkpoint files: `load_tensor_file` loads a file with the
weights-only unpickler and checks that only tensors and plain values came out, so that
loading a checkpoint never runs code (docs/design.md §11.1).
"""
from __future__ import annotations

import re
from typing import Any

import torch

__all__ = ["load_tensor_file"]

# the values a checkpoint file may hold besides tensors (torch.load(weights_only=True)
# admits a few more torch types, e.g. dtypes and sizes, which no memopd state holds)
_PLAIN = (dict, list, tuple, str, int, float, bool, type(None), torch.Tensor)


def _check_plain(obj: Any, where: str) -> None:
    from memopd.errors import UnsafeFileError

    stack = [obj]
    while stack:
        x = stack.pop()
        if not isinstance(x, _PLAIN):
            raise UnsafeFileError(f"{where}: holds a {type(x).__module__}.{type(x).__qualname__}, not only "
                                  "tensors and plain values; refusing it")
        if isinstance(x, dict):
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)


def load_tensor_file(path: str, safe_types: tuple = ()) -> Any:
    """torch.load of a checkpoint file that runs no code: the weights-only unpickler (it
    builds tensors and plain containers and refuses any other global, `safe_types` aside:
    classes the caller names), then a check that only tensors, plain values and
    `safe_types` came out. Anything else is an UnsafeFileError naming the file."""
    import pickle

    from memopd.errors import UnsafeFileError

    try:
        with torch.serialization.safe_globals(list(safe_types)):
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        if found is None:  # not a pickle the weights-only reader can parse at all
            raise UnsafeFileError(f"{path}: not a readable torch checkpoint file; it is damaged") from None
        raise UnsafeFileError(f"{path}: refused to load: it needs more than tensors and plain values (it names "
                              f"{found.group(1)}), and unpickling it could run code. Only load checkpoints memopd "
                              "wrote") from None
    except (RuntimeError, EOFError, ValueError) as e:
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        raise UnsafeFileError(f"{path}: not a readable torch checkpoint file ({type(e).__name__}: "
                              f"{first}); it is damaged") from None
    if not safe_types:
        _check_plain(state, path)
    return state
