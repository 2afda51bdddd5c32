"""Gradients a fused op computed during its forward, held on the autograd context until
its backward, which only scales them by the incoming gradient of the (scalar) loss.

Eagerly the tensors are kept as a plain attribute, not saved: handing the only
reference back from the backward lets the autograd engine adopt the [V, H] weight
gradient instead of copying it (a saved tensor returned from a backward is copied).
While torch.compile traces, they are saved like any other tensor (a traced graph has
no Python attributes to carry them).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

__all__ = ["hold", "take", "scaled"]


def hold(ctx, grads: Sequence[Optional[Tensor]], saved: Sequence[Optional[Tensor]] = ()) -> None:
    """Keep `grads` for the backward; `saved` are the call's other tensors to save."""
    ctx.n_saved = len(saved)
    if torch.compiler.is_compiling():
        ctx.save_for_backward(*saved, *grads)
        ctx.held = None
    else:
        ctx.save_for_backward(*saved)
        ctx.held = list(grads)


def take(ctx, op: str) -> tuple[list, tuple]:
    """(held gradients, saved tensors) of `hold`; a second backward through the same call
    is refused, since the gradients were handed over by the first."""
    saved = ctx.saved_tensors
    if ctx.held is None:
        return list(saved[ctx.n_saved:]), saved[: ctx.n_saved]
    if not ctx.held:
        raise RuntimeError(f"{op} computes its gradients once, in the forward: a second backward through "
                           f"the same call (retain_graph=True) is not supported")
    grads, ctx.held = ctx.held, []
    return grads, saved


def scaled(g_loss: Optional[Tensor], grad: Optional[Tensor]) -> Optional[Tensor]:
    """`grad` times the scalar `g_loss` (None: no gradient reached the loss). An eager 1
    (the usual `loss.backward()`) returns the tensor itself; a traced graph multiplies."""
    if grad is None or g_loss is None:
        return None
    if not torch.compiler.is_compiling() and bool((g_loss == 1).all()):
        return grad
    return grad * g_loss.to(grad.dtype)
