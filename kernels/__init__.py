"""Triton kernels of memopd (installed as `memopd.kernels`).

Each kernel module holds the kernels of one op (`fused_distill`, `actor_loss`;
`distill_rows` the distillation op's path with its gradients taken in the forward);
packed attention is four modules, one job each: `attention_kernels` (the Triton
kernels), `packed_attention` (their launchers), `attention_plan` (the backward's
host-side plan, plain torch) and `attention_tuning` (the tile candidates).
`lm_head_tiles` holds the tiles the two lm-head ops share, `runtime` the
interpreter / autotuning / precision policy. The public, dispatching wrappers live in
`memopd.ops`, one layer up: nothing here imports `memopd.ops`.

This package and `contract` (what the ops and the kernels exchange) import no Triton,
so the ops can use them anywhere. Import the kernel modules only where Triton is
available; on CPU they run through `TRITON_INTERPRET=1`, which must be set before the
first kernel module is imported.
"""

if __name__ == "kernels":  # the repository root is on sys.path: this is not memopd.kernels
    # only the standard library here: transformers imports this name while it initialises
    import os as _os
    import runpy as _runpy

    _runpy.run_path(_os.path.join(_os.path.dirname(__path__[0]), "memopd", "_root_names.py"))["hand_over"](
        __name__, __path__[0], keep_if_missing=True)
    del _os, _runpy
