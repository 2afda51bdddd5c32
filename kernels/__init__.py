"""Triton kernels of memopd (installed as `memopd.kernels`).

Each kernel module holds the kernels of one op (`packed_attention`, `fused_distill`,
`actor_loss`; `distill_rows` the distillation op's path with its gradients taken in the
forward); `lm_head_tiles` the tiles the two lm-head ops share, `runtime` the
interpreter / autotuning / precision policy. The public, dispatching wrappers live in
`memopd.ops`, one layer up: nothing here imports `memopd.ops`.

This package and `contract` (what the ops and the kernels exchange) import no Triton,
so the ops can use them anywhere. Import the kernel modules only where Triton is
available; on CPU they run through `TRITON_INTERPRET=1`, which must be set before the
first kernel module is imported.
"""

if __name__ == "kernels":  # the repository root is on sys.path: not memopd.kernels
    from memopd._root_names import hand_over

    hand_over(__name__, __path__[0])
