"""Triton kernels of memopd (installed as `memopd.kernels`).

Each module holds the kernels of one op; the public, dispatching wrappers live in
`memopd.ops`. Import these only where Triton is available. On CPU they run through
`TRITON_INTERPRET=1`, which must be set before the kernel module is imported.
"""
