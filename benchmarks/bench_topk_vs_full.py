"""Full-vocabulary reverse KL against the top-k reverse KL of a served teacher: how far the
top-k loss and its gradient are from the full one, what each transport costs in bytes per
token, and the CPU time of a step of each (loss forward + backward, and the safetensors
serialisation + deserialisation of what the teacher sends).

    python benchmarks/bench_topk_vs_full.py                     # N=4096, V=151936, Hs/Ht 1024/1536
    python benchmarks/bench_topk_vs_full.py --n 256 --rounds 1  # a quick run
    pytest benchmarks/bench_topk_vs_full.py --benchmark-only    # a small case under pytest-benchmark

The heads (`build_heads`): random weights give near-uniform next-token distributions (12
nats over 151,936 ids), which would make any top-k look hopeless. Here the lm_heads hold a
Zipf unigram prior in one hidden feature (token of frequency rank r: logit -a·log r, the
same ranks for both models) and random unit embeddings in the others; a token's hidden
state is 1 on the prior feature plus a weighted sum of the embeddings of a few candidate
next tokens (1 to 16, drawn from the prior), so each row has a handful of boosted
candidates over a Zipf tail, with the Gaussian jitter that the other embeddings' inner
products add. The boost height varies per row, from confident rows to broad ones. The
student is close but not equal, as on-policy distillation sees it: the same candidates
with perturbed boosts (one dropped now and then, one extra now and then), a slightly
steeper prior with per-token noise, and its own embeddings in its own width. The entropies
and the KL are measured and reported, not assumed.

Quality (float64, from full logits, per block of rows): the per-token reverse KL
KL(p_s || p_t) and its gradient w.r.t. the student's logits, and for each k the top-k
reverse KL of `memopd.ops.fused_linear_topk_reverse_kl` (the teacher's top-k ids, both
sides' full-vocabulary log-probs, the tail dropped) and its gradient. Reported: the
relative error of the mean loss, the median per-token |relative error|, the cosine of the
gradients aggregated over all tokens (= the cosine of the mean loss's gradient w.r.t. the
[N, V] logits) and the per-token cosine (mean, 10th percentile), the teacher mass the
top-k holds, and, for reference, the cosine of verl's forward top-k KL gradient. The
full-vocabulary loss computed from teacher hidden states sent in bf16 is compared the
same way.

Time: process CPU time, one torch thread, interleaved rounds (`_timing.interleaved`):
each contender's loss forward + backward (gradients to the student's hidden states and
lm_head) on its received tensors, and separately the safetensors save + load round trip
of its payload. Writes `<out>.json` and `<out>.md` (default benchmarks/results/topk_vs_full).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (HERE, ROOT):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402
from _timing import apply_threads, bench_clock, interleaved, load_average  # noqa: E402
from safetensors.torch import load as st_load  # noqa: E402
from safetensors.torch import save as st_save  # noqa: E402

from memopd.ops import fused_linear_reverse_kl, fused_linear_topk_reverse_kl  # noqa: E402

DEFAULT_KS = (8, 32, 128, 512)
ZIPF_A = 1.0  # the teacher's unigram prior exponent
HEIGHT = (3.0, 12.0)  # the range of a row's top boost over the prior: broad .. confident


# ----------------------------------------------------------------------------------
# heads with LLM-like next-token distributions
# ----------------------------------------------------------------------------------
def build_heads(N: int, V: int, Hs: int, Ht: int, seed: int = 0, zipf_a: float = ZIPF_A,
                heights: tuple = HEIGHT) -> dict:
    """Student and teacher (hidden [N, H], lm_head [V, H]) in fp32; see the module docstring."""
    g = torch.Generator().manual_seed(seed)
    rank = (torch.randperm(V, generator=g) + 1).double()
    prior_t = -zipf_a * rank.log()
    prior_s = -(zipf_a * 1.05) * rank.log() + 0.3 * torch.randn(V, generator=g, dtype=torch.float64)
    et = torch.randn(V, Ht - 1, generator=g) / math.sqrt(Ht - 1)
    es = torch.randn(V, Hs - 1, generator=g) / math.sqrt(Hs - 1)
    wt = torch.cat([prior_t.float()[:, None], et], 1)
    ws = torch.cat([prior_s.float()[:, None], es], 1)
    # candidates: 1..16 per row, drawn from the unigram prior (frequent tokens more often)
    M = 16
    n_cand = torch.randint(1, M + 1, (N,), generator=g)
    cand = torch.multinomial((prior_t - prior_t.max()).exp().float(), N * M, replacement=True, generator=g).view(N, M)
    live = torch.arange(M)[None, :] < n_cand[:, None]
    height = heights[0] + (heights[1] - heights[0]) * torch.rand(N, 1, generator=g)  # the row's top boost
    drop = torch.sort(torch.empty(N, M).exponential_(generator=g) * 2.0, dim=1).values
    boost_t = torch.where(live, height - drop, 0.0)
    # the student: perturbed boosts, a candidate lost (10%) or an extra one (10%) per row
    boost_s = torch.where(live, boost_t + 0.7 * torch.randn(N, M, generator=g), 0.0)
    lose = torch.rand(N, generator=g) < 0.1
    boost_s[lose, 0] -= 4.0
    extra = (torch.rand(N, generator=g) < 0.1) & (n_cand < M)
    rows = extra.nonzero().squeeze(1)
    boost_s[rows, n_cand[rows]] = height[rows, 0] - 3.0
    ht = torch.cat([torch.ones(N, 1), torch.einsum("nm,nmh->nh", boost_t, et[cand])], 1)
    hs = torch.cat([torch.ones(N, 1), torch.einsum("nm,nmh->nh", boost_s, es[cand])], 1)
    return dict(hs=hs.contiguous(), ws=ws.contiguous(), ht=ht.contiguous(), wt=wt.contiguous())


def _quantiles(x: torch.Tensor) -> dict:
    q = torch.quantile(x.double(), torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)).tolist()
    return {"mean": round(float(x.mean()), 4), "p10": round(q[0], 4), "median": round(q[1], 4), "p90": round(q[2], 4)}


# ----------------------------------------------------------------------------------
# quality: float64 from full logits, block of rows by block
# ----------------------------------------------------------------------------------
def _cosines(dot: torch.Tensor, na: torch.Tensor, nb: torch.Tensor) -> torch.Tensor:
    return dot / (na * nb).clamp_min(1e-300).sqrt()


def measure_quality(heads: dict, ks, block: int = 64, keep_logits: bool = True) -> dict:
    """The float64 quality figures (module docstring) and, as by-products of the same
    teacher logits, the teacher's payloads: top-max(ks) ids (int32) and log-probs (fp32,
    rounded from float64) and, with `keep_logits`, the bf16 logits.

    The gradients are never formed over [N, V] per k: with d = log p - log q, the full
    gradient is g = p (d - KL); the top-k one is a·1_S - A p (a = p (d + 1) on S, A = Σ_S a)
    and verl's forward top-k one Q p - q·1_S (Q = Σ_S q), so their dot products with g and
    their norms need Σ p g, Σ p² over the vocabulary (once per row) and sums over S."""
    hs, ws, ht, wt = heads["hs"], heads["ws"], heads["ht"], heads["wt"]
    N, V = hs.shape[0], ws.shape[0]
    ks = sorted(ks)
    kmax = ks[-1]
    ids_out = torch.empty(N, kmax, dtype=torch.int32)
    lps_out = torch.empty(N, kmax, dtype=torch.float32)
    logits_out = torch.empty(N, V, dtype=torch.bfloat16) if keep_logits else None
    cols = dict(ent_s=[], ent_t=[], kl=[], kl16=[], dot16=[], nn16=[], nnf=[])
    per_k = {k: {c: [] for c in ("kl", "dot", "nn", "vdot", "vnn", "mass_t", "mass_s")} for k in ks}
    for r0 in range(0, N, block):
        r1 = min(N, r0 + block)
        lp = torch.log_softmax((hs[r0:r1] @ ws.t()).double(), dim=1)
        t32 = ht[r0:r1] @ wt.t()
        if logits_out is not None:
            logits_out[r0:r1] = t32.bfloat16()
        lq = torch.log_softmax(t32.double(), dim=1)
        del t32
        p = lp.exp()
        cols["ent_s"].append(-(p * lp).sum(1))
        cols["ent_t"].append(-(lq.exp() * lq).sum(1))
        d = lp - lq
        kl = (p * d).sum(1)
        cols["kl"].append(kl)
        gf = p * (d - kl[:, None])  # d KL(p || q) / d s, full vocabulary
        nnf = (gf * gf).sum(1)
        pgf = (p * gf).sum(1)
        pp = (p * p).sum(1)
        cols["nnf"].append(nnf)
        # the full-vocabulary loss from teacher hidden states sent in bf16
        lq16 = torch.log_softmax((ht[r0:r1].bfloat16().float() @ wt.t()).double(), dim=1)
        kl16 = (p * (lp - lq16)).sum(1)
        g16 = p * (lp - lq16 - kl16[:, None])
        cols["kl16"].append(kl16)
        cols["dot16"].append((g16 * gf).sum(1))
        cols["nn16"].append((g16 * g16).sum(1))
        del lq16, g16
        lqk, idx = lq.topk(kmax, dim=1)  # the teacher server's top-k, sorted
        ids_out[r0:r1], lps_out[r0:r1] = idx.to(torch.int32), lqk.float()
        del lq, d
        for k in ks:
            S, lqS = idx[:, :k], lqk[:, :k]
            lpS, pS, gS = lp.gather(1, S), p.gather(1, S), gf.gather(1, S)
            tail_pp = pp - (pS * pS).sum(1)  # Σ p² and Σ p·g over the ids outside S
            tail_pg = pgf - (pS * gS).sum(1)
            a = pS * (lpS - lqS + 1.0)
            A = a.sum(1, keepdim=True)
            on_s = a - A * pS  # the top-k gradient on S; outside S it is -A p
            acc = per_k[k]
            acc["kl"].append((pS * (lpS - lqS)).sum(1))
            acc["dot"].append((on_s * gS).sum(1) - A[:, 0] * tail_pg)
            acc["nn"].append((on_s * on_s).sum(1) + A[:, 0] ** 2 * tail_pp)
            qS = lqS.exp()
            Q = qS.sum(1, keepdim=True)
            v_s = Q * pS - qS  # verl's forward top-k gradient on S; outside S it is Q p
            acc["vdot"].append((v_s * gS).sum(1) + Q[:, 0] * tail_pg)
            acc["vnn"].append((v_s * v_s).sum(1) + Q[:, 0] ** 2 * tail_pp)
            acc["mass_t"].append(Q[:, 0])
            acc["mass_s"].append(pS.sum(1))
        del lp, p, gf
    c = {name: torch.cat(v) for name, v in cols.items()}
    kl_full, nnf = c["kl"], c["nnf"]
    out = {
        "entropy_student_nats": _quantiles(c["ent_s"]),
        "entropy_teacher_nats": _quantiles(c["ent_t"]),
        "kl_full_nats": _quantiles(kl_full),
        "kl_full_mean": float(kl_full.mean()),
        "bf16_hidden": {"kl_mean": float(c["kl16"].mean()),
                        "kl_rel_error": float((c["kl16"].mean() - kl_full.mean()) / kl_full.mean()),
                        "grad_cos_aggregated": float(c["dot16"].sum() / (c["nn16"].sum() * nnf.sum()).sqrt()),
                        "grad_cos_per_token": _quantiles(_cosines(c["dot16"], c["nn16"], nnf))},
        "per_k": {},
    }
    for k in ks:
        acc = {name: torch.cat(v) for name, v in per_k[k].items()}
        klk = acc["kl"]
        rel = (klk - kl_full).abs() / kl_full.abs().clamp_min(1e-12)
        out["per_k"][k] = {
            "kl_mean": float(klk.mean()),
            "kl_rel_error": float((klk.mean() - kl_full.mean()) / kl_full.mean()),
            "kl_token_abs_rel_error": _quantiles(rel),
            "grad_cos_aggregated": float(acc["dot"].sum() / (acc["nn"].sum() * nnf.sum()).sqrt()),
            "grad_cos_per_token": _quantiles(_cosines(acc["dot"], acc["nn"], nnf)),
            "teacher_mass_in_topk": _quantiles(acc["mass_t"]),
            "student_mass_in_topk": _quantiles(acc["mass_s"]),
            "verl_forward_topk_grad_cos_aggregated": float(acc["vdot"].sum() / (acc["vnn"].sum() * nnf.sum()).sqrt()),
        }
    payloads = {"hidden_fp32": {"teacher_hidden": ht.clone()}, "hidden_bf16": {"teacher_hidden": ht.bfloat16()}}
    for k in ks:
        payloads[f"top{k}"] = {"topk_ids": ids_out[:, :k].contiguous(), "topk_logprobs": lps_out[:, :k].contiguous()}
    return out, payloads, (None if logits_out is None else {"teacher_logits": logits_out})


# ----------------------------------------------------------------------------------
# transports: what the teacher sends, its bytes, its serialisation round trip
# ----------------------------------------------------------------------------------
def roundtrip(payload: dict) -> dict:
    return st_load(st_save(payload))


def nominal_bytes(name: str, V: int, Ht: int) -> dict:
    if name == "hidden_fp32":
        return {"formula": "Ht x 4", "bytes": Ht * 4}
    if name == "hidden_bf16":
        return {"formula": "Ht x 2", "bytes": Ht * 2}
    if name == "logits_bf16":
        return {"formula": "V x 2", "bytes": V * 2}
    k = int(name[3:])
    return {"formula": f"{k} x (4 id + 4 logprob)", "bytes": k * 8, "bytes_int64_ids": k * 12}


# ----------------------------------------------------------------------------------
# the timed steps
# ----------------------------------------------------------------------------------
def loss_step(name: str, heads: dict, received: dict, leaves) -> float:
    hs, ws = leaves
    if name.startswith("hidden"):
        ht = received["teacher_hidden"].float()
        loss = fused_linear_reverse_kl(hs, ws, ht, heads["wt"], torch.zeros(hs.shape[0], dtype=torch.long)).loss
    else:
        loss = fused_linear_topk_reverse_kl(hs, ws, received["topk_ids"].long(), received["topk_logprobs"])
    loss.backward()
    return float(loss.detach())


def run(args) -> dict:
    threads = apply_threads()
    clock = bench_clock(cuda=False)
    ks = [int(k) for k in args.ks.split(",")]
    started = datetime.datetime.now(datetime.timezone.utc)
    t0 = time.process_time()
    heights = tuple(float(x) for x in args.heights.split(","))
    heads = build_heads(args.n, args.v, args.hs, args.ht, seed=args.seed, zipf_a=args.zipf, heights=heights)
    print(f"heads built: N={args.n} V={args.v} Hs={args.hs} Ht={args.ht}", flush=True)
    quality, payloads, logits = measure_quality(heads, ks, keep_logits=not args.skip_logits)
    print(f"quality measured ({time.process_time() - t0:.0f} s CPU so far)", flush=True)
    names = list(payloads)
    N = args.n
    bytes_per_token = {}
    for name, pl in payloads.items():
        bytes_per_token[name] = dict(nominal_bytes(name, args.v, args.ht), safetensors=len(st_save(pl)) / N)
    bytes_per_token["logits_bf16"] = dict(nominal_bytes("logits_bf16", args.v, args.ht))
    received = {name: roundtrip(pl) for name, pl in payloads.items()}
    leaves = (heads["hs"].clone().requires_grad_(), heads["ws"].clone().requires_grad_())
    values = {}

    def zero(_name):
        for x in leaves:
            x.grad = None

    def step(name):
        return lambda: values.__setitem__(name, loss_step(name, heads, received[name], leaves))

    # warm-up: one small call of each op (first-use costs), then the interleaved rounds
    small = {k: v[:8] for k, v in heads.items() if k in ("hs", "ht")}
    w_leaves = (small["hs"].clone().requires_grad_(), heads["ws"][:4096].clone().requires_grad_())
    w_heads = dict(heads, wt=heads["wt"][:4096])
    loss_step("hidden_fp32", w_heads, {"teacher_hidden": small["ht"]}, w_leaves)
    loss_step("top8", w_heads, {"topk_ids": torch.arange(8).repeat(8, 1), "topk_logprobs": torch.full((8, 8), -3.0)},
              w_leaves)
    # the bf16 transport runs the fp32 step's op after a [N, Ht] cast: timed only when asked
    timed = [n for n in names if n != "hidden_bf16" or args.time_bf16_loss]
    loss_rounds = interleaved({n: step(n) for n in timed}, args.rounds, clock=clock, before=zero)
    print(f"loss steps timed ({time.process_time() - t0:.0f} s CPU so far)", flush=True)
    serde_steps = {n: (lambda pl=pl: roundtrip(pl)) for n, pl in payloads.items()}
    if logits is not None:
        bytes_per_token["logits_bf16"]["safetensors"] = len(st_save(logits)) / N
        serde_steps["logits_bf16"] = lambda: roundtrip(logits)
    serde_rounds = interleaved(serde_steps, max(args.rounds, 3), clock=clock)
    ref_full = quality["kl_full_mean"]
    op_check = {n: {"op_loss": values[n],
                    "float64_loss": (ref_full if n == "hidden_fp32" else quality["bf16_hidden"]["kl_mean"]
                                     if n == "hidden_bf16" else quality["per_k"][int(n[3:])]["kl_mean"])}
                for n in timed}
    for v in op_check.values():
        v["abs_diff"] = abs(v["op_loss"] - v["float64_loss"])
    med = lambda xs: statistics.median(xs)  # noqa: E731
    finished = datetime.datetime.now(datetime.timezone.utc)
    return {
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "date_utc": started.strftime("%Y-%m-%d %H:%M"),
        "wall_s": round((finished - started).total_seconds(), 1),
        "cpu_s": round(time.process_time() - t0, 1),
        "clock": clock, "torch_threads": threads, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "load_average_start_end": [loss_rounds.loads[0] if loss_rounds.loads else None, load_average()],
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs, torch {torch.__version__}",
        "shapes": {"N": N, "V": args.v, "Hs": args.hs, "Ht": args.ht, "ks": ks, "seed": args.seed,
                   "zipf_a": args.zipf, "heights": list(heights)},
        "construction": build_heads.__doc__.strip() + " (benchmarks/bench_topk_vs_full.py module docstring)",
        "quality": quality,
        "bytes_per_token": bytes_per_token,
        "loss_step_s": {n: {"median": med(t), "times": [round(x, 3) for x in t]} for n, t in loss_rounds.times.items()},
        "serde_s": {n: {"median": med(t), "times": [round(x, 4) for x in t]} for n, t in serde_rounds.times.items()},
        "loss_rounds": loss_rounds.summary(),
        "serde_rounds": serde_rounds.summary(),
        "op_vs_float64": op_check,
    }


def markdown(res: dict) -> str:
    q, b, ls, sd = res["quality"], res["bytes_per_token"], res["loss_step_s"], res["serde_s"]
    sh = res["shapes"]
    lines = [
        "# Top-k vs full-vocabulary reverse KL",
        "",
        f"`{res['command']}`, {res['date_utc']} UTC, {res['machine']}; clock: {res['clock']} (process CPU time), "
        f"{res['torch_threads']} torch thread(s), load average {res['load_average_start_end'][0]} at the start, "
        f"{res['load_average_start_end'][1]} at the end; {res['wall_s']} s wall, {res['cpu_s']} s CPU.",
        "",
        f"N={sh['N']} tokens, V={sh['V']}, student H={sh['Hs']}, teacher H={sh['Ht']}, seed {sh['seed']}. "
        f"Entropy (nats) teacher: mean {q['entropy_teacher_nats']['mean']}, p10/median/p90 "
        f"{q['entropy_teacher_nats']['p10']}/{q['entropy_teacher_nats']['median']}/{q['entropy_teacher_nats']['p90']}; "
        f"student: mean {q['entropy_student_nats']['mean']}, p10/median/p90 "
        f"{q['entropy_student_nats']['p10']}/{q['entropy_student_nats']['median']}/{q['entropy_student_nats']['p90']}. "
        f"Full reverse KL(p_s||p_t): mean {q['kl_full_nats']['mean']} nats, median {q['kl_full_nats']['median']}, "
        f"p90 {q['kl_full_nats']['p90']}.",
        "",
        "| transport | KL rel. error (mean loss) | median per-token abs rel. error | grad cosine, aggregated | "
        "grad cosine per token: mean / p10 | teacher mass in top-k (median) | bytes/token (nominal; safetensors) | "
        "loss fwd+bwd s/step | serde s/step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in ("hidden_fp32", "hidden_bf16"):
        if name == "hidden_fp32":
            qual = "0 (exact) | 0 | 1 | 1 / 1 | 1"
        else:
            h = q["bf16_hidden"]
            qual = (f"{h['kl_rel_error']:+.2e} | - | {h['grad_cos_aggregated']:.6f} | "
                    f"{h['grad_cos_per_token']['mean']:.6f} / {h['grad_cos_per_token']['p10']:.6f} | 1")
        step = (f"{ls[name]['median']:.2f}" if name in ls
                else f"{ls['hidden_fp32']['median']:.2f} (the fp32 step's op after a cast; not timed apart)")
        lines.append(f"| teacher hidden {name[7:]} (full vocabulary) | {qual} | {b[name]['bytes']:,} "
                     f"({b[name]['formula']}); {b[name]['safetensors']:,.0f} | {step} | {sd[name]['median']:.4f} |")
    for k, pk in q["per_k"].items():
        name = f"top{k}"
        lines.append(
            f"| top-{k} log-probs | {pk['kl_rel_error']:+.3f} | {pk['kl_token_abs_rel_error']['median']:.3f} | "
            f"{pk['grad_cos_aggregated']:.4f} | {pk['grad_cos_per_token']['mean']:.4f} / "
            f"{pk['grad_cos_per_token']['p10']:.4f} | {pk['teacher_mass_in_topk']['median']:.4f} | "
            f"{b[name]['bytes']:,} ({b[name]['formula']}); {b[name]['safetensors']:,.0f} | {ls[name]['median']:.2f} | "
            f"{sd[name]['median']:.4f} |")
    lg = b["logits_bf16"]
    lines.append(f"| full logits bf16 | exact up to bf16 | - | - | - | 1 | {lg['bytes']:,} ({lg['formula']}); "
                 f"{lg.get('safetensors', float('nan')):,.0f} | not timed | "
                 f"{sd['logits_bf16']['median'] if 'logits_bf16' in sd else float('nan'):.4f} |")
    lines += [
        "",
        "KL rel. error: (mean top-k loss - mean full loss) / mean full loss over the N tokens. Gradient cosine: "
        "w.r.t. the student's logits, aggregated = over the whole [N, V] gradient of the mean loss, per token = "
        "one cosine per row. The loss step is `fused_linear_reverse_kl` (student + teacher hidden states and "
        "lm_heads) or `fused_linear_topk_reverse_kl` forward + backward to the student's hidden states and lm_head; "
        "serde is a safetensors save + load of the payload for all N tokens (ids int32, log-probs fp32).",
        "",
        "verl's own top-k loss (`forward_kl_topk`, forward KL on the same support) for reference, cosine of its "
        "gradient with the full reverse KL's: "
        + ", ".join(f"k={k}: {pk['verl_forward_topk_grad_cos_aggregated']:.4f}" for k, pk in q["per_k"].items()) + ".",
        "",
        "The ops against the float64 quality pass (same inputs): "
        + ", ".join(f"{n} |diff| {v['abs_diff']:.2e}" for n, v in res["op_vs_float64"].items()) + ".",
    ]
    if res["loss_rounds"]["unreliable_rounds"]:
        lines += ["", "Rounds flagged by load: " + "; ".join(res["loss_rounds"]["unreliable_rounds"])]
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=4096, help="tokens (default 4096)")
    ap.add_argument("--v", type=int, default=151936, help="vocabulary (default 151936)")
    ap.add_argument("--hs", type=int, default=1024, help="student hidden size")
    ap.add_argument("--ht", type=int, default=1536, help="teacher hidden size")
    ap.add_argument("--ks", default=",".join(map(str, DEFAULT_KS)))
    ap.add_argument("--rounds", type=int, default=2, help="interleaved timing rounds of the loss steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--zipf", type=float, default=ZIPF_A, help="the unigram prior's exponent a (logit -a log rank)")
    ap.add_argument("--heights", default=",".join(map(str, HEIGHT)),
                    help="lo,hi: the range of a row's top candidate boost over the prior (lower: broader rows)")
    ap.add_argument("--time-bf16-loss", action="store_true",
                    help="also time the loss step of the bf16 hidden transport (the fp32 step's op after a cast)")
    ap.add_argument("--skip-logits", action="store_true", help="do not build and time the full-logits payload")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "topk_vs_full"),
                    help="output path without extension (.json and .md are written)")
    return ap.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    res = run(args)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(res, f, indent=1)
    md = markdown(res)
    with open(args.out + ".md", "w") as f:
        f.write(md)
    print(md)
    return res


# pytest-benchmark entry: a small case (written as topk_vs_full_small.*), each loss step's
# interleaved durations replayed into pytest-benchmark's table
SMALL_ARGV = ["--n", "128", "--v", "8192", "--hs", "128", "--ht", "192", "--rounds", "3", "--skip-logits"]
_SMALL: dict = {}


def _small_result() -> dict:
    if not _SMALL:
        out_dir = os.environ.get("MEMOPD_BENCH_RESULTS_DIR", os.path.join(HERE, "results"))
        _SMALL["res"] = main(SMALL_ARGV + ["--out", os.path.join(out_dir, "topk_vs_full_small")])
    return _SMALL["res"]


def _transports():
    return ["hidden_fp32", *(f"top{k}" for k in DEFAULT_KS)]  # the bf16 step is the fp32 one after a cast


try:
    import pytest as _pytest
except ImportError:  # a script run without pytest installed
    _pytest = None

if _pytest is not None:
    @_pytest.mark.parametrize("transport", _transports())
    def test_topk_vs_full_small(benchmark, transport):
        from _timing import record_durations

        res = _small_result()
        benchmark.group = "topk_vs_full small"
        times = res["loss_step_s"][transport]["times"]
        record_durations(benchmark, times)
        k = None if transport.startswith("hidden") else int(transport[3:])
        benchmark.extra_info.update(transport=transport, times_s=times,
                                    bytes_per_token=res["bytes_per_token"][transport],
                                    quality=res["quality"]["per_k"][k] if k else None)
        assert all(t > 0 for t in times)


if __name__ == "__main__":
    main()
