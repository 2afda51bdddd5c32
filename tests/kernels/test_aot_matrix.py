"""Every Triton kernel of memopd compiles for sm_90a (H100/H200) with every Triton we
support, at production shapes, without spilling: the AOT matrix of `tests/_aot.py`.

The Triton installed with the project is always used. Others are named by
MEMOPD_AOT_TRITONS (os.pathsep-separated directories, each holding one Triton, e.g.
`pip install --no-deps --target DIR triton==3.6.0`); `.ci/run` sets it to Triton 3.6.0,
the one torch 2.11 ships. MEMOPD_AOT_CACHE keeps each compiled job's row (keyed by the
Triton version and the kernel's source hash), so a rerun recompiles only changed kernels;
MEMOPD_AOT_TABLE names a file for the Markdown table (it is printed too).
"""
from __future__ import annotations

import os
import time

import _aot
import pytest

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                reason="compiles for a GPU; the interpreter is set in this process")

if os.environ.get("TRITON_INTERPRET") != "1":
    # Import the kernels compiled now, at collection: the interpreter test files collected
    # later in the same session (tests/ops/*_triton.py) set TRITON_INTERPRET=1 for this
    # process unless Triton's kernels are already loaded compiled (then they run themselves
    # in a child process). Imported later, these kernels would be the interpreter's wrappers,
    # which the matrix cannot read.
    try:
        import memopd.kernels.attention_kernels  # noqa: F401
        import memopd.kernels.fused_distill  # noqa: F401
        import memopd.kernels.lm_head_tiles  # noqa: F401
    except ImportError:  # no Triton: the tests below skip themselves
        pass


def _site_dirs():
    extra = [d for d in os.environ.get("MEMOPD_AOT_TRITONS", "").split(os.pathsep) if d]
    return [""] + extra


def test_every_kernel_compiles_for_sm90a_with_every_triton():
    pytest.importorskip("triton.backends.nvidia")
    sites = _site_dirs()
    versions = {}
    for site in sites:
        v = _aot.triton_version_at(site)
        assert v is not None, f"no importable Triton in {site or 'the default environment'}"
        versions[site] = v
    assert len(set(versions.values())) == len(sites), f"the same Triton named twice: {versions}"

    start = time.monotonic()
    shards = max(1, (os.cpu_count() or 1) // len(sites))
    rows, failures = _aot.run_matrix(sites, shards_per_triton=shards, cache_dir=os.environ.get("MEMOPD_AOT_CACHE"))
    elapsed = time.monotonic() - start
    table = _aot.format_table(rows)
    compiled = [r for r in rows if not r["cached"]]
    summary = (f"AOT matrix: {len(rows)} jobs over Triton {', '.join(sorted(versions.values()))}, "
               f"{len(compiled)} compiled ({sum(r['seconds'] for r in compiled):.0f} s of compiler time), "
               f"{len(rows) - len(compiled)} from the cache, {elapsed:.0f} s wall; "
               f"{sum(bool(r['spills']) for r in rows if r['variant'] == 'safe')} SAFE relaunch variants spill")
    print(summary)
    print(table)
    if os.environ.get("MEMOPD_AOT_TABLE"):
        with open(os.environ["MEMOPD_AOT_TABLE"], "w") as f:
            f.write(summary + "\n\n" + table + "\n")

    assert not failures, "\n".join(failures)
    # every kernel variant and shape compiled under every Triton (the candidates may
    # differ: each Triton's pruner drops the ones its own ptxas spills)
    per_version = {}
    for r in rows:
        per_version.setdefault(r["triton"], set()).add((r["family"], r["kernel"], r["variant"], r["shape"]))
    assert set(per_version) == set(versions.values()), sorted(per_version)
    assert all(v == per_version[versions[""]] for v in per_version.values()), "kernels missing under some Triton"
    errors = [f"Triton {r['triton']} {r['kernel']} {r['variant']} {r['shape']} {r['config']}: {r['error']}"
              for r in rows if r["error"]]
    assert not errors, f"{len(errors)} compile error(s):\n" + "\n".join(errors)
    for r in rows:
        what = f"Triton {r['triton']} {r['family']} {r['kernel']} {r['variant']} {r['shape']} {r['config']}"
        assert r["shared"] <= _aot.SM90_SHARED_LIMIT, f"{what}: {r['shared']} B of shared memory"
        assert r["regs"] is not None and r["spills"] is not None, f"{what}: no ptxas report"
        # every candidate the pruners keep fits in registers in the launch that runs every
        # step; the SAFE relaunch (only for blocks that met a NaN/inf) may spill
        if r["variant"] != "safe":
            assert r["spills"] == 0, f"{what}: {r['spills']} bytes of spills ({r['regs']} registers)"
        if r["shape"].startswith("fp32 "):
            # exact fp32 dots run on the FMA units: a tensor-core MMA here would be a silent TF32
            assert not r["wgmma"], f"{what}: fp32 inputs on a warp-group MMA (TF32)"
        elif r["family"] == "attention" and r["kernel"] != "dkdv-reduce":  # (the partials' sum has no matmul)
            assert r["wgmma"], f"{what}: no Hopper warp-group MMA"


def test_matrix_has_the_deterministic_dkdv_rows():
    # the deterministic backward's dK/dV is its own binary (ATOMIC_DQ=False): compiled here
    # for the GPU tests' shapes, bf16 and fp32, every candidate the pruner keeps, beside the atomic one
    pytest.importorskip("triton")
    jobs = _aot.matrix_jobs()
    det = [j for j in jobs if j["variant"] == "deterministic"]
    assert {j["shape"] for j in det} == {f"{dt} D=128 group={g}" for g in _aot.DETERMINISTIC_GROUPS
                                         for dt in ("bf16", "fp32")}
    assert all(j["kernel"] == "dkdv" and j["consts"]["ATOMIC_DQ"] is False for j in det)
    atomic = {(j["shape"], j["config"]) for j in jobs if j["kernel"] == "dkdv" and j["variant"] == "plain"}
    assert {(j["shape"], j["config"]) for j in det} <= atomic and len(det) >= 2 * len(_aot.DETERMINISTIC_GROUPS)


def test_matrix_has_the_fp32_rows():
    # fp32 (memopd train's default dtype) runs every Triton op on CUDA with its own tiles and
    # exact dots: each kernel has fp32 rows, built from the fp32 launch settings, with no
    # 16-bit tensor or TF32 dot left in them, and the fp32 candidates measured to spill gone
    pytest.importorskip("triton")
    import torch

    import memopd.kernels.attention_tuning as tuning
    import memopd.kernels.fused_distill as fd
    import memopd.kernels.lm_head_tiles as tiles
    from memopd.kernels.contract import Divergence

    jobs = _aot.matrix_jobs()
    fp32 = [j for j in jobs if j["shape"].startswith("fp32 ")]
    bf16 = [j for j in jobs if j["shape"].startswith("bf16 ")]
    assert len(fp32) + len(bf16) == len(jobs)
    # every kernel (the row kernels read the fp32 logits scratch whatever the heads' dtype:
    # an fp32 head's row equal to a bf16 head's bias-gradient row is that one's binary)
    assert {j["kernel"] for j in fp32} == {j["kernel"] for j in bf16}
    for j in fp32:
        assert not any(j["types"][n] == "*bf16" for n in j["fn"].arg_names if n not in j["consts"]), j["kernel"]
        assert all(j["consts"][p] == "ieee" for p in ("PREC", "PREC_S", "PREC_T") if p in j["consts"]), j["kernel"]
    # the fused distillation: each variant's fp32 candidates, none of them measured to spill
    for (kind, variant), div, teacher in ((("fwd", "teacher"), Divergence.REVERSE_KL, True),
                                          (("fwd", "no-teacher"), Divergence.REVERSE_KL, False),
                                          (("jsd", "jsd"), Divergence.JSD, True),
                                          (("dlogits", "forward_kl"), Divergence.FORWARD_KL, True)):
        want = {fd._key(c) for c in fd._configs(kind, div, True, teacher)}
        got = {(j["consts"]["BLOCK_N"], j["consts"]["BLOCK_V"], j["consts"]["BLOCK_K"], j["warps"], j["stages"])
               for j in fp32 if (j["kernel"], j["variant"]) == (kind, variant)}
        assert got == want and want and not want & fd._SPILLS32.get((kind, variant), set()), (kind, variant)
    gemm = {k: v for k, v in tiles.GEMM_GPU_FP32.items() if k.startswith("BLOCK")}
    assert all(j["consts"][k] == v for j in fp32 if j["kernel"] in ("dh", "dw", "dh_split") for k, v in gemm.items())
    # the row kernels write dL/dlogits in place into the fp32 scratch for every divergence
    rows = {(j["kernel"], j["variant"]) for j in jobs if j["types"].get("g_ptr") == "*fp32"
            and j["kernel"] in ("distill_rows", "rows")}
    assert rows >= {("distill_rows", f"{v}-fp32-grads") for v in ("reverse_kl", "forward_kl", "jsd", "no-teacher")}
    assert rows >= {("rows", "teacher-fp32-grads"), ("rows", "no-teacher-fp32-grads")}
    # attention: the fp32-only dK/dV tile at both head dims and every group, never offered to bf16
    q32, q16 = torch.empty(1, 1, 1, dtype=torch.float32), torch.empty(1, 1, 1, dtype=torch.bfloat16)
    for D in _aot.HEAD_DIMS:
        for group in _aot.GROUPS:
            gp2 = 1 << (group - 1).bit_length()
            keep32 = tuning.BWD_KV_PRUNE(tuning.BWD_KV_CONFIGS, {"HEAD_DIM": D, "Q": q32, "GROUP_P2": gp2})
            keep16 = tuning.BWD_KV_PRUNE(tuning.BWD_KV_CONFIGS, {"HEAD_DIM": D, "Q": q16, "GROUP_P2": gp2})
            launches = {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in keep32}
            assert launches and launches <= tuning.FP32_ONLY and not launches & tuning.SPILLS_FP32["dkdv"][D]
            assert not any((c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) in tuning.FP32_ONLY
                           for c in keep16)
            cfgs = {j["config"] for j in fp32 if j["kernel"] == "dkdv" and j["shape"] == f"fp32 D={D} group={group}"}
            assert cfgs == {f"BLOCK_M={bm},BLOCK_N={bn},w{w},s{s}" for bm, bn, w, s in launches}
    assert {j["shape"] for j in fp32 if j["variant"] == "deterministic"} == {
        f"fp32 D=128 group={g}" for g in _aot.DETERMINISTIC_GROUPS}
    # each distinct binary once
    assert len({_aot._spec(j) for j in jobs}) == len(jobs)
