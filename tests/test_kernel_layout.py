"""Memory-layout facts of the lm-head kernels that the numerical tests cannot see.

* The dW GEMM's program order: the programs that read one dlogits scratch slab (one
  vocabulary tile, every hidden tile) are adjacent, so the slab is read from HBM once.
  Checked on the launcher's own grid (`dw_grid`) and the index map the kernel calls
  (`dw_program_tile`, evaluated on the host through its Python function).
"""
from __future__ import annotations

import pytest
import triton

from memopd.kernels.lm_head_tiles import GEMM_GPU, GEMM_GPU_FP32, dw_grid, dw_kernel, dw_program_tile



@pytest.mark.parametrize("meta", [GEMM_GPU, GEMM_GPU_FP32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("V", [151936, 151665, 300])
@pytest.mark.parametrize("H", [2048, 3584, 40])
def test_dw_programs_sharing_a_scratch_slab_are_adjacent(meta, V, H):
    (n_programs,) = dw_grid(V, H, meta)
    n_v, n_h = triton.cdiv(V, meta["BLOCK_M"]), triton.cdiv(H, meta["BLOCK_H"])
    tiles = [dw_program_tile.fn(pid, n_h) for pid in range(n_programs)]
    # every output tile exactly once
    assert sorted(tiles) == [(v, h) for v in range(n_v) for h in range(n_h)]
    by_slab = {}
    for pid, (v_tile, _) in enumerate(tiles):
        by_slab.setdefault(v_tile, []).append(pid)
    for v_tile, pids in by_slab.items():
        assert pids == list(range(pids[0], pids[0] + n_h)), (v_tile, pids[:4])


def test_dw_kernel_takes_its_tile_from_the_tested_map():
    # the kernel must use the map the test above checks, with the grid's hidden-tile count
    assert "dw_program_tile(tl.program_id(0), tl.cdiv(H, BLOCK_H))" in dw_kernel.src
