"""Benchmark: the fused losses (PPO actor loss, reverse KL, forward KL, JSD) against the code they
replace and against Liger-Kernel's chunked losses, side by side.

Contenders (CPU, fp32, forward + backward, gradients to the student hidden states and
weight), in four groups, each with its own naive baseline and peer:

  actor loss: PPO surrogate + entropy bonus + full-vocabulary reverse KL to a frozen teacher
    naive        logits materialised, log_softmax, the loss in PyTorch (reference_actor_loss)
    composed     fused_linear_reverse_kl(reduction="none") + PPO surrogate + entropy bonus
                 (the trainer's path before fused_linear_actor_loss)
    fused_actor  memopd.ops.fused_linear_actor_loss
    fused_actor_plain_ops  the same with its elementwise work in PyTorch ops
                 (MEMOPD_NATIVE_CHUNKS=0: the path before the C++ core's chunk kernels)
    liger_grpo   Liger's chunked LigerFusedLinearGRPOLoss (PPO clip surrogate; its KL is the
                 per-token k3 estimate to a reference model, not a full-vocabulary KL, and it
                 has no entropy term), torch.compile'd; skipped without liger-kernel
  reverse KL: the mean KL(student || teacher) over the tokens, nothing else
    naive_rkl    reference_linear_reverse_kl (materialising)
    fused_rkl    fused_linear_reverse_kl (gradients taken in the forward, the CPU default)
    fused_rkl_recompute  the same with gradients="recompute" (the backward recomputes)
    fused_rkl_plain_ops  fused_rkl with its elementwise work in PyTorch ops (as above)
    liger_rkl    Liger's chunked LigerFusedLinearJSDLoss with beta=1 (reverse KL),
                 torch.compile'd as Liger ships it; skipped without liger-kernel
  forward KL: the mean KL(teacher || student) over the tokens
    naive_fkl, fused_fkl, liger_fkl  (the same three roles; Liger's beta=0 is this KL)
  JSD (beta = 0.5): the generalised JSD of TRL's GKD
    naive_jsd, fused_jsd, liger_jsd  (the same three roles)
  teacher-less: a GRPO-style -sum(A logprob) / N - 0.01 sum(entropy) / N, no teacher
    naive_lpe    reference_linear_logprob_entropy (materialising) and the loss in PyTorch
    fused_lpe_recompute  fused_linear_logprob_entropy, the plain call: the loss built from
                 its per-token outputs, the backward recomputing the logits
    fused_lpe    the same op with the loss declared (logprob_weight=, entropy_weight=):
                 its gradients taken in the forward
    fused_actor_noteacher  fused_linear_actor_loss without a teacher (PPO surrogate +
                 entropy bonus: the trainer's teacher-less path)

The actor loss is compared with liger_rkl too: it does the reverse KL's work plus PPO
and entropy.

  before: fused_<op>_before (the op from --before-tree, an earlier source tree; with bf16
    inputs fused_<op>_before_bf16) and
    fused_<op>_rows256 (resident token blocks planned without the machine's share: 256 rows at
    the benchmark shapes), to measure a change before and after in one run

  GEMM floor: the four [N, H] x [H, V]-sized matmuls of a fused loss with a teacher and its
    gradients taken in the forward (student and teacher logits, dH, dW), unchunked, no
    elementwise work: gemm_floor (fp32), gemm_floor_bf16 (torch's bf16 matmul, bf16 output:
    the bf16 rate of this CPU); gemm_floor3 (and _bf16): the three of the teacher-less
    losses (logits, dH, dW), their floor

bf16: every fused and Liger contender also runs with bfloat16 hidden states and weights
under the name `<contender>_bf16` (the fused ops' logits in fp32 from bf16 operands where
the C++ core has its bf16 GEMM; Liger's in bf16), held to the Liger peer's `_bf16` run.
`--precision` measures, for the contenders given, the relative error of the loss and of
dW (max |error| / max |dW|) against the float64 reference of the same inputs (the bf16
values, exactly, for the _bf16 runs) on the first PRECISION_ROWS tokens of each shape.

Each (contender, shape) runs in a fresh subprocess with one torch thread: it builds its
inputs, warms up (at the real shape for the compiled Liger losses, so compilation is not
timed; at a tiny shape for the others), resets the peak-RSS counter
(/proc/self/clear_refs), then times one forward + backward with the process clock (CPU
seconds of the one thread, robust to other load on the machine) and the wall clock, and
reports the peak resident memory added above its inputs (VmHWM minus the RSS before the
call). Rounds are interleaved (contender order rotates per round); the table reports
medians and ratios to naive.

Run it directly (the full comparison, several minutes; results JSON under
benchmarks/results/):

    python benchmarks/bench_actor_loss.py                    # both shapes, 3 rounds
    python benchmarks/bench_actor_loss.py --shapes small --rounds 5

or through pytest-benchmark (`pytest benchmarks/bench_actor_loss.py --benchmark-only`),
which runs the small shape once per contender in-process for the timing record.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
from _fresh_process import measure_call

SHAPES = {
    "small": dict(N=4096, H=512, V=32000),
    "small2k": dict(N=2048, H=512, V=32000),
    "qwen": dict(N=1024, H=1024, V=151936),
    "tiny": dict(N=512, H=64, V=2048),  # a smoke test of every contender (seconds)
}
# group -> (its naive baseline, the contenders of the group, the peer its fused op is held to)
GROUPS = {
    "actor": ("naive", ("composed", "fused_actor", "fused_actor_plain_ops", "liger_grpo"), "liger_rkl"),
    "reverse_kl": ("naive_rkl", ("fused_rkl", "fused_rkl_recompute", "fused_rkl_plain_ops", "liger_rkl"), "liger_rkl"),
    "forward_kl": ("naive_fkl", ("fused_fkl", "liger_fkl"), "liger_fkl"),
    "jsd": ("naive_jsd", ("fused_jsd", "liger_jsd"), "liger_jsd"),
    "before": (None, ("fused_actor_before", "fused_rkl_before", "fused_fkl_before", "fused_jsd_before",
                      "fused_lpe_before", "fused_actor_rows256", "fused_rkl_rows256", "fused_fkl_rows256", "fused_jsd_rows256"), None),
    "teacherless": ("naive_lpe", ("fused_lpe", "fused_lpe_recompute", "fused_actor_noteacher"), None),
    "floor": ("gemm_floor", ("gemm_floor_bf16", "gemm_floor3", "gemm_floor3_bf16"), None),
}
_BF16 = [n + "_bf16" for _, names, _ in GROUPS.values() for n in names if n.startswith(("fused", "liger"))]
_BF16 = [n for n in _BF16 if not n.endswith("_rows256_bf16")]
CONTENDERS = tuple(n for base, names, _ in GROUPS.values() for n in (base, *names) if n) + tuple(_BF16)
BASELINE = {n: base for base, names, _ in GROUPS.values() for n in (base, *names) if n}
BASELINE.update({n: BASELINE[n[: -len("_bf16")]] for n in _BF16})
# the "before" group: the same ops from another source tree (--before-tree, e.g. the
# commit before a change: fresh processes with that tree first on PYTHONPATH), or with
# the resident token blocks planned without the machine's share (`_rows256`: the 256-row
# blocks of the benchmark shapes before they were sized by the machine)
_VARIANT_OF = {n: n.rsplit("_", 1)[0] for n in GROUPS["before"][1]}
_PEER_OF_OP = {"fused_actor": "liger_rkl", "fused_rkl": "liger_rkl", "fused_fkl": "liger_fkl", "fused_jsd": "liger_jsd"}
BASELINE.update({n: {"fused_actor": "naive"}.get(op, "naive_" + op.split("_")[1]) for n, op in _VARIANT_OF.items()})
PEER = {n: peer for _, names, peer in GROUPS.values() for n in names if n.startswith(("fused", "composed")) and peer}
PEER.update({n: _PEER_OF_OP[op] for n, op in _VARIANT_OF.items() if op in _PEER_OF_OP})
PEER.update({n: PEER[n[: -len("_bf16")]] + "_bf16" for n in _BF16 if n[: -len("_bf16")] in PEER})
_TEACHERLESS = ("fused_lpe", "fused_actor_noteacher")  # their floor: the three GEMMs of gemm_floor3
FLOOR = {n: ("gemm_floor3" if n.startswith(_TEACHERLESS) else "gemm_floor") + ("_bf16" if n.endswith("_bf16") else "")
         for n in CONTENDERS if n.startswith(("fused_rkl", "fused_actor", "fused_fkl", "fused_jsd", "liger_rkl",
                                               "liger_fkl", "liger_jsd", "fused_lpe"))}
PRECISION_ROWS = 256
COEF = dict(clip_eps=0.2, entropy_coef=0.01, teacher_kl_coef=0.5)
ENTROPY_COEF = COEF["entropy_coef"]  # the teacher-less group's loss: -sum(A logprob) / N - this * sum(H) / N
SEQ_LEN = 256  # Liger's GRPO loss takes [B, T] batches


def make_inputs(N, H, V, seed=0):
    g = torch.Generator().manual_seed(seed)
    hs = (torch.randn(N, H, generator=g) * 0.5).requires_grad_()
    ws = (torch.randn(V, H, generator=g) * 0.05).requires_grad_()
    ht = torch.randn(N, H, generator=g) * 0.5
    wt = torch.randn(V, H, generator=g) * 0.05
    y = torch.randint(0, V, (N,), generator=g)
    adv = torch.randn(N, generator=g)
    old = -torch.rand(N, generator=g) * 4 - 3
    return hs, ws, ht, wt, y, adv, old


def as_dtype(inputs, dtype):
    """The inputs with hidden states and weights in `dtype` (fresh leaves where they need grads)."""
    hs, ws, ht, wt, *rest = inputs
    return (hs.detach().to(dtype).requires_grad_(), ws.detach().to(dtype).requires_grad_(), ht.to(dtype),
            wt.to(dtype), *rest)


def step_fn(name, loss_out=None):
    """A function (hs, ws, ht, wt, y, adv, old) -> None that runs forward + backward; with
    `loss_out` (a list) each call appends its loss."""
    from memopd.ops import (
        fused_linear_actor_loss,
        fused_linear_logprob_entropy,
        fused_linear_reverse_kl,
        reference_actor_loss,
        reference_linear_logprob_entropy,
    )

    name = name.removesuffix("_bf16")  # the dtype is the inputs' (`measure`)
    if name.endswith("_rows256"):  # read at each call (memopd.ops.distill_torch._resident_machine_bytes)
        os.environ["MEMOPD_RESIDENT_MACHINE_BYTES"] = "0"
    name = _VARIANT_OF.get(name, name)  # a _before run differs only in its PYTHONPATH (`run_subprocess`)
    keep = (lambda x: x) if loss_out is None else (lambda x: loss_out.append(x.detach()) or x)
    if name.startswith("gemm_floor"):
        def run(hs, ws, ht, wt, y, adv, old):
            dt = torch.bfloat16 if name.endswith("_bf16") else hs.dtype
            h, w, h2, w2 = (x.detach().to(dt) for x in (hs, ws, ht, wt))
            s = h @ w.t()
            if not name.startswith("gemm_floor3"):
                h2 @ w2.t()
            s @ w
            s.t() @ h
        return run
    if name.endswith("_plain_ops"):  # read at each call (memopd.ops._native_chunks.usable)
        os.environ["MEMOPD_NATIVE_CHUNKS"] = "0"
        name = name[: -len("_plain_ops")]
    if name == "naive":
        def run(hs, ws, ht, wt, y, adv, old):
            keep(reference_actor_loss(hs, ws, y, adv, old, teacher_hidden=ht, teacher_weight=wt, **COEF).loss).backward()
    elif name == "fused_actor":
        def run(hs, ws, ht, wt, y, adv, old):
            keep(fused_linear_actor_loss(hs, ws, y, adv, old, teacher_hidden=ht, teacher_weight=wt, **COEF).loss).backward()
    elif name == "fused_actor_noteacher":
        def run(hs, ws, ht, wt, y, adv, old):
            keep(fused_linear_actor_loss(hs, ws, y, adv, old, clip_eps=COEF["clip_eps"],
                                         entropy_coef=ENTROPY_COEF).loss).backward()
    elif name == "fused_lpe":
        def run(hs, ws, ht, wt, y, adv, old):
            n = y.shape[0]
            keep(fused_linear_logprob_entropy(hs, ws, y, logprob_weight=-adv / n,
                                              entropy_weight=-ENTROPY_COEF / n).loss).backward()
    elif name in ("naive_lpe", "fused_lpe_recompute"):
        op = reference_linear_logprob_entropy if name == "naive_lpe" else fused_linear_logprob_entropy

        def run(hs, ws, ht, wt, y, adv, old):
            out = op(hs, ws, y)
            keep((-(adv * out.logprobs).sum() - ENTROPY_COEF * out.entropy.sum()) / y.shape[0]).backward()
    elif name == "composed":
        from memopd.trainer.ppo import policy_loss

        def run(hs, ws, ht, wt, y, adv, old):
            d = fused_linear_reverse_kl(hs, ws, ht, wt, y, reduction="none")
            pg, _ = policy_loss(d.logprobs, old, adv, COEF["clip_eps"])
            n = y.shape[0]
            ((pg.sum() - COEF["entropy_coef"] * d.entropy.sum()) / n + COEF["teacher_kl_coef"] * d.kl.sum() / n).backward()
    elif name in ("naive_rkl", "naive_fkl", "naive_jsd", "fused_rkl", "fused_rkl_recompute", "fused_fkl", "fused_jsd"):
        from memopd.ops import fused_linear_distill, reference_linear_distill

        op = reference_linear_distill if name.startswith("naive") else fused_linear_distill
        kw = {"jsd": dict(divergence="jsd", beta=0.5), "fkl": dict(divergence="forward_kl")}.get(
            name.rsplit("_", 1)[-1], dict(divergence="reverse_kl"))
        if name == "fused_rkl_recompute":
            kw["gradients"] = "recompute"

        def run(hs, ws, ht, wt, y, adv, old):
            keep(op(hs, ws, ht, wt, y, **kw).loss).backward()
    elif name in ("liger_rkl", "liger_fkl", "liger_jsd"):
        from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss

        # Liger's beta weighs the teacher like TRL's: 1 = reverse KL, 0 = forward KL, 0.5 = the
        # symmetric JSD
        loss = LigerFusedLinearJSDLoss(weight_hard_loss=0.0, weight_soft_loss=1.0,
                                       beta={"liger_rkl": 1.0, "liger_fkl": 0.0}.get(name, 0.5), compiled=True)

        def run(hs, ws, ht, wt, y, adv, old):
            keep(loss(hs, ws, ht, wt, y)).backward()
    elif name == "liger_grpo":
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        loss = LigerFusedLinearGRPOLoss(beta=COEF["teacher_kl_coef"], compiled=True, use_ref_model=True, loss_type="grpo")

        def run(hs, ws, ht, wt, y, adv, old):
            B = y.shape[0] // SEQ_LEN
            shape = (B, SEQ_LEN)
            out = loss(hs.view(B, SEQ_LEN, -1), ws, y.view(shape), torch.ones(shape, dtype=torch.long),
                       adv.view(shape)[:, 0].contiguous(), old_per_token_logps=old.view(shape),
                       ref_input=ht.view(B, SEQ_LEN, -1), ref_weight=wt)
            (out[0] if isinstance(out, tuple) else out).backward()
    else:
        raise ValueError(f"unknown contender {name!r}")
    return run


def _inputs(name, seed=0, **shape):
    inputs = make_inputs(**shape, seed=seed)
    return as_dtype(inputs, torch.bfloat16) if name.endswith("_bf16") else inputs


def measure(name, shape):
    """One timed forward + backward in this (fresh) process; returns a dict."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    run = step_fn(name)
    s = SHAPES[shape]
    if name.startswith("liger"):  # compile at the real shape: compilation is not timed
        run(*_inputs(name, **s, seed=1))
    else:
        run(*_inputs(name, N=SEQ_LEN, H=64, V=512, seed=1))
    inputs = _inputs(name, **s)
    _, m = measure_call(lambda: run(*inputs))
    import memopd

    return {"contender": name, "shape": shape, "cpu_s": m["cpu_s"], "wall_s": m["wall_s"], "peak_mb": m["peak_kb"] / 1024,
            "memopd": os.path.dirname(os.path.dirname(os.path.abspath(memopd.__file__)))}


def precision(name, shape):
    """The loss's and dW's relative errors against the float64 reference (`reference_actor_loss`
    or `reference_linear_distill` of the group's math, on the same input values) over the first
    PRECISION_ROWS tokens of `shape`; returns a dict."""
    from memopd.ops import reference_actor_loss, reference_linear_distill, reference_linear_logprob_entropy

    torch.set_num_threads(1)
    s = dict(SHAPES[shape], N=min(PRECISION_ROWS, SHAPES[shape]["N"]))
    inputs = _inputs(name, **s)
    losses = []
    step_fn(name, losses)(*inputs)
    hs, ws, ht, wt, y, adv, old = (x.detach().double().requires_grad_(x.requires_grad) if x.is_floating_point()
                                   else x for x in inputs)
    base = name.removesuffix("_bf16").removesuffix("_plain_ops").removesuffix("_recompute")
    if base == "fused_actor":
        ref = reference_actor_loss(hs, ws, y, adv, old, teacher_hidden=ht, teacher_weight=wt, **COEF).loss
    elif base == "fused_actor_noteacher":
        ref = reference_actor_loss(hs, ws, y, adv, old, clip_eps=COEF["clip_eps"], entropy_coef=ENTROPY_COEF).loss
    elif base == "fused_lpe":
        out = reference_linear_logprob_entropy(hs, ws, y)
        ref = (-(adv * out.logprobs).sum() - ENTROPY_COEF * out.entropy.sum()) / y.shape[0]
    else:
        div = {"fkl": "forward_kl", "jsd": "jsd"}.get(base.rsplit("_", 1)[-1], "reverse_kl")
        ref = reference_linear_distill(hs, ws, ht, wt, y, divergence=div, beta=0.5).loss
    ref.backward()
    loss_err = abs(losses[0].double().item() - ref.item()) / abs(ref.item())
    dw_err = ((inputs[1].grad.double() - ws.grad).abs().max() / ws.grad.abs().max()).item()
    return {"contender": name, "shape": shape, "rows": s["N"], "loss_rel_err": loss_err, "dw_rel_err": dw_err}


BEFORE_TREE = os.environ.get("MEMOPD_BENCH_BEFORE_TREE", "")  # --before-tree


def run_subprocess(name, shape, timeout=1800, mode="--measure"):
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    if name.removesuffix("_bf16").endswith("_before"):
        env["PYTHONPATH"] = os.pathsep.join([BEFORE_TREE] + [p for p in [env.get("PYTHONPATH")] if p])
    cmd = [sys.executable, os.path.abspath(__file__), mode, name, shape]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if res.returncode != 0:
        tail = (res.stderr or res.stdout).strip().splitlines()[-1:] or ["?"]
        return {"contender": name, "shape": shape, "error": tail[0][:300]}
    return json.loads(res.stdout.strip().splitlines()[-1])


def available(name) -> str | None:
    """None if the contender can run here, else why not."""
    if name.removesuffix("_bf16").endswith("_before") and not BEFORE_TREE:
        return "no --before-tree given"
    if name.startswith("liger"):
        try:
            import liger_kernel.chunked_loss  # noqa: F401
        except Exception as e:  # noqa: BLE001
            return f"liger-kernel not importable ({type(e).__name__})"
    return None


def compare(shapes, rounds, contenders=CONTENDERS, log=print):
    results = {}
    skipped = {}
    for name in contenders:
        why = available(name)
        if why:
            skipped[name] = why
            log(f"skip {name}: {why}")
    names = [c for c in contenders if c not in skipped]
    for shape in shapes:
        for r in range(rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                m = run_subprocess(name, shape)
                results.setdefault((shape, name), []).append(m)
                log(f"[{shape} round {r + 1}] {name}: " + (m["error"] if "error" in m else
                    f"cpu {m['cpu_s']:.2f} s, wall {m['wall_s']:.2f} s, peak +{m['peak_mb']:.0f} MiB"))
    return results, skipped


def _medians(results, shape, name):
    ms = [m for m in results.get((shape, name), []) if "error" not in m]
    if not ms:
        return None
    cpu = [m["cpu_s"] for m in ms]
    return {"rounds": len(ms), "cpu_s": statistics.median(cpu), "cpu_min_s": min(cpu), "cpu_max_s": max(cpu),
            "wall_s": statistics.median(m["wall_s"] for m in ms), "peak_mb": statistics.median(m["peak_mb"] for m in ms)}


def summarise(results, shapes, contenders=CONTENDERS):
    """One row per (shape, contender) measured: medians, min/max CPU time, and ratios to its
    group's naive baseline and (for our ops) to the Liger peer of the same math."""
    rows = []
    for shape in shapes:
        for name in contenders:
            med = _medians(results, shape, name)
            if med is None:
                errs = [m["error"] for m in results.get((shape, name), []) if "error" in m]
                if errs:
                    rows.append({"shape": shape, "contender": name, "error": errs[0]})
                continue
            row = {"shape": shape, "contender": name, **{k: round(v, 3) for k, v in med.items()}}
            floor = _medians(results, shape, FLOOR.get(name, ""))
            if floor is not None:
                row["floor"] = FLOOR[name]
                row["time_vs_floor"] = round(med["cpu_s"] / floor["cpu_s"], 3)
            base = _medians(results, shape, BASELINE[name])
            if base is not None:
                row["baseline"] = BASELINE[name]
                row["time_vs_naive"] = round(med["cpu_s"] / base["cpu_s"], 3)
                row["memory_vs_naive"] = round(med["peak_mb"] / max(base["peak_mb"], 1e-9), 4)
            peer = _medians(results, shape, PEER.get(name, ""))
            if peer is not None:
                row["peer"] = PEER[name]
                row["time_vs_peer"] = round(med["cpu_s"] / peer["cpu_s"], 3)
                row["memory_vs_peer"] = round(med["peak_mb"] / max(peer["peak_mb"], 1e-9), 4)
            rows.append(row)
    return rows


def format_table(rows):
    out = [f"{'shape':<8}{'contender':<26}{'cpu s (min-max)':>22}{'peak MiB':>10}{'time/naive':>12}"
           f"{'mem/naive':>11}{'time/peer':>11}{'mem/peer':>10}{'time/floor':>12}"]

    def ratio(r, k, width, fmt):
        return f"{r[k]:>{width}{fmt}}" if k in r else f"{'-':>{width}}"

    for r in rows:
        if "error" in r:
            out.append(f"{r['shape']:<8}{r['contender']:<26}  error: {r['error']}")
            continue
        spread = f"{r['cpu_s']:.2f} ({r['cpu_min_s']:.2f}-{r['cpu_max_s']:.2f})"
        out.append(f"{r['shape']:<8}{r['contender']:<26}{spread:>22}{r['peak_mb']:>10.0f}"
                   + ratio(r, "time_vs_naive", 12, ".2f") + ratio(r, "memory_vs_naive", 11, ".3f")
                   + ratio(r, "time_vs_peer", 11, ".2f") + ratio(r, "memory_vs_peer", 10, ".2f")
                   + ratio(r, "time_vs_floor", 12, ".3f"))
    return "\n".join(out)


def main(argv=None):
    global BEFORE_TREE
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--measure", nargs=2, metavar=("CONTENDER", "SHAPE"), help=argparse.SUPPRESS)
    p.add_argument("--precision-of", nargs=2, metavar=("CONTENDER", "SHAPE"), help=argparse.SUPPRESS)
    p.add_argument("--precision", action="store_true",
                   help="also measure each contender's loss and dW error against float64 (fresh processes)")
    p.add_argument("--shapes", nargs="+", default=["small", "small2k", "qwen"], choices=list(SHAPES))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--contenders", nargs="+", default=list(CONTENDERS), choices=list(CONTENDERS))
    p.add_argument("--before-tree", default=BEFORE_TREE,
                   help="a source tree whose memopd the *_before contenders import (e.g. a `git archive` of an "
                        "earlier commit with its built core)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                 "actor_loss_cpu.json"))
    args = p.parse_args(argv)
    BEFORE_TREE = os.path.abspath(args.before_tree) if args.before_tree else ""
    if args.measure:
        print(json.dumps(measure(*args.measure)))
        return 0
    if args.precision_of:
        print(json.dumps(precision(*args.precision_of)))
        return 0
    started = (time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), os.getloadavg())
    results, skipped = compare(args.shapes, args.rounds, args.contenders) if args.rounds > 0 else ({}, {})
    rows = summarise(results, args.shapes, args.contenders)
    prec = []
    if args.precision:
        for shape in args.shapes:
            for name in args.contenders:
                if name.startswith(("naive", "gemm_floor", "composed", "liger_grpo")) or name in skipped:
                    continue
                prec.append(run_subprocess(name, shape, mode="--precision-of"))
                print(f"[{shape} precision] {name}: {prec[-1]}")
    print(f"\nCPU forward+backward (fp32; *_bf16: bfloat16 heads), 1 thread, process clock; medians over rounds (min-max); ratios to the "
          f"group's naive baseline and to the Liger peer; load average at the end {os.getloadavg()[0]:.1f}")
    print(format_table(rows))
    for r in prec:
        if "error" not in r:
            print(f"{r['shape']:<8}{r['contender']:<26} loss rel. err {r['loss_rel_err']:.2e}  "
                  f"dW rel. err {r['dw_rel_err']:.2e}  (first {r['rows']} tokens vs float64)")
    meta = {"clock": "process CPU time of one torch thread (fresh subprocess per measurement)",
            "rounds": args.rounds, "torch": torch.__version__, "skipped": skipped, "before_tree": BEFORE_TREE,
            "shapes": {k: SHAPES[k] for k in args.shapes}, "started": started[0], "loadavg_at_start": started[1],
            "ended": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "loadavg_at_end": os.getloadavg()}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows, "precision": prec,
                   "raw": {f"{s}/{n}": v for (s, n), v in results.items()}}, f, indent=2)
    print(f"\nresults: {args.out}")
    return 0


# ---------------------------------------------------------------- pytest-benchmark entry
try:
    import pytest
except ImportError:  # pragma: no cover
    pytest = None

if pytest is not None:
    CPU_CONTENDERS = ["naive", "composed", "fused_actor"]
    _CPU_TIMED: dict = {}

    @pytest.mark.parametrize("name", CPU_CONTENDERS)
    def test_cpu_actor_loss(benchmark, name):
        """The small shape, in this process: the three contenders timed together in
        interleaved rounds (`_timing` defaults: process CPU time, one thread;
        MEMOPD_BENCH_ROUNDS, default 3) by the first of these tests, each test replaying
        its own durations."""
        from _timing import bench_clock, interleaved, record_durations

        s = dict(N=1024, H=512, V=32000)
        if "rounds" not in _CPU_TIMED:
            inputs = make_inputs(**s)
            steps = {}
            for n in CPU_CONTENDERS:
                run = step_fn(n)
                run(*make_inputs(N=64, H=64, V=256, seed=1))  # first-call costs are not the loss's
                steps[n] = (lambda run=run: run(*inputs))

            def clear_grads(_):
                inputs[0].grad = inputs[1].grad = None

            _CPU_TIMED["rounds"] = interleaved(steps, int(os.environ.get("MEMOPD_BENCH_ROUNDS", "3")),
                                               clock=bench_clock(), before=clear_grads)
        timed = _CPU_TIMED["rounds"]
        benchmark.group = "actor loss cpu"
        record_durations(benchmark, timed.times[name])
        benchmark.extra_info.update({"contender": name, **s, "times_s": timed.times[name], **timed.summary()})

    GPU_SHAPES = {"qwen2.5-3b": dict(N=4096, H=2048, V=151936), "qwen2.5-7b": dict(N=4096, H=3584, V=151936)}

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
    @pytest.mark.parametrize("shape", list(GPU_SHAPES))
    @pytest.mark.parametrize("name", ["naive", "fused_actor"])
    def test_gpu_actor_loss(benchmark, name, shape):
        """bf16 at Qwen2.5 lm_head shapes: time (CUDA events), achieved TFLOP/s over the 4
        lm_head-sized matmuls, peak memory above the inputs."""
        s = GPU_SHAPES[shape]
        inputs = [x.to(device="cuda", dtype=torch.bfloat16 if x.is_floating_point() and x.dim() == 2 else None)
                  .detach().requires_grad_(x.requires_grad) for x in make_inputs(**s)]
        run = step_fn(name)
        run(*inputs)  # warm-up: Triton compilation, cuBLAS handles
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        times = []

        def one():
            inputs[0].grad = inputs[1].grad = None
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run(*inputs)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)

        benchmark.pedantic(one, rounds=3, iterations=1)
        t = sorted(times)[len(times) // 2]
        flops = 4 * 2 * s["N"] * s["H"] * s["V"]
        benchmark.extra_info.update({"contender": name, **s, "median_s": t, "tflops": flops / t / 1e12,
                                     "peak_mb_above_inputs": (torch.cuda.max_memory_allocated() - base) / 2**20})
        print(f"\n{name} {shape}: {t * 1e3:.1f} ms, {flops / t / 1e12:.0f} TFLOP/s, "
              f"peak +{(torch.cuda.max_memory_allocated() - base) / 2**20:.0f} MiB")


if __name__ == "__main__":
    sys.exit(main())
