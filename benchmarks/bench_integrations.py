"""Benchmark: memopd's drop-ins against each framework's own loss (docs/integrations.md).

Pairs (CPU, fp32, forward + backward, one torch thread):

    trl_gkd / memopd_gkd        TRL 1.16 `GKDTrainer.compute_loss` vs `MemopdGKDTrainer.compute_loss`:
                                student + teacher forward and the generalised JSD (beta 0.5) of a
                                [B, T] batch, backward into the student
    liger_jsd / memopd_liger    Liger 0.8.5 `LigerFusedLinearJSDLoss` (its chunked PyTorch path;
                                compiled=False: torch.compile is not Liger's CPU story) vs the
                                drop-in `memopd.integrations.liger.LigerFusedLinearJSDLoss`
    verl_naive / memopd_verl    verl's actor loss as dp_actor computes it (logits[:, -R-1:-1] / T,
                                log-softmax, entropy, vanilla PPO surrogate, token-mean) vs
                                `memopd.integrations.verl.policy_loss`

Each contender runs in a fresh subprocess: it builds its inputs, warms up once at the real
shape, resets the peak-RSS counter (/proc/self/clear_refs), then times one forward +
backward with the process clock (CPU seconds of the one thread) and reports the peak
resident memory added above its inputs (VmHWM minus the RSS before the call).

    python benchmarks/bench_integrations.py                 # every pair, 1 round (~1 min)
    python benchmarks/bench_integrations.py --pairs liger --rounds 3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from types import SimpleNamespace

import torch
from _fresh_process import measure_call

PAIRS = {"trl": ("trl_gkd", "memopd_gkd"), "liger": ("liger_jsd", "memopd_liger"), "verl": ("verl_naive", "memopd_verl")}
V, H = 32000, 256
B, T = 4, 256          # TRL: [B, T] batch; Liger: N = B * T tokens; verl: R = T response columns
PROMPT = 32


def _models():
    from memopd.models import tiny_causal_lm

    student = tiny_causal_lm("qwen2", vocab_size=V, hidden_size=H, num_layers=1, num_heads=4, num_kv_heads=2, seed=1)
    teacher = tiny_causal_lm("qwen2", vocab_size=V, hidden_size=H, num_layers=1, num_heads=4, num_kv_heads=2,
                             seed=2).requires_grad_(False)
    return student, teacher


def _trl_step(name):
    from trl.experimental.gkd import GKDTrainer

    from memopd.integrations.trl import MemopdGKDTrainer

    student, teacher = _models()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (B, T), generator=g)
    labels = ids.clone()
    labels[:, :PROMPT] = -100
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    # compute_loss reads only these attributes of the trainer
    host = SimpleNamespace(teacher_model=teacher, beta=0.5, memopd_vocab_size=None,
                           generalized_jsd_loss=GKDTrainer.generalized_jsd_loss,
                           accelerator=SimpleNamespace(unwrap_model=lambda m: m))
    cls = GKDTrainer if name == "trl_gkd" else MemopdGKDTrainer

    def run():
        student.zero_grad(set_to_none=True)
        cls.compute_loss(host, student, inputs).backward()
    return run


def _liger_step(name):
    g = torch.Generator().manual_seed(0)
    N = B * T
    hs = torch.randn(N, H, generator=g, requires_grad=True)
    ws = (torch.randn(V, H, generator=g) * 0.05).requires_grad_()
    ht, wt = torch.randn(N, H, generator=g), torch.randn(V, H, generator=g) * 0.05
    y = torch.randint(0, V, (N,), generator=g)
    y[::8] = -100
    if name == "liger_jsd":
        from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss

        loss = LigerFusedLinearJSDLoss(compiled=False, temperature=2.0)
    else:
        from memopd.integrations.liger import LigerFusedLinearJSDLoss

        loss = LigerFusedLinearJSDLoss(compiled=False, temperature=2.0)

    def run():
        hs.grad = ws.grad = None
        loss(hs, ws, ht, wt, y).backward()
    return run


def _verl_step(name):
    from memopd.integrations.verl import policy_loss

    g = torch.Generator().manual_seed(0)
    L = T + PROMPT
    hidden = torch.randn(B, L, H, generator=g, requires_grad=True)
    w = (torch.randn(V, H, generator=g) * 0.05).requires_grad_()
    responses = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[:, T // 2:][::2] = False
    old = torch.full((B, T), -10.0)
    adv = torch.randn(B, T, generator=g)

    def naive():
        logits = (hidden[:, -T - 1:-1] @ w.T) / 0.9
        ls = torch.log_softmax(logits, -1)
        lp = ls.gather(-1, responses[..., None])[..., 0]
        ent = torch.logsumexp(logits, -1) - (torch.softmax(logits, -1) * logits).sum(-1)   # verl's entropy_from_logits
        ratio = torch.exp(torch.clamp(lp - old, -20, 20))
        pg = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 0.8, 1.2))
        pg = torch.where(adv < 0, torch.minimum(-adv * 3.0, pg), pg)
        m = mask.float()
        return ((pg - 0.01 * ent) * m).sum() / (m.sum() + 1e-8)

    def run():
        hidden.grad = w.grad = None
        loss = naive() if name == "verl_naive" else policy_loss(
            hidden, w, responses, mask, old, adv, entropy_coeff=0.01, temperature=0.9)[0]
        loss.backward()
    return run


def measure(name):
    torch.set_num_threads(1)
    pair = next(p for p, names in PAIRS.items() if name in names)
    run = {"trl": _trl_step, "liger": _liger_step, "verl": _verl_step}[pair](name)
    run()  # warm-up at the real shape
    _, m = measure_call(run)
    return {"contender": name, "cpu_s": m["cpu_s"], "peak_mb": m["peak_kb"] / 1024}


def run_subprocess(name, timeout=600):
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    res = subprocess.run([sys.executable, os.path.abspath(__file__), "--measure", name], capture_output=True,
                         text=True, env=env, timeout=timeout)
    if res.returncode != 0:
        tail = (res.stderr or res.stdout).strip().splitlines()[-1:] or ["?"]
        return {"contender": name, "error": tail[0][:300]}
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", nargs="+", default=list(PAIRS), choices=list(PAIRS))
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (the order alternates)")
    ap.add_argument("--measure", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(args.measure)))
        return
    print(f"fp32, one thread, process CPU time, V={V}, H={H}, B={B}, T={T}; median (min-max) of {args.rounds} "
          f"interleaved round(s); load average {os.getloadavg()[0]:.1f}")
    print(f"{'pair':6s} {'contender':13s} {'cpu s':>7s} {'(min-max)':>13s} {'peak MiB':>9s}")
    for pair in args.pairs:
        results = {n: [] for n in PAIRS[pair]}
        for r in range(args.rounds):
            for name in (PAIRS[pair] if r % 2 == 0 else PAIRS[pair][::-1]):
                results[name].append(run_subprocess(name))
        for name, ms in results.items():
            ok = [m for m in ms if "error" not in m]
            if not ok:
                print(f"{pair:6s} {name:13s} error: {ms[0]['error']}")
                continue
            cpu = [m["cpu_s"] for m in ok]
            print(f"{pair:6s} {name:13s} {statistics.median(cpu):7.2f} {f'({min(cpu):.2f}-{max(cpu):.2f})':>13s} "
                  f"{statistics.median(m['peak_mb'] for m in ok):9.0f}")


if __name__ == "__main__":
    main()
