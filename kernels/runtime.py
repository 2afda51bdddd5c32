"""Runtime policy shared by memopd's Triton kernel modules: interpreter or compiled,
autotuning or fixed tiles, dot precision, and the numeric constants every kernel uses.

Names (stable: kernel modules and `memopd.ops.dispatch.interpreter_active` rely on them):

    INTERPRET          TRITON_INTERPRET=1 when this module was first imported
    GPU_DRIVER_PRESENT a real GPU driver answers (never under the interpreter)
    USE_AUTOTUNE       autotune on: GPU_DRIVER_PRESENT and MEMOPD_TRITON_AUTOTUNE != "0"
    helper             decorator for small device helpers: plain Python when interpreted
    upcast(*dtypes)    whether 16-bit loads must be computed in fp32 (interpreter only)
    dot_precision(dt)  `input_precision` of tl.dot for inputs of dtype dt ("ieee" for fp32)
    or_dummy(t, d)     t, or the stand-in pointer d for an absent tensor
    autotuned(fn, ...) the one way the kernel modules build an autotuner (registered by name)
    tuning_bucket(n)   the size class of a row count that an autotuner is keyed by
    chosen_configs()   {autotuner name: the configuration it picked} of those that have run
    NEG                finite "minus infinity" (a tl.constexpr, usable inside kernels)
    LOG2E              log2(e), a Python float (host side; wrap in tl.constexpr in kernels)
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = ["INTERPRET", "GPU_DRIVER_PRESENT", "USE_AUTOTUNE", "helper", "upcast", "dot_precision",
           "or_dummy", "autotuned", "tuning_bucket", "TUNING_BUCKET_MIN", "TUNING_BUCKET_MAX",
           "chosen_configs", "NEG", "LOG2E"]

# Read once: triton.jit chooses between the interpreter and the compiler when a kernel is
# decorated, so a later change of the variable could not take effect anyway.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _gpu_driver_present() -> bool:
    # Autotuning and driver queries crash without a real driver, even with torch's CUDA build.
    if INTERPRET:
        return False
    try:
        if not torch.cuda.is_available():
            return False
        return triton.runtime.driver.active.get_current_target() is not None
    except Exception:  # noqa: BLE001 no driver, no device, or a Triton without the query
        return False


GPU_DRIVER_PRESENT = _gpu_driver_present()
USE_AUTOTUNE = GPU_DRIVER_PRESENT and os.environ.get("MEMOPD_TRITON_AUTOTUNE", "1") != "0"

# The interpreter re-patches triton.language on every call of a @triton.jit device function
# (about 0.3 ms each); helpers called per tile then dominate test time. Interpreted kernels
# run as Python with tl already patched, so plain functions behave the same there.
helper = (lambda fn: fn) if INTERPRET else triton.jit

# Finite "minus infinity", so that (m_old - m_new) * 0 stays 0, never NaN. A constexpr:
# compiled Triton refuses plain Python globals inside kernels (the interpreter does not).
NEG = tl.constexpr(-1.0e30)
LOG2E = 1.4426950408889634

_HALF_DTYPES = (torch.bfloat16, torch.float16)


def upcast(*dtypes: torch.dtype) -> bool:
    """The interpreter gets 16-bit arithmetic and dots wrong: compute those in fp32 there."""
    return INTERPRET and any(d in _HALF_DTYPES for d in dtypes)


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs stay exact (no silent TF32: the RCE audit compares fp32 logits at ~1e-4)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def or_dummy(tensor, stand_in: torch.Tensor) -> torch.Tensor:
    """A pointer for a kernel argument that may be absent; the kernel must not read it then
    (its HAS_* constexpr is False), so any tensor of the right device will do."""
    return stand_in if tensor is None else tensor


_AUTOTUNERS: dict = {}


def autotuned(fn, configs, key, name=None, prune=None, reset_to_zero=None):
    """triton.autotune over `configs` (keyed by the argument names `key`), with an optional
    early pruner, registered under `name` (default: the kernel's name) so that the
    benchmarks can report which configuration each tuned kernel chose."""
    kwargs = {}
    if prune is not None:
        kwargs["prune_configs_by"] = {"early_config_prune": prune}
    if reset_to_zero:
        kwargs["reset_to_zero"] = list(reset_to_zero)
    tuner = triton.autotune(list(configs), key=list(key), **kwargs)(fn)
    _AUTOTUNERS[name or fn.__name__] = tuner
    return tuner


TUNING_BUCKET_MIN = 256
TUNING_BUCKET_MAX = 16384


def tuning_bucket(n: int) -> int:
    """Size class of a row count for autotuning: the next power of two, clamped to
    [TUNING_BUCKET_MIN, TUNING_BUCKET_MAX]. Triton keys a tuner only by exact argument
    values; keyed by neither the rows nor a class of them, the first call's shape would
    decide the tiles for the whole process, keyed by the exact count every step would
    tune again. Past the cap the grid is many waves deep and the best tile stops moving."""
    p2 = 1 << max(0, int(n) - 1).bit_length()
    return min(max(p2, TUNING_BUCKET_MIN), TUNING_BUCKET_MAX)


def _describe(config) -> str:
    blocks = ",".join(f"{k}={v}" for k, v in config.kwargs.items())
    return f"{blocks},w{config.num_warps},s{config.num_stages}"


def chosen_configs() -> dict:
    """Per registered autotuner that has tuned at least once, its current pick, e.g.
    {"fwd_kernel[T<=16384]": "BLOCK_M=128,BLOCK_N=64,w8,s3"} (the last key it was called with)."""
    out = {}
    for name, tuner in _AUTOTUNERS.items():
        best = getattr(tuner, "best_config", None)
        if best is not None:
            out[name] = _describe(best)
    return out
