"""Memory-layout facts of the lm-head kernels that the numerical tests cannot see.

* The dW GEMM's program order: the programs that read one dlogits scratch slab (one
  vocabulary tile, every hidden tile) are adjacent, so the slab is read from HBM once.
  Checked on the launcher's own grid (`dw_grid`) and the index map the kernel calls
  (`dw_program_tile`, evaluated on the host through its Python function).
* The distillation forward's program order (`fwd_grid`, `fwd_program_block`): the
  programs resident together re-read the hidden rows of few enough token blocks that
  they stay in L2.
* The scratch rows are padded (`scratch_row_stride`), so that at Qwen2.5's odd tokenizer
  vocabulary (V = 151,665) the compiled scratch accesses of the dH / dW GEMMs (dH also
  split over the vocabulary), the distillation dlogits and row kernels and the actor-loss
  logits / rows kernels stay vector accesses (16-byte; the distillation row kernel's bf16
  gradient stores 8-byte). Checked on the sm_90a PTX that
  `tests/_aot.py` compiles offline (no GPU;
  skipped, with the reason, when Triton's CUDA backend is not installed), one launch
  configuration per kernel: the first candidate, the one used when autotuning is off.
* The lm-head autotuners are per size class of the token rows (`tuning_bucket`), so the
  first call's shape does not decide the tiles for the process.
"""
from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import _aot
import pytest
import triton

import memopd.kernels.fused_distill as fd
import memopd.kernels.runtime as runtime
from memopd.kernels.contract import Divergence
from memopd.kernels.lm_head_tiles import (
    GEMM_GPU,
    GEMM_GPU_FP32,
    dh_split_width,
    dh_splits,
    dw_grid,
    dw_kernel,
    dw_program_tile,
    scratch_row_stride,
    wave_fill,
)

ODD_VOCAB = 151665  # Qwen2.5's tokenizer


@pytest.mark.parametrize("meta", [GEMM_GPU, GEMM_GPU_FP32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("V", [151936, ODD_VOCAB, 300])
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


@pytest.mark.parametrize("N", [4096, 16384, 65536])
@pytest.mark.parametrize("teacher", [True, False], ids=["teacher", "no-teacher"])
def test_forward_programs_resident_together_keep_their_hidden_rows_in_l2(N, teacher):
    # every (token block, split) exactly once, and a wave of 132 programs (one per SM)
    # re-reads the hidden rows of few enough token blocks to stay within FWD_L2_BYTES;
    # the order before (token blocks fastest) exceeded it with a teacher
    row_bytes = (2048 + (3584 if teacher else 0)) * 2
    bn = fd._configs("fwd", Divergence.REVERSE_KL, False, teacher)[0].kwargs["BLOCK_N"]
    splits, _ = fd._split_plan(N, ODD_VOCAB, "cpu", row_bytes)
    n_tb = triton.cdiv(N, bn)
    (n_programs,) = fd.fwd_grid(N, splits, {"BLOCK_N": bn})
    blocks = [fd.fwd_program_block.fn(pid, splits) for pid in range(n_programs)]
    assert sorted(blocks) == [(b, s) for b in range(n_tb) for s in range(splits)]
    wave = 132
    widest = max(len({b for b, _ in blocks[w0:w0 + wave]}) for w0 in range(0, n_programs, wave))
    assert (widest - 1) * bn * row_bytes <= fd.FWD_L2_BYTES, (splits, widest)
    if teacher and N >= 16384:
        assert min(wave, n_tb) * bn * row_bytes > fd.FWD_L2_BYTES  # token blocks fastest: too wide
    if N == 16384:
        assert splits == 3  # the split plan (and so every output bit) of the order before


def test_forward_kernels_take_their_block_from_the_tested_map():
    for kernel in (fd._distill_fwd_kernel, fd._jsd_pass_kernel):
        src = inspect.getsource(getattr(kernel, "fn", kernel))
        assert "fwd_program_block(tl.program_id(0), n_split)" in src


def test_dw_kernel_takes_its_tile_from_the_tested_map():
    # the kernel must use the map the test above checks, with the grid's hidden-tile count
    src = inspect.getsource(getattr(dw_kernel, "fn", dw_kernel))  # JITFunction or InterpretedFunction
    assert "dw_program_tile(tl.program_id(0), tl.cdiv(H, BLOCK_H))" in src


@pytest.mark.parametrize("V", [151936, ODD_VOCAB, 300, 64, 1])
def test_scratch_rows_are_padded_to_64_elements(V):
    stride = scratch_row_stride(V)
    assert stride % 64 == 0 and V <= stride < V + 64


def test_tuning_bucket_is_a_capped_power_of_two():
    assert [runtime.tuning_bucket(n) for n in (0, 1, 256, 257, 5000, 8192, 8193, 16384, 10**6)] == [
        256, 256, 256, 512, 8192, 8192, 16384, 16384, 16384]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the interpreter never autotunes")
def test_one_autotuner_per_row_bucket(monkeypatch):
    # building a tuner needs no GPU: pretend autotuning is on and look at what is built
    monkeypatch.setattr(fd, "USE_AUTOTUNE", True)
    monkeypatch.setattr(fd, "_TUNERS", {})
    monkeypatch.setattr(runtime, "_AUTOTUNERS", {})
    tuner = {n: fd._launcher("fwd", Divergence.REVERSE_KL, False, True, rows=n)[0] for n in (100, 5000, 8000, 20000, 10**6)}
    assert tuner[5000] is tuner[8000] and tuner[20000] is tuner[10**6]
    assert len({id(t) for t in tuner.values()}) == 3
    # the pruned candidates, never a spilling one, reach each tuner
    assert all(t.configs == fd._configs("fwd", Divergence.REVERSE_KL, False, True) for t in tuner.values())
    assert sorted(runtime._AUTOTUNERS) == ["_distill_fwd_kernel[reverse_kl,rows<=16384]",
                                           "_distill_fwd_kernel[reverse_kl,rows<=256]",
                                           "_distill_fwd_kernel[reverse_kl,rows<=8192]"]


# --------------------------------------------------------------------------------------
# compiled PTX at the odd vocabulary
# --------------------------------------------------------------------------------------
def _first_job_per_kernel():
    jobs = {}
    for job in _aot.lm_head_jobs():
        if f"V={ODD_VOCAB}" not in job["shape"]:
            continue
        key = (job["kernel"], job["variant"])
        if job["kernel"] in ("dh", "dw", "dh_split", "logits", "distill_rows") or key in (("dlogits", "reverse_kl"),
                                                                                       ("rows", "teacher")):
            jobs.setdefault(key, job)
    return jobs


_CASES = [("dh", "gemm"), ("dw", "gemm"), ("dh_split", "gemm"), ("dlogits", "reverse_kl"), ("logits", "plain"),
          ("rows", "teacher"), ("distill_rows", "reverse_kl"), ("distill_rows", "forward_kl"),
          ("distill_rows", "jsd"), ("distill_rows", "no-teacher")]
# scalar: no .v2 / .v4 / .v8 qualifier (cache hints such as .L1::evict_last may appear)
_SCALAR_B16_LOAD = re.compile(r"\bld\.global(?:\.(?!v\d)[\w:]+)*\.b16\s")
_SCALAR_B16_STORE = re.compile(r"\bst\.global(?:\.(?!v\d)[\w:]+)*\.b16\s")
_SCALAR_B32_STORE = re.compile(r"\bst\.global(?:\.(?!v\d)[\w:]+)*\.b32\s")
_ASYNC_16B = re.compile(r"\bcp\.async\.c[ag]\.shared\.global(?:\.\w+)*\s+\[[^]]+\],\s*\[[^]]+\],\s*(?:0x10|16)\b")
_V4_LOAD = re.compile(r"\bld\.global(?:\.[\w:]+)*\.v4\.b32\s")
_V4_STORE = re.compile(r"\bst\.global(?:\.[\w:]+)*\.v4\.b32\s")
_V2_STORE = re.compile(r"\bst\.global(?:\.[\w:]+)*\.v2\.b32\s")


_CHILD = "MEMOPD_PTX_CHILD"
_CHILD_RESULT: dict = {}


def _in_clean_process() -> subprocess.CompletedProcess:
    """This file's PTX tests, once, in a fresh process without TRITON_INTERPRET: in a suite,
    the interpreter test modules set it and re-import the kernels as interpreted functions,
    which cannot be compiled for a GPU."""
    if "run" not in _CHILD_RESULT:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env[_CHILD] = "1"
        _CHILD_RESULT["run"] = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "16_byte_vectors"],
            env=env, capture_output=True, text=True, timeout=900)
    return _CHILD_RESULT["run"]


@pytest.mark.parametrize("kernel,variant", _CASES)
def test_scratch_accesses_are_16_byte_vectors_at_odd_vocab(kernel, variant):
    pytest.importorskip("triton.backends.nvidia", reason="Triton's CUDA backend (ptxas) is not installed")
    if os.environ.get(_CHILD) != "1":  # see _in_clean_process
        res = _in_clean_process()
        assert res.returncode == 0 and f"{len(_CASES)} passed" in res.stdout, res.stdout[-4000:] + res.stderr[-4000:]
        return
    job = _first_job_per_kernel()[(kernel, variant)]
    res = _aot.compile_kernel(job["fn"], job["types"], job["consts"], job["warps"], job["stages"], job["divisible"],
                              keep_ptx=True)
    assert res["error"] is None, res["error"]
    ptx = res["ptx"]
    what = f"{kernel} {variant} {job['config']} at V={ODD_VOCAB}"
    if kernel in ("dh", "dw", "dh_split"):
        # both bf16 operands (the scratch slab and W / H) go to shared memory in 16-byte copies
        assert _ASYNC_16B.search(ptx), f"{what}: no 16-byte cp.async"
        assert not _SCALAR_B16_LOAD.search(ptx), f"{what}: scalar bf16 loads"
    elif kernel == "dlogits":
        # the bf16 dlogits tile is written to the scratch in 16-byte stores only
        assert _V4_STORE.search(ptx), f"{what}: no 16-byte stores"
        assert not _SCALAR_B16_STORE.search(ptx), f"{what}: scalar bf16 stores"
    elif kernel == "logits":
        # the fp32 logits tile: its only global stores, all 16-byte
        assert _V4_STORE.search(ptx), f"{what}: no 16-byte stores"
        assert not _SCALAR_B32_STORE.search(ptx), f"{what}: scalar fp32 stores"
    elif kernel == "rows":
        # the actor loss's row sweeps read the fp32 student / teacher rows and write the bf16
        # dlogits in 16-byte accesses: 8 values a thread of a 2048-wide piece over 8 warps
        # (the per-token statistics are scalar stores, legitimately)
        assert _V4_LOAD.search(ptx), f"{what}: no 16-byte loads"
        assert _V4_STORE.search(ptx), f"{what}: no 16-byte stores"
        assert not _SCALAR_B16_STORE.search(ptx), f"{what}: scalar bf16 stores"
    else:
        # the distillation row kernel's sweeps read the fp32 rows in 16-byte loads; its
        # 1024-wide pieces (register-bound, see `rows_block`) give a thread 4 bf16 values
        # of dlogits, one 8-byte vector store (a warp's stores still cover 256 contiguous
        # bytes), never a scalar one
        assert _V4_LOAD.search(ptx), f"{what}: no 16-byte loads"
        assert _V2_STORE.search(ptx) or _V4_STORE.search(ptx), f"{what}: no 8- or 16-byte stores"
        assert not _SCALAR_B16_STORE.search(ptx), f"{what}: scalar bf16 stores"


def test_cost_model_dw_order_reads_the_scratch_once():
    # benchmarks/gpu_cost_model.py replays the launchers' own grids and program order through
    # an L2 model: the dW GEMM's order must cut its HBM traffic several times against the
    # order with vocabulary tiles fastest, and the per-op totals must add up
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import gpu_cost_model as cm

    rows, ops = cm.report(4096, ODD_VOCAB)
    hbm = {r["kernel"]: r["hbm_gb"] for r in rows}
    assert hbm["dw (distill)"] * 2 < hbm["dw (distill, vocab tiles fastest: before)"]
    assert hbm["dw (actor, fp32 scratch)"] * 2 < hbm["dw (actor, fp32 scratch, vocab tiles fastest)"]
    for o in ops:
        assert 0 < o["useful_tflop"] <= o["tflop"] and 0 < o["peak"] < cm.MATMUL_SUSTAINED / cm.PEAK_BF16 + 1e-9


def test_cost_model_actor_rows_and_dh_grid():
    # the actor loss at Qwen2.5-3B shapes, 16k tokens: the rows kernel streams each row
    # pair twice (the loops of its source), not three times; the dH grid split over the
    # vocabulary fills the SMs where the unsplit one (6 x 16 programs on 132) did not
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import gpu_cost_model as cm

    N = 16384
    now, before = cm.actor_rows(N, ODD_VOCAB), cm.actor_rows(N, ODD_VOCAB, sweeps=3, grad_elem=4)
    assert "2 sweeps" in now["note"] and now["hbm_gb"] < 0.7 * before["hbm_gb"]
    split, unsplit = cm.gemm_dh(N, ODD_VOCAB, 2, chunk_elem=4, split=True), cm.gemm_dh(N, ODD_VOCAB, 4)
    assert "6x16x1 programs/chunk" in unsplit["note"] and unsplit["fill"] < 0.75
    assert "6x16x4 programs/chunk" in split["note"] and split["fill"] > 0.95
    assert split["ms"] < 0.8 * unsplit["ms"]


@pytest.mark.parametrize("n_rows,H,expect", [(768, 2048, 4), (256, 2048, 4), (1664, 2048, 5), (1024, 3584, 7)])
def test_dh_split_plan_fills_the_sms(n_rows, H, expect):
    # the plan at the default token chunks of the actor loss (768 rows, the last of 16k
    # tokens 256) and of the distillation (1664) at V=151,665 on 132 SMs: the best fill of
    # up to 8 shares, the fewest shares among equals
    splits = dh_splits(n_rows, H, ODD_VOCAB, GEMM_GPU, 132)
    tiles = triton.cdiv(n_rows, GEMM_GPU["BLOCK_M"]) * triton.cdiv(H, GEMM_GPU["BLOCK_H"])
    assert splits == expect
    assert wave_fill(tiles * splits, 132) >= max(wave_fill(tiles * s, 132) for s in range(1, 9)) - 1e-9
    k_per = dh_split_width(ODD_VOCAB, splits, GEMM_GPU)
    assert k_per % GEMM_GPU["BLOCK_K"] == 0 and triton.cdiv(ODD_VOCAB, k_per) == splits
    assert dh_splits(n_rows, H, ODD_VOCAB, GEMM_GPU, 1) == 1  # one SM (the interpreter): never


def test_cost_model_forward_grads_runs_four_gemms_and_beats_recompute():
    # the distillation op with its gradients in the forward: the same useful FLOPs as the
    # recomputing op's, no recomputed ones, and a shorter predicted time than it
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import gpu_cost_model as cm

    _, ops = cm.report(4096, ODD_VOCAB)
    by_op = {o["op"]: o for o in ops}
    old = by_op["fused distill (reverse KL, teacher)"]
    new = by_op["fused distill, gradients in the forward (reverse KL)"]
    assert abs(new["tflop"] - new["useful_tflop"]) < 1e-9 and abs(new["useful_tflop"] - old["useful_tflop"]) < 1e-6
    assert old["tflop"] > 1.4 * new["tflop"] and new["ms"] < old["ms"]
