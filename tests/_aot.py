"""Ahead-of-time compilation of memopd's Triton kernels for sm_90a (H100/H200), no GPU needed.

Triton's own compiler and its bundled ptxas run on CPU, so every kernel can be compiled
for Hopper offline, with any installed Triton (an older one installed beside the newest
with `pip install --no-deps --target DIR triton==X` is selected by putting DIR first on
PYTHONPATH). The interpreter cannot stand in for this: it accepts code the compiler
rejects, and it says nothing about registers, spills or shared memory.

Three layers:

* `compile_kernel`: one kernel, one specialisation, one launch configuration ->
  registers, spill bytes, shared memory, seconds, or a one-line error (the full compiler
  output is kept for a log).
* `matrix_jobs`: the production matrix. Every autotune candidate that the kernel's pruner
  keeps (a pruned candidate is never launched), plain and SAFE, at bf16 and at fp32 (its
  own tiles, exact dots): attention D=64/128 and GQA groups 1/4/8, and the deterministic
  backward's dK/dV (plain, D=128, groups 4/8); the fused distillation (both gradient paths),
  log-prob/entropy and actor-loss kernels at the lm-head sizes V=151,936 (Qwen2.5's padded head) and 151,665 (its
  tokenizer), H=2048/3584. Shapes enter a compile only through constexprs and the
  launcher's divisibility-by-16 specialisation, so equal specialisations are one job (and
  a job whose binary equals an earlier one's is left out).
* `python tests/_aot.py --shard i/n`: run a share of the jobs in this process (the Triton
  on sys.path) and print one JSON row per job; `run_matrix` starts one such process per
  Triton and shard in parallel and gathers the rows. With MEMOPD_AOT_CACHE set, rows are
  kept there under a key of the Triton version, the kernel's source hash (Triton's own
  `cache_key`, which covers the helpers it calls) and the job, so an unchanged kernel is
  not compiled again.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SM90_SHARED_LIMIT = 232448  # bytes of shared memory one block may use on H100/H200

# production lm-head shapes: (V, H); the specialisation depends only on V % 16 and H % 16
VOCABS = (151936, 151665)
HIDDENS = (2048, 3584)
HEAD_DIMS = (64, 128)
GROUPS = (1, 4, 8)
# the deterministic dK/dV rows (plain launches, every pruned candidate): D=128 at the GQA
# groups of the GPU tests (Hq/Hkv 16/2 and 32/8); each cold compile ~26 s (Triton 3.9.0,
# one loaded core), so 4 rows per Triton add ~2 min of compiler time to the AOT step
DETERMINISTIC_GROUPS = (4, 8)
# the dtypes of the matrix: bf16, and fp32 (exact "ieee" dots on the FMA units, its own
# tile lists): `memopd train`'s default dtype, taken by every Triton op on CUDA
ATTN_DTYPES = (("bf16", "bfloat16"), ("fp32", "float32"))
LM_DTYPES = ("bf16", "fp32")


# --------------------------------------------------------------------------------------
# one compile
# --------------------------------------------------------------------------------------
def compile_kernel(fn, types, consts, num_warps, num_stages, divisible=None, keep_ptx=False):
    """Compile `fn` for sm_90a. types: Triton type of each non-constexpr argument; consts:
    the constexpr values; divisible: the arguments the launcher would mark 16-divisible
    (default: every pointer and every stride). Returns a dict with regs, spills (bytes of
    spill stores + loads), shared (bytes), wgmma (whether Hopper warp-group MMAs are used),
    seconds, error (None, or one line) and log (the full compiler output of a failure);
    with keep_ptx, also ptx (the PTX text) when it compiled."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {n: ("constexpr" if n in consts else types[n]) for n in fn.arg_names}
    if divisible is None:
        divisible = [n for n in fn.arg_names if n not in consts and (sig[n].startswith("*") or n.startswith("stride"))]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    src = ASTSource(fn=fn, signature=sig, constexprs=dict(consts), attrs=attrs)
    os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"  # Triton prints ptxas -v output after each compile
    start = time.perf_counter()
    out_py = io.StringIO()
    with tempfile.TemporaryFile(mode="w+") as err_fd_file:
        # MLIR writes its diagnostics to file descriptor 2, not to sys.stderr
        saved = os.dup(2)
        sys.stderr.flush()
        os.dup2(err_fd_file.fileno(), 2)
        error = None
        try:
            with contextlib.redirect_stdout(out_py):
                kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                        options=dict(num_warps=num_warps, num_stages=num_stages))
        except Exception as e:  # noqa: BLE001 any compiler failure becomes one line; the full text goes to `log`
            error = e
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
        err_fd_file.seek(0)
        fd_text = err_fd_file.read()
    seconds = time.perf_counter() - start
    log = out_py.getvalue()
    if error is not None:
        return dict(regs=None, spills=None, shared=None, seconds=seconds, error=_one_line(error, fd_text),
                    log=f"{type(error).__name__}: {error}\n{fd_text}\n{log}")
    regs = re.findall(r"Used (\d+) registers", log)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    row = dict(regs=int(regs[-1]) if regs else None,
               spills=sum(int(a) + int(b) for a, b in spills) if spills else None,
               shared=int(kernel.metadata.shared), wgmma="warp_group_dot" in kernel.asm["ttgir"],
               seconds=seconds, error=None, log="")
    if keep_ptx:
        row["ptx"] = kernel.asm["ptx"]
    return row


def _one_line(exc, fd_text):
    """The first diagnostic that names the problem, on one line: MLIR's `error:` line when
    there is one, else the innermost exception of the chain (a CompilationError only
    points at the call site of the helper that failed)."""
    for line in fd_text.splitlines():
        if "error:" in line:
            return (f"{type(exc).__name__}: " + line.split("error:", 1)[1].strip())[:300]
    inner = exc
    while inner.__cause__ is not None or (inner.__context__ is not None and not inner.__suppress_context__):
        inner = inner.__cause__ or inner.__context__
    text = str(inner).strip().splitlines()
    msg = text[-1].strip() if text else ""
    return f"{type(inner).__name__}: {msg}"[:300]


# --------------------------------------------------------------------------------------
# the production matrix
# --------------------------------------------------------------------------------------
_ATTN_TYPES = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*bf16", "DO": "*bf16", "DK": "*bf16", "DV": "*bf16",
               "LSE": "*fp32", "DELTA": "*fp32", "SEG": "*i32", "PST": "*i32", "PEND": "*i32", "KQR": "*i32",
               "PART": "*fp32", "PLAN": "*i32", "RED": "*i32",
               "FLAGS": "*i8", "T": "i32", "sm_scale": "fp32", "qk_scale": "fp32", "GROUP": "i32"}

_LOSS_TYPES = dict(hs_ptr="*bf16", ws_ptr="*bf16", bs_ptr="*bf16", ht_ptr="*bf16", wt_ptr="*bf16",
                   bt_ptr="*bf16", tgt_ptr="*i64", order_ptr="*i32", count_ptr="*i32", div_ptr="*fp32",
                   lp_ptr="*fp32", ent_ptr="*fp32", stats_ptr="*fp32", gdiv_ptr="*fp32", glp_ptr="*fp32",
                   gent_ptr="*fp32", out_ptr="*bf16", part_ptr="*fp32", N="i32", Hs="i32", Ht="i32",
                   V="i32", c0="i32", n_rows="i32", v_per_split="i32", n_split="i32",
                   stride_hs="i32", stride_ws="i32",
                   stride_ht="i32", stride_wt="i32", stride_out="i32", inv_temp="fp32", beta="fp32")
_GEMM_TYPES = dict(g_ptr="*bf16", w_ptr="*bf16", h_ptr="*bf16", order_ptr="*i32", count_ptr="*i32",
                   dh_ptr="*bf16", dw_ptr="*fp32", part_ptr="*fp32", V="i32", H="i32", c0="i32", n_rows="i32",
                   k_per_split="i32", n_splits="i32", stride_g="i32", stride_w="i32", stride_dh="i32", stride_h="i32",
                   stride_dw="i32")
_LOGITS_TYPES = dict(h_ptr="*bf16", w_ptr="*bf16", b_ptr="*bf16", order_ptr="*i32", count_ptr="*i32",
                     out_ptr="*fp32", H="i32", V="i32", c0="i32", n_rows="i32", stride_h="i32", stride_w="i32",
                     stride_out="i32", inv_temp="fp32")
_ROWS_TYPES = dict(s_ptr="*fp32", t_ptr="*fp32", g_ptr="*bf16", targets_ptr="*i64", adv_ptr="*fp32", old_ptr="*fp32",
                   klkeep_ptr="*i1", order_ptr="*i32", count_ptr="*i32", stats_ptr="*fp32", part_ptr="*fp32",
                   N="i32", V="i32", c0="i32", stride_s="i32", stride_t="i32", stride_g="i32", clip_low="fp32",
                   clip_high="fp32",
                   dual_clip="fp32", g_h="fp32", kl_scale="fp32", inv_norm="fp32", inv_temp="fp32",
                   precise_limit="fp32")


# the distillation row kernel (gradients in the forward): the loss's names, the rows' scratch
_DISTILL_ROWS_TYPES = dict(_LOSS_TYPES, s_ptr="*fp32", t_ptr="*fp32", g_ptr="*bf16", stride_s="i32", stride_t="i32",
                           stride_g="i32")


def _attn_types(fn, dtype="bf16"):
    # DQ: the fp32 atomic accumulator in the dK/dV kernel, the output of the dQ kernel;
    # Q/K/V/O and their gradients in the inputs' dtype
    dq = "*fp32" if fn.__name__ == "bwd_dkdv_kernel" else f"*{dtype}"
    types = {n: dq if n == "DQ" else _ATTN_TYPES.get(n, "i32") for n in fn.arg_names}
    return {n: f"*{dtype}" if t == "*bf16" else t for n, t in types.items()}


def _lm_divisible(fn, consts, V, H):
    """What the launcher marks 16-divisible for an lm-head kernel: pointers, and the ints
    (sizes, strides) whose production value is a multiple of 16. V itself may be odd; the
    scratch rows are padded to `scratch_row_stride(V)` (a multiple of 64), so their strides
    always are; the sizes and strides over the hidden dimension are H."""
    from memopd.kernels.lm_head_tiles import scratch_row_stride
    names = []
    for n in fn.arg_names:
        if n in consts:
            continue
        if n.endswith("_ptr"):
            names.append(n)
        elif n == "V":
            if V % 16 == 0:
                names.append(n)
        elif n in ("stride_out", "stride_g", "stride_s", "stride_t"):
            if scratch_row_stride(V) % 16 == 0:
                names.append(n)
        elif n in ("Hs", "Ht", "H", "stride_hs", "stride_ws", "stride_ht", "stride_wt", "stride_w", "stride_h",
                   "stride_dh"):
            if H % 16 == 0:
                names.append(n)
        elif n == "stride_dw":
            names.append(n)  # the fp32 dW buffer is [V, H]: its stride is H
        elif n == "k_per_split":
            names.append(n)  # a multiple of BLOCK_K (`dh_split_width`)
    return names


def _job(family, kernel, variant, shape, fn, types, consts, warps, stages, divisible=None, pruned=False):
    cfg = ",".join(f"{k}={v}" for k, v in consts.items() if k.startswith("BLOCK")) + f",w{warps},s{stages}"
    return dict(family=family, kernel=kernel, variant=variant, shape=shape, config=cfg, fn=fn, types=types,
                consts=consts, warps=warps, stages=stages, divisible=divisible)


def attention_jobs():
    import torch

    import memopd.kernels.attention_kernels as ak
    import memopd.kernels.attention_tuning as tuning
    from memopd.kernels.attention_plan import dkdv_plan_spec
    from memopd.kernels.runtime import dot_precision

    kernels = [("fwd", ak.fwd_kernel, tuning.FWD_CONFIGS, tuning.FWD_PRUNE),
               ("dkdv", ak.bwd_dkdv_kernel, tuning.BWD_KV_CONFIGS, tuning.BWD_KV_PRUNE),
               ("dq", ak.bwd_dq_kernel, tuning.BWD_DQ_CONFIGS, tuning.BWD_DQ_PRUNE)]
    jobs = []
    for dt, torch_name in ATTN_DTYPES:
        torch_dtype = getattr(torch, torch_name)
        q = torch.empty(1, 1, 1, dtype=torch_dtype)
        prec = dot_precision(torch_dtype)  # bf16: "tf32" (unused by 16-bit dots); fp32: "ieee"
        for name, fn, configs, prune in kernels:
            # a kernel that takes the group as a runtime argument (fwd, dq) compiles to one
            # binary for every group; the dK/dV tiles are shaped by it (a constexpr)
            groups = GROUPS if any(p.name == "GROUP" and p.is_constexpr for p in fn.params) else (None,)
            for D in HEAD_DIMS:
                for group in groups:
                    gp2 = 1 if group is None else 1 << (group - 1).bit_length()
                    for c in prune(configs, {"HEAD_DIM": D, "Q": q, "GROUP_P2": gp2}):
                        for safe in (False, True):
                            consts = dict(HEAD_DIM=D, BLOCK_M=c.kwargs["BLOCK_M"], BLOCK_N=c.kwargs["BLOCK_N"],
                                          UPCAST=False, PREC=prec, SAFE=safe)
                            if name == "dkdv":
                                consts.update(GROUP=group, GROUP_P2=gp2, ATOMIC_DQ=True,
                                              PLAN_N=dkdv_plan_spec()[0])
                            shape = f"{dt} D={D}" + ("" if group is None else f" group={group}")
                            jobs.append(_job("attention", name, "safe" if safe else "plain", shape, fn,
                                             _attn_types(fn, dt), consts, c.num_warps, c.num_stages))
                            if name == "dkdv" and D == 128 and group in DETERMINISTIC_GROUPS and not safe:
                                # the deterministic backward's dK/dV: another binary (ATOMIC_DQ is a
                                # constexpr), at the GPU tests' shapes only
                                jobs.append(_job("attention", name, "deterministic", shape, fn, _attn_types(fn, dt),
                                                 dict(consts, ATOMIC_DQ=False), c.num_warps, c.num_stages))
        # the sum of the split dK/dV blocks' partials (`_reduce_partials`: one launch setting)
        for D in HEAD_DIMS:
            fn = ak.bwd_kv_reduce_kernel
            jobs.append(_job("attention", "dkdv-reduce", "plain", f"{dt} D={D}", fn, _attn_types(fn, dt),
                             dict(HEAD_DIM=D, BLOCK_R=32), 4, 3))
    return jobs


def _in_dtype(types, dt):
    """Kernel argument types with the 16-bit tensors (hidden states, weights, biases, a
    16-bit scratch) in dtype `dt` instead of bf16."""
    return {n: f"*{dt}" if t == "*bf16" else t for n, t in types.items()}


def lm_head_jobs():
    import memopd.kernels.actor_loss as al
    import memopd.kernels.distill_rows as dr
    import memopd.kernels.fused_distill as fd
    import memopd.kernels.lm_head_tiles as tiles
    from memopd.kernels.contract import Divergence

    jobs = []
    # specialisations of the production (V, H): H=2048 and 3584 are both multiples of 16
    specs = {}
    for V in VOCABS:
        for H in HIDDENS:
            specs.setdefault((V % 16 == 0, H % 16 == 0), (V, H))
    for dt in LM_DTYPES:
        fp32 = dt == "fp32"
        prec = "ieee" if fp32 else "tf32"  # `runtime.dot_precision`: fp32 heads run exact dots
        for V, H in specs.values():
            shape = f"{dt} V={V} H={'/'.join(str(h) for h in HIDDENS)}"
            variants = [("fwd", fd._distill_fwd_kernel, Divergence.REVERSE_KL, True, "teacher"),
                        ("fwd", fd._distill_fwd_kernel, Divergence.REVERSE_KL, False, "no-teacher"),
                        ("jsd", fd._jsd_pass_kernel, Divergence.JSD, True, "jsd"),
                        ("dlogits", fd._distill_dlogits_kernel, Divergence.REVERSE_KL, True, "reverse_kl"),
                        ("dlogits", fd._distill_dlogits_kernel, Divergence.FORWARD_KL, True, "forward_kl"),
                        ("dlogits", fd._distill_dlogits_kernel, Divergence.JSD, True, "jsd"),
                        ("dlogits", fd._distill_dlogits_kernel, Divergence.REVERSE_KL, False, "no-teacher")]
            for kind, fn, div, teacher, variant in variants:
                for c in fd._configs(kind, div, fp32, teacher):
                    consts = dict(HAS_BS=True, HAS_BT=teacher, UPCAST=False, PREC_S=prec, PREC_T=prec, **c.kwargs)
                    if kind != "jsd":
                        consts["DIV"] = int(div)
                    if kind == "fwd":
                        consts["HAS_TEACHER"] = teacher
                    if kind == "dlogits":
                        consts.update(HAS_GDIV=teacher, HAS_GLP=True, HAS_GENT=True)
                    jobs.append(_job("fused_distill", kind, variant, shape, fn, _in_dtype(_LOSS_TYPES, dt), consts,
                                     c.num_warps, c.num_stages, _lm_divisible(fn, consts, V, H)))
            g = dict(tiles.GEMM_GPU_FP32 if fp32 else tiles.GEMM_GPU)  # `gemm_meta`
            nw, ns = g.pop("num_warps"), g.pop("num_stages")
            # 16-bit heads: the scratch is bf16, or fp32 (a bias gradient: rounded in the
            # GEMM); fp32 heads: fp32 (the student's logits scratch, in place)
            scratches = (("gemm", "*fp32"),) if fp32 else (("gemm", "*bf16"), ("gemm-fp32-scratch", "*fp32"))
            for fn in (tiles.dh_kernel, tiles.dw_kernel, tiles.dh_split_kernel):
                consts = dict(UPCAST=False, PREC=prec, **g)
                for variant, g_type in scratches:
                    jobs.append(_job("fused_distill", fn.__name__.strip("_").replace("_kernel", ""), variant, shape,
                                     fn, dict(_in_dtype(_GEMM_TYPES, dt), g_ptr=g_type), consts, nw, ns,
                                     _lm_divisible(fn, consts, V, H)))
            r = dict(tiles.DH_REDUCE_GPU)
            nw = r.pop("num_warps")
            fn = tiles.dh_reduce_kernel
            jobs.append(_job("fused_distill", "dh_reduce", "gemm", shape, fn, _in_dtype(_GEMM_TYPES, dt), r, nw, 1,
                             _lm_divisible(fn, r, V, H)))
            meta = dict(tiles.logits_meta(fp32))
            nw, ns = meta.pop("num_warps"), meta.pop("num_stages")
            consts = dict(HAS_BIAS=True, UPCAST=False, PREC=prec, **meta)
            fn = tiles.scaled_logits_kernel
            jobs.append(_job("actor_loss", "logits", "plain", shape, fn, _in_dtype(_LOGITS_TYPES, dt), consts, nw, ns,
                             _lm_divisible(fn, consts, V, H)))
            # The row kernels read the fp32 logits scratch whatever the heads' dtype; only
            # the dL/dlogits they write differs: a bf16 scratch (16-bit heads without a bias
            # gradient), or in place into the fp32 student scratch (fp32 heads, or a bias
            # gradient). Every gradient term compiled in (the op's reduced loss needs the
            # divergence's alone). The fp32 heads' rows that equal a 16-bit head's
            # bias-gradient row are one binary (`matrix_jobs` keeps the first).
            for div, teacher, variant in ((Divergence.REVERSE_KL, True, "reverse_kl"),
                                          (Divergence.FORWARD_KL, True, "forward_kl"),
                                          (Divergence.JSD, True, "jsd"),
                                          (Divergence.REVERSE_KL, False, "no-teacher")):
                for grads in ("fp32",) if fp32 else ("bf16", "fp32") if variant == "reverse_kl" else ("bf16",):
                    consts = dict(DIV=int(div), HAS_TEACHER=teacher, HAS_GDIV=teacher, HAS_GLP=True, HAS_GENT=True,
                                  NEED_GRAD=True, BLOCK_V=dr.rows_block(V))
                    fn = dr._distill_rows_kernel
                    jobs.append(_job("fused_distill", "distill_rows", variant + ("-fp32-grads" if grads == "fp32" else ""),
                                     shape, fn, dict(_DISTILL_ROWS_TYPES, g_ptr=f"*{grads}"), consts,
                                     dr.ROWS_LAUNCH["num_warps"], dr.ROWS_LAUNCH["num_stages"],
                                     _lm_divisible(fn, consts, V, H)))
            for teacher, grads in ((True, "fp32"), (False, "fp32")) if fp32 else \
                    ((True, "bf16"), (False, "bf16"), (True, "fp32")):
                consts = dict(HAS_TEACHER=teacher, DUAL=True, NEED_GRAD=True, BLOCK_V=al._rows_block(V))
                fn = al._actor_rows_kernel
                variant = ("teacher" if teacher else "no-teacher") + ("" if grads == "bf16" else "-fp32-grads")
                jobs.append(_job("actor_loss", "rows", variant, shape, fn, dict(_ROWS_TYPES, g_ptr=f"*{grads}"),
                                 consts, al._ROWS_LAUNCH["num_warps"], al._ROWS_LAUNCH["num_stages"],
                                 _lm_divisible(fn, consts, V, H)))
    return jobs


def _spec(job):
    """What decides a job's binary: kernel, argument types, constexprs, launch, 16-divisibility."""
    return json.dumps([job["fn"].__module__, job["fn"].__name__, job["types"], job["consts"], job["warps"],
                       job["stages"], job["divisible"]], sort_keys=True, default=str)


def matrix_jobs():
    """Every job of the matrix, each distinct binary once: a job whose specialisation equals
    an earlier one's (e.g. the fp32 heads' reverse-KL row kernel and a bf16 head's with a
    bias gradient) is left out, its binary already compiled under the first one's name."""
    jobs, seen = [], set()
    for job in attention_jobs() + lm_head_jobs():
        spec = _spec(job)
        if spec not in seen:
            seen.add(spec)
            jobs.append(job)
    return jobs


_ROW_SCHEMA = 2  # bump when compile_kernel's row gains or changes a field


def _cache_key(job):
    import triton

    spec = json.dumps([_ROW_SCHEMA, triton.__version__, job["fn"].cache_key, job["types"], job["consts"], job["warps"],
                       job["stages"], job["divisible"]], sort_keys=True, default=str)
    return hashlib.sha256(spec.encode()).hexdigest()[:32]


def run_jobs(jobs, cache_dir=None, log_file=None):
    """Compile each job (or take its row from cache_dir); yields one row per job."""
    import triton

    for job in jobs:
        row = {k: job[k] for k in ("family", "kernel", "variant", "shape", "config")}
        row["triton"] = triton.__version__
        path = os.path.join(cache_dir, _cache_key(job) + ".json") if cache_dir else None
        if path and os.path.exists(path):
            with open(path) as f:
                row.update(json.load(f), cached=True)
            yield row
            continue
        res = compile_kernel(job["fn"], job["types"], job["consts"], job["warps"], job["stages"], job["divisible"])
        log = res.pop("log")
        if log and log_file is not None:
            log_file.write(f"==== {row}\n{log}\n")
            log_file.flush()
        if path and res["error"] is None:
            os.makedirs(cache_dir, exist_ok=True)
            with open(path + ".tmp", "w") as f:
                json.dump(res, f)
            os.replace(path + ".tmp", path)
        row.update(res, cached=False)
        yield row


# --------------------------------------------------------------------------------------
# host side: one process per (Triton, shard), in parallel
# --------------------------------------------------------------------------------------
def triton_version_at(site_dir):
    """The version of the Triton under site_dir ('' = the default one), or None."""
    env = _child_env(site_dir)
    r = subprocess.run([sys.executable, "-c", "import triton; print(triton.__version__)"], env=env,
                       capture_output=True, text=True, timeout=120)
    return r.stdout.strip() if r.returncode == 0 else None


def _child_env(site_dir):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    paths = [p for p in (site_dir, ROOT, env.get("PYTHONPATH", "")) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def run_matrix(site_dirs, shards_per_triton=1, cache_dir=None, log_dir=None, timeout=5400, select=None):
    """Run the matrix under each Triton (site_dirs: '' for the default one, else a
    directory holding another), `shards_per_triton` processes each, all at once. Returns
    (rows, failures): failures are processes that died without their rows (one line each)."""
    procs = []
    for site in site_dirs:
        for i in range(shards_per_triton):
            cmd = [sys.executable, os.path.abspath(__file__), "--shard", f"{i}/{shards_per_triton}"]
            if cache_dir:
                cmd += ["--cache", cache_dir]
            if log_dir:
                tag = (os.path.basename(site.rstrip("/")) or "default") + f"-{i}"
                cmd += ["--log", os.path.join(log_dir, f"aot-{tag}.log")]
            if select:
                cmd += ["--select", select]
            procs.append((site, subprocess.Popen(cmd, env=_child_env(site), stdout=subprocess.PIPE,
                                                 stderr=subprocess.PIPE, text=True)))
    rows, failures = [], []
    deadline = time.monotonic() + timeout
    for site, p in procs:
        try:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
            failures.append(f"{site or 'default Triton'}: timed out after {timeout} s")
        got = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        rows += got
        if p.returncode != 0:
            tail = (err.strip().splitlines() or ["(no output)"])[-1]
            failures.append(f"{site or 'default Triton'}: worker exited {p.returncode}: {tail}")
    return rows, failures


def format_table(rows):
    """A Markdown table: one line per (kernel, variant, shape, config), a column pair per
    Triton version (registers / spill bytes, shared KiB), errors in one line."""
    versions = sorted({r["triton"] for r in rows})
    key = lambda r: (r["family"], r["kernel"], r["shape"], r["config"], r["variant"])  # noqa: E731
    table = {}
    for r in rows:
        table.setdefault(key(r), {})[r["triton"]] = r
    head = "| family | kernel | variant | shape | config | " + " | ".join(
        f"Triton {v}: regs / spill B / smem KiB" for v in versions) + " |"
    lines = [head, "|" + "---|" * (5 + len(versions))]
    for k in sorted(table):
        cells = []
        for v in versions:
            r = table[k].get(v)
            if r is None:
                cells.append("-")
            elif r["error"]:
                cells.append("ERROR")
            else:
                cells.append(f"{r['regs']} / {r['spills']} / {r['shared'] / 1024:.0f}")
        fam, kern, shape, cfg, var = k
        lines.append(f"| {fam} | {kern} | {var} | {shape} | {cfg} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shard", default="0/1", help="i/n: compile every n-th job starting at i")
    ap.add_argument("--cache", default=os.environ.get("MEMOPD_AOT_CACHE"), help="directory of cached rows")
    ap.add_argument("--log", help="append the full compiler output of failed compiles here")
    ap.add_argument("--select", help="only jobs whose family/kernel/variant/shape contains this text")
    ap.add_argument("--list", action="store_true", help="print the jobs, compile nothing")
    a = ap.parse_args(argv)
    # a private, empty Triton cache: a cache hit skips ptxas, and with it the register report
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="memopd-aot-")
    i, n = (int(x) for x in a.shard.split("/"))
    jobs = matrix_jobs()
    if a.select:
        jobs = [j for j in jobs if a.select in f"{j['family']}/{j['kernel']}/{j['variant']}/{j['shape']}"]
    # interleave so that every shard gets a similar mix of large and small kernels
    jobs = jobs[i::n]
    if a.list:
        for j in jobs:
            print(j["family"], j["kernel"], j["variant"], j["shape"], j["config"])
        return 0
    log = open(a.log, "a") if a.log else None
    try:
        for row in run_jobs(jobs, a.cache, log):
            print(json.dumps(row), flush=True)
    finally:
        if log:
            log.close()
        shutil.rmtree(os.environ["TRITON_CACHE_DIR"], ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    sys.exit(main())
