"""GPU benchmark cases of `benchmarks/gpu_check.sh`, one case per process: each case gives
one row of the check's table (op, shape, dtype, chosen config, first-call seconds, median
ms, TFLOP/s, peak memory, max |diff| vs a reference) as JSON.

    python benchmarks/gpu_bench.py --list
    python benchmarks/gpu_bench.py CASE [CASE ...] --json rows.jsonl
    python benchmarks/gpu_bench.py --smoke CASE ...   # tiny shapes, CPU, torch path: checks
                                                       # this script, not the kernels

Cases are the production shapes of the project at 16k tokens: packed attention (T=16384,
4 prefixes x 8 calls, D=128, bf16; Hq/Hkv 32/8 and 16/2; forward, forward+backward with
the atomic and the deterministic dQ; and 16 calls under one 2k-token prefix at 16/2, with
the dK/dV split of long readers on and off, side by side), and the fused lm-head ops at Qwen2.5-3B / 7B shapes
(N=16384, student H=2048, teacher H=3584, an lm_head of 151,936 rows, bf16: reverse-KL
distillation, JSD, the teacher-less log-prob + entropy, the PPO actor loss with a teacher
KL), each forward+backward, at the full head (V=151,936) and, for the actor loss and the
reverse-KL distillation, at the tokenizer's odd vocabulary (vocab_size=151,665, the
rows a Qwen2.5 run uses). Layouts and inputs come from bench_packed_attention.py and
bench_fused_distill.py.

Measurements: first call (compile + autotune + run, wall clock after a CUDA sync); then 3
warm-up calls and 10 timed calls (CUDA events), median; peak memory
(torch.cuda.max_memory_allocated above the inputs, over the timed calls); the reference is
the torch path on fp32 copies of the same inputs (attention: out, dq, dk, dv; lm-head ops:
the per-token outputs and the gradient of the hidden states), max |diff| over all of them.
TFLOP/s count useful work only: attention 4·pairs·D·Hq for the forward (visible pairs only)
and 3.5x that with the backward; lm-head ops the matmuls an implementation without
recomputation needs (2·N·H·V per forward lm-head matmul, at the student's or the
teacher's H, two more per backward at the student's: dH, dW), and their fraction of the
bf16 dense peak (PEAK_BF16). The summary puts next to it what benchmarks/gpu_cost_model.py
predicts for the same op and shape (`--json`; gpu_check.sh runs it beside the cases).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _attention_case(Hq, Hkv, mode, smoke, shared=False, split=None):
    """shared: 16 calls under one prefix of T/8 tokens (the layout whose prefix key blocks
    each have 16 calls' readers: the dK/dV split's case) instead of 4 prefixes x 8 calls;
    split: MEMOPD_ATTENTION_SPLIT's value for this case's process (None: the default)."""
    import torch
    from bench_packed_attention import group_layout, visible_pairs

    from memopd.ops.attention import packed_attention

    if split is not None:
        import memopd.kernels.attention_plan as plan

        plan.SPLIT_ROWS = plan._split_setting(split)
    T, D = (256, 16) if smoke else (16384, 128)
    dev, dtype, backend = ("cpu", torch.float32, "torch") if smoke else ("cuda", torch.bfloat16, "triton")
    if shared:
        meta = group_layout(T, groups=1, calls=16, prefix_len=(T // 8, T // 8), seed=1).to(dev)
    else:
        meta = group_layout(T, groups=4, calls=8, prefix_len=(T // 20, T // 13), seed=1).to(dev)
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v, do = (torch.randn(T, h, D, device=dev, dtype=dtype, generator=g) for h in (Hq, Hkv, Hkv, Hq))
    grad = mode != "fwd"

    def call(xs, be, det):
        with torch.set_grad_enabled(grad):
            leaves = [x.detach().requires_grad_(grad) for x in xs[:3]]
            out = packed_attention(*leaves, meta, backend=be, deterministic=det)
            if not grad:
                return [out]
            out.backward(xs[3])
            return [out.detach()] + [x.grad for x in leaves]

    det = mode == "fwd_bwd_det"
    flops = 4.0 * visible_pairs(meta) * D * Hq * (3.5 if grad else 1.0)
    layout = "1 prefix x 16 calls" if shared else "4 prefixes x 8 calls"
    op = f"attention {mode}" + ("" if split is None else f", dK/dV split {split}")
    return dict(op=op, shape=f"T={T} Hq/Hkv={Hq}/{Hkv} D={D}, {layout}", dtype=str(dtype).split(".")[-1],
                run=lambda: call((q, k, v, do), backend, det),
                reference=lambda: call([x.float() for x in (q, k, v, do)], "torch", False),
                flops=flops, inputs=(q, k, v, do))


PEAK_BF16 = 989e12  # H100/H200 SXM dense bf16 tensor-core peak, FLOP/s (as gpu_cost_model.py)
# the cost model's op for a benchmark op (lm-head ops it models)
# (the distillation ops run with their gradients in the forward by default)
COST_MODEL_OPS = {"actor_loss": "actor loss (teacher)",
                  "reverse_kl": "fused distill, gradients in the forward (reverse KL)",
                  "jsd": "fused distill, gradients in the forward (JSD)",
                  "logprob_entropy": "fused log-prob + entropy, gradients in the forward (no teacher)"}
QWEN_HEAD_ROWS, QWEN_VOCAB = 151936, 151665


def _lm_case(op, smoke, vocab=None):
    import torch
    from bench_fused_distill import make_inputs

    from memopd.ops import fused_linear_actor_loss, fused_linear_distill, fused_linear_logprob_entropy

    N, Hs, Ht, V = (64, 32, 24, 500) if smoke else (16384, 2048, 3584, QWEN_HEAD_ROWS)
    if smoke and vocab is not None:
        vocab = V - 11  # an odd vocabulary below the head's rows, as at the production shape
    dev, dtype, backend = ("cpu", torch.float32, "torch") if smoke else ("cuda", torch.bfloat16, "triton")
    hs, ws, ht, wt, y, mask = make_inputs(N, Hs, Ht, V, device=dev, dtype=dtype)
    if vocab is not None:
        y = y % vocab
    g = torch.Generator(device=dev).manual_seed(3)
    adv = torch.randn(N, device=dev, generator=g)
    old = -torch.rand(N, device=dev, generator=g) * 4 - 9

    def call(xs, be):
        h, w = xs[0].detach().requires_grad_(), xs[1].detach().requires_grad_()
        t_h, t_w = xs[2], xs[3]
        if op in ("reverse_kl", "jsd"):
            out = fused_linear_distill(h, w, t_h, t_w, y, mask=mask, divergence=op, backend=be, vocab_size=vocab)
            outs, loss = [out.kl, out.logprobs, out.entropy], out.loss
        elif op == "logprob_entropy":
            out = fused_linear_logprob_entropy(h, w, y, mask=mask, backend=be, vocab_size=vocab)
            outs = [out.logprobs, out.entropy]
            loss = (out.logprobs * adv).sum() + 0.01 * out.entropy.sum()
        else:
            out = fused_linear_actor_loss(h, w, y, adv, old, teacher_hidden=t_h, teacher_weight=t_w, mask=mask,
                                          teacher_kl_coef=0.1, entropy_coef=0.01, backend=be, vocab_size=vocab)
            outs, loss = [out.logprobs, out.entropy, out.kl], out.loss
        loss.backward()
        return [o.detach() for o in outs] + [h.grad]

    Vu = vocab or V  # the rows the kernels read
    # forward lm-head matmuls (student, and the teacher's where there is one), then dH and dW
    flops = 2.0 * N * Vu * (Hs + (0 if op == "logprob_entropy" else Ht) + 2 * Hs)
    shape = f"N={N} Hs/Ht={Hs}/{Ht} V={Vu}" + ("" if vocab is None else f" (head rows {V})")
    return dict(op=op, shape=shape, dtype=str(dtype).split(".")[-1],
                run=lambda: call((hs, ws, ht, wt), backend),
                reference=lambda: call([x.float() for x in (hs, ws, ht, wt)], "torch"),
                flops=flops, inputs=(hs, ws, ht, wt),
                model=dict(op=COST_MODEL_OPS.get(op), N=N, V=Vu, Hs=Hs, Ht=Ht))


# (gpu_check.sh's BENCH_LIMITS decides the order they run in and their time limits)
CASES = {
    "attn-fwd-32/8": lambda s: _attention_case(32, 8, "fwd", s),
    "attn-fwd_bwd-32/8": lambda s: _attention_case(32, 8, "fwd_bwd", s),
    "attn-fwd_bwd_det-32/8": lambda s: _attention_case(32, 8, "fwd_bwd_det", s),
    "attn-fwd_bwd-16/2": lambda s: _attention_case(16, 2, "fwd_bwd", s),
    "attn-fwd_bwd-16/2-shared": lambda s: _attention_case(16, 2, "fwd_bwd", s, shared=True, split="auto"),
    "attn-fwd_bwd-16/2-shared-nosplit": lambda s: _attention_case(16, 2, "fwd_bwd", s, shared=True, split="off"),
    "distill-reverse_kl": lambda s: _lm_case("reverse_kl", s),
    "distill-reverse_kl-V151665": lambda s: _lm_case("reverse_kl", s, vocab=QWEN_VOCAB),
    "distill-jsd": lambda s: _lm_case("jsd", s),
    "logprob_entropy": lambda s: _lm_case("logprob_entropy", s),
    "actor_loss": lambda s: _lm_case("actor_loss", s),
    "actor_loss-V151665": lambda s: _lm_case("actor_loss", s, vocab=QWEN_VOCAB),
}


def _sync():
    import torch  # here, not at the top: the summary (run after every step) needs no torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def measure(name: str, smoke: bool = False, rounds: int = 10) -> dict:
    import torch

    from memopd.kernels.runtime import chosen_configs

    case = CASES[name](smoke)
    cuda = torch.cuda.is_available() and not smoke
    _sync()
    t0 = time.perf_counter()
    got = case["run"]()
    _sync()
    first_s = time.perf_counter() - t0
    config = chosen_configs() if cuda else {}
    for _ in range(0 if smoke else 3):
        case["run"]()
    _sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    times = []
    for _ in range(rounds if not smoke else 1):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            case["run"]()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            case["run"]()
            times.append(time.perf_counter() - t)
    peak = (torch.cuda.max_memory_allocated() - base) if cuda else None
    want = case["reference"]()
    diff = max((a.double() - b.double()).abs().max().item() for a, b in zip(got, want))
    med = statistics.median(times)
    return dict(case=name, op=case["op"], shape=case["shape"], dtype=case["dtype"],
                config="; ".join(f"{k}: {v}" for k, v in sorted(config.items())) or "-",
                first_call_s=round(first_s, 3), median_ms=round(med * 1e3, 3),
                tflops=round(case["flops"] / med / 1e12, 1), peak_frac=round(case["flops"] / med / PEAK_BF16, 4),
                peak_mib=None if peak is None else round(peak / 2**20),
                max_abs_diff=diff, device=torch.cuda.get_device_name() if cuda else "cpu (smoke)",
                model=case.get("model"))


def predicted(row, predictions):
    """The cost model's prediction (a row of `gpu_cost_model.py --json`) for a benchmark
    row: same op, tokens, vocabulary and hidden sizes; None when it models no such case."""
    want = row.get("model") or {}
    for p in predictions:
        if want.get("op") and all(p.get(k) == want.get(k) for k in ("op", "N", "V", "Hs", "Ht")):
            return p
    return None


# ---------------------------------------------------------------------------------------
# the check's summary: summary.md (pasteable) and results.json, from gpu_check.sh's work dir
# ---------------------------------------------------------------------------------------
# an MLIR diagnostic ("...: error: failed to legalize ..."), a raised compiler exception
# ("triton.compiler.errors.CompilationError: at 15:12: ...", as pytest prints it too), ptxas
_COMPILE_ERROR = re.compile(r"(: error: |^(E\s+)?[\w.]*(CompilationError|PTXASError|OutOfResources)\b|"
                            r"PassManager::run failed|ptxas fatal)")


def _read_jsonl(path):
    if not os.path.exists(path):
        return []
    rows = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line.startswith("{"):
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    pass
    return rows


def compile_errors(log_dir):
    """One line per distinct Triton/MLIR/ptxas compile error in the step logs (the full
    text stays in the logs)."""
    seen = []
    for name in sorted(os.listdir(log_dir)):
        if not name.endswith(".log"):
            continue
        with open(os.path.join(log_dir, name), errors="replace") as f:
            for line in f:
                if _COMPILE_ERROR.search(line.strip()):
                    text = line.strip()
                    if "error:" in text:  # drop the path:line:col prefix of MLIR diagnostics
                        text = "error: " + text.split("error:", 1)[1].strip()
                    entry = f"{name[:-4]}: {text[:200]}"
                    if entry not in seen:
                        seen.append(entry)
    return seen


def _junit(log_dir):
    import xml.etree.ElementTree as ET

    tests = []
    for name in sorted(os.listdir(log_dir)):
        if not name.endswith(".xml"):
            continue
        try:
            root = ET.parse(os.path.join(log_dir, name)).getroot()
        except ET.ParseError:
            continue
        for tc in root.iter("testcase"):
            status, msg = "passed", ""
            for child in tc:
                if child.tag in ("failure", "error"):
                    status, msg = "failed", (child.get("message") or "").splitlines()[0][:200] if child.get(
                        "message") else child.tag
                elif child.tag == "skipped":
                    status, msg = "skipped", (child.get("message") or "")[:200]
            tests.append(dict(test=f"{tc.get('classname', '')}::{tc.get('name')}", status=status,
                              seconds=float(tc.get("time") or 0), message=msg))
    return tests


def _fmt(v, spec=""):
    if v is None:
        return "-"
    return format(v, spec) if spec else str(v)


def _prediction(p) -> str:
    """The cost model's bound (ms, of peak) and, when it gave one, its realistic band of
    the fraction of peak and the bandwidth it assumed."""
    text = f"{p['ms']:.1f}, {p['peak']:.0%}"
    if p.get("band_peak"):
        lo, hi = p["band_peak"]
        text += f"; band {lo:.0%}-{hi:.0%} at {p['hbm_tbps']:.2f} TB/s"
    return text + " |"


def summarize(work_dir: str, out_dir: str) -> str:
    """Write summary.md and results.json into out_dir; return the Markdown."""
    steps = _read_jsonl(os.path.join(work_dir, "steps.jsonl"))
    rows = _read_jsonl(os.path.join(work_dir, "bench_rows.jsonl"))
    env = _read_jsonl(os.path.join(work_dir, "env.jsonl"))
    tests = _junit(work_dir)
    errors = compile_errors(work_dir)
    predictions = _read_jsonl(os.path.join(work_dir, "predictions.jsonl"))
    lines = ["# memopd gpu_check", ""]
    if env:
        e = env[-1]
        lines += [", ".join(f"{k} {v}" for k, v in e.items()), ""]
    lines += ["| step | status | seconds | limit s | note |", "|---|---|---|---|---|"]
    for st in steps:
        lines.append(f"| {st['step']} | {st['status']} | {st.get('seconds', '-')} | {st.get('limit', '-')} | "
                     f"{st.get('note', '')} |")
    if tests:
        counts = {k: sum(t["status"] == k for t in tests) for k in ("passed", "failed", "skipped")}
        lines += ["", f"Compiled correctness: {counts['passed']} passed, {counts['failed']} failed, "
                  f"{counts['skipped']} skipped ({sum(t['seconds'] for t in tests):.0f} s of test time)"]
        lines += [f"- FAILED {t['test']}: {t['message']}" for t in tests if t["status"] == "failed"]
    if errors:
        lines += ["", f"Compile errors ({len(errors)}, full text in logs.tar.gz):"]
        lines += [f"- {e}" for e in errors[:30]]
    lines += ["", "| op | shape | dtype | chosen config | first call s | ms | TFLOP/s | peak MiB | max abs diff | "
              "of bf16 peak | cost model: bound ms, of peak; band |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p = predicted(r, predictions)
        lines.append(f"| {r['op']} | {r['shape']} | {r['dtype']} | {r['config']} | {_fmt(r['first_call_s'])} | "
                     f"{_fmt(r['median_ms'])} | {_fmt(r['tflops'])} | {_fmt(r['peak_mib'])} | "
                     f"{_fmt(r['max_abs_diff'], '.3g')} | {_fmt(r.get('peak_frac'), '.1%')} | "
                     + ("- |" if p is None else _prediction(p)))
    if not rows:
        lines.append("| (no benchmark rows) | | | | | | | | | | |")
    text = "\n".join(lines) + "\n"
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "summary.md"), "w") as f:
        f.write(text)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(dict(env=env[-1] if env else {}, steps=steps, tests=tests, compile_errors=errors,
                       benchmarks=rows, predictions=predictions), f, indent=1)
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cases", nargs="*")
    ap.add_argument("--list", action="store_true", help="print the case names")
    ap.add_argument("--json", help="append one JSON row per case to this file")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU with the torch path")
    ap.add_argument("--summary", nargs=2, metavar=("WORK_DIR", "OUT_DIR"),
                    help="write summary.md and results.json from gpu_check.sh's work dir, print the Markdown")
    a = ap.parse_args(argv)
    if a.summary:
        print(summarize(*a.summary), end="")
        return 0
    if a.list:
        print("\n".join(CASES))
        return 0
    unknown = [c for c in a.cases if c not in CASES]
    if unknown or not a.cases:
        print(f"gpu_bench: unknown or no case(s) {unknown}; known: {', '.join(CASES)}", file=sys.stderr)
        return 2
    import torch

    if not a.smoke and not torch.cuda.is_available():
        print("gpu_bench: no CUDA device (use --smoke to check the script on CPU)", file=sys.stderr)
        return 3
    for name in a.cases:
        row = measure(name, smoke=a.smoke)
        print(json.dumps(row), flush=True)
        if a.json:
            with open(a.json, "a") as f:
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
