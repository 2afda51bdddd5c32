"""Which implementation runs an op: one rule, one error type and one override for every op.

Each public op (packed attention, the fused distillation / log-prob ops, the fused actor
loss) takes `backend=` and asks `choose_backend` which implementation runs:

- "auto" (the default) is Triton when the tensors are on CUDA, Triton is installed and the
  op's kernel takes these inputs; PyTorch otherwise. "auto" never fails for lack of a
  kernel: float64, an unsupported head size or a CUDA build without Triton get PyTorch.
- An explicit backend is honoured, or refused with `BackendError` saying why (Triton on CPU
  tensors without the interpreter, a dtype or shape the kernel does not take, an unknown
  name). Nothing falls back silently from an explicit choice.
- The environment variable `MEMOPD_BACKEND` ("auto", "torch" or "triton"), when set,
  replaces "auto" for every op at once; an explicit `backend=` argument still wins.

Triton on CPU tensors runs only under `TRITON_INTERPRET=1` set before the first kernel
module is imported (tests; docs/design.md §8).
"""
from __future__ import annotations

import importlib.util
import os
import sys
from typing import Optional

import torch

from ..errors import UserError

__all__ = ["BackendError", "ENV_VAR", "choose_backend", "triton_available", "interpreter_active"]

ENV_VAR = "MEMOPD_BACKEND"
_ENV_CHOICES = ("auto", "torch", "triton")


class BackendError(UserError, ValueError):
    """A requested backend cannot run these inputs (or does not exist): bad input, exit
    code 2 from the command line (a `backend=` argument or MEMOPD_BACKEND the user chose).
    Still a ValueError, as it was before it joined the UserError hierarchy."""


# looked up once: a constant to torch.compile (a cached function would be traced each time)
_TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None


def triton_available() -> bool:
    return _TRITON_AVAILABLE


def interpreter_active() -> bool:
    """Whether Triton kernels run in the interpreter (fixed when the first kernel module loads)."""
    runtime = sys.modules.get("memopd.kernels.runtime")
    if runtime is not None:
        return bool(runtime.INTERPRET)
    return os.environ.get("TRITON_INTERPRET") == "1"


def _requested(op: str, backend: Optional[str], backends: tuple[str, ...]) -> str:
    if backend is None or backend == "auto":
        env = os.environ.get(ENV_VAR, "").strip()
        if env:
            if env not in _ENV_CHOICES:
                raise BackendError(f"{ENV_VAR}={env!r} is not a backend; expected one of {_ENV_CHOICES}")
            backend = env
        else:
            backend = "auto"
    if backend not in backends:
        raise BackendError(f"{op}: unknown backend {backend!r}; expected one of {backends}")
    return backend


def choose_backend(op: str, backend: Optional[str], device: torch.device, *,
                   backends: tuple[str, ...] = ("auto", "torch", "triton"),
                   triton_refusal: Optional[str] = None) -> str:
    """The backend that runs `op` on tensors of `device`.

    `triton_refusal` is the op's reason its Triton kernel cannot take these inputs (None
    when it can), e.g. "float64 inputs". Returns one of `backends` other than "auto".
    """
    backend = _requested(op, backend, backends)
    if backend == "auto":
        ok = device.type == "cuda" and triton_available() and triton_refusal is None
        return "triton" if ok else "torch"
    if backend == "triton":
        if not triton_available():
            raise BackendError(f"{op}: backend='triton' but Triton is not installed; use backend='torch'")
        if device.type != "cuda" and not interpreter_active():
            raise BackendError(f"{op}: backend='triton' on {device.type} tensors needs TRITON_INTERPRET=1 set "
                               "before memopd's kernels are imported (tests only); use backend='torch'")
        if triton_refusal is not None:
            raise BackendError(f"{op}: the Triton kernel does not take {triton_refusal}; use backend='torch'")
    return backend
