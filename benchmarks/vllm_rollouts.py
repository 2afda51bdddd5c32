"""vLLM vs HFEngine rollouts on the embedded default world: throughput and the
sampler-vs-trainer log-prob mismatch (aligned vs flatten).

Run in the vLLM venv (README "Rollouts with vLLM"), one thread each:

    OMP_NUM_THREADS=1 VLLM_CPU_OMP_THREADS_BIND=nobind python -m benchmarks.vllm_rollouts --out benchmarks/results/vllm_rollouts

A default-shape student (the default world's SFT student config) is SFT'd briefly
(--sft-steps) on the default world; both engines then play the same held-out question
sets at temperature 1 (--ks, --n sets each), after one warm-up round each (not timed).
Throughput is sampled tokens per second of process CPU time (this process plus, for vLLM,
its engine-core and worker processes, from psutil) and of wall time. The mismatch is each
engine's recorded log-probs against the student's log-probs restored by memopd's packed
forward in the aligned layout (each call's own state) and the flatten layout (the whole
history). Writes OUT.json and OUT.md.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time


def _cpu_seconds(proc) -> float:
    """CPU seconds of `proc` and every live descendant (vLLM's engine core and workers)."""
    total = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except Exception:  # noqa: BLE001 - a process that ended between listing and reading
            pass
    return total


def play(env, engine, tasks, seed):
    import psutil

    from memopd.env.rollout import rollout

    me = psutil.Process()
    c0, w0 = _cpu_seconds(me), time.perf_counter()
    trajs = rollout(env, engine, tasks, group_size=1, temperature=1.0, top_p=1.0, seed=seed)
    cpu, wall = _cpu_seconds(me) - c0, time.perf_counter() - w0
    toks = sum(len(inv.action_ids) for tr in trajs for inv in tr.invocations)
    return trajs, {"sampled_tokens": toks, "calls": sum(len(t) for t in trajs), "cpu_s": round(cpu, 2),
                   "wall_s": round(wall, 2), "tokens_per_cpu_s": round(toks / cpu, 1), "tokens_per_wall_s": round(toks / wall, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sft-steps", type=int, default=300)
    ap.add_argument("--ks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--student", help="an SFT'd student dir of the default world (default: SFT one here)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch

    torch.set_num_threads(1)
    from memopd.env.qa.evaluate import agent_engine, load_agent_env
    from memopd.env.qa.sft import SFTConfig, run_sft
    from memopd.env.vllm_engine import VLLMEngine
    from memopd.rce import sampler_audit

    t0 = time.time()
    student = args.student
    if student is None:
        out = tempfile.mkdtemp(prefix="memopd-bench-sft-")
        run_sft(out, roles=("student",), sft_configs={"student": SFTConfig(steps=args.sft_steps, ks=(1, 2, 4), calls_per_k=300)},
                jobs=1, progress=False, log=lambda *_: None)
        student = os.path.join(out, "student")
    sft_s = time.time() - t0
    model, tok, env, world = load_agent_env(student)
    cfg = model.config
    plan = [(k, world.sample_tasks(k, args.n, split="eval", seed=7)) for k in args.ks]
    warm = world.sample_tasks(1, 2, split="eval", seed=99)
    shape = {"hidden": cfg.hidden_size, "layers": cfg.num_hidden_layers, "heads": cfg.num_attention_heads,
             "kv_heads": cfg.num_key_value_heads, "vocab": len(tok), "sft_steps": args.sft_steps if args.student is None else None}
    threads = {"torch": torch.get_num_threads(), **{k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND")}}
    report = {"student": shape, "ks": args.ks, "n": args.n, "threads": threads, "sft_s": round(sft_s, 1), "engines": {}}
    vocab = min(len(tok), int(model.get_output_embeddings().weight.shape[0]))
    engines = {"hf": lambda: agent_engine(model, tok), "vllm": lambda: VLLMEngine.from_model(model, vocab_size=vocab)}
    for name, make in engines.items():
        s0 = time.time()
        engine = make()
        start_s = time.time() - s0
        play(env, engine, warm, seed=0)  # warm-up, not timed
        trajs, figures = [], {"sampled_tokens": 0, "calls": 0, "cpu_s": 0.0, "wall_s": 0.0}
        for k, tasks in plan:
            tr, f = play(env, engine, tasks, seed=k)
            trajs += tr
            for key in ("sampled_tokens", "calls", "cpu_s", "wall_s"):
                figures[key] += f[key]
        figures["tokens_per_cpu_s"] = round(figures["sampled_tokens"] / figures["cpu_s"], 1)
        figures["tokens_per_wall_s"] = round(figures["sampled_tokens"] / figures["wall_s"], 1)
        if hasattr(engine, "close"):
            engine.close()
        mism = sampler_audit(model, trajs, ("aligned", "flatten"), vocab_size=vocab,
                             max_tokens=max(8192, max(t.flattened_tokens for t in trajs)))
        report["engines"][name] = {"start_s": round(start_s, 1), **figures, "mismatch": mism}
        print(name, json.dumps(report["engines"][name]), flush=True)
    if args.student is None:
        import shutil

        shutil.rmtree(os.path.dirname(student), ignore_errors=True)
    if args.out:
        with open(args.out + ".json", "w") as f:
            json.dump(report, f, indent=2)
        lines = ["| engine | sampled tokens | CPU s (all processes) | tokens / CPU s | wall s | tokens / wall s | "
                 "aligned max / mean abs dlogp | aligned k3 KL | flatten max / mean abs dlogp | flatten k3 KL | flatten share > 1e-3 |",
                 "|---|---|---|---|---|---|---|---|---|---|---|"]
        for name, r in report["engines"].items():
            a, fl = r["mismatch"]["aligned"], r["mismatch"]["flatten"]
            lines.append(f"| {name} | {r['sampled_tokens']} | {r['cpu_s']:.1f} | {r['tokens_per_cpu_s']} | {r['wall_s']:.1f} | "
                         f"{r['tokens_per_wall_s']} | {a['max_abs_dlogp']:.2e} / {a['mean_abs_dlogp']:.2e} | {a['k3_kl']:.1e} | "
                         f"{fl['max_abs_dlogp']:.3f} / {fl['mean_abs_dlogp']:.3f} | {fl['k3_kl']:.3f} | "
                         f"{100 * fl['share_over_threshold']:.1f}% |")
        with open(args.out + ".md", "w") as f:
            f.write("\n".join(lines) + "\n")
        print("\n".join(lines))


if __name__ == "__main__":
    main()
