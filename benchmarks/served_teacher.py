"""Bytes per token and time per step of each teacher transport, through a real loopback server.

Transports: the in-process teacher (`teacher=DIR`), and `memopd serve-teacher` answering
fp32 hidden states, bf16 hidden states, and top-k log-probs (`teacher_topk=K`). For each,
the same trainer (`memopd.trainer.loop.Trainer`, the memopd arm, the default world, the
default tasks_per_step / group_size / max_tokens) runs `--steps` training steps from the
same seed, and the script reports per step: the bytes each request and answer carried
(safetensors bodies, HTTP headers not counted) per teacher-scored action token, the
trainer's process CPU time, the server's CPU time (from /proc), and the wall time. One
torch thread on both sides (OMP_NUM_THREADS=1). The models are the default world's shapes
(`memopd sft` defaults), given as directories or SFT'd here briefly (`--quick-sft`: a few
steps, so the episodes are not those of the fully trained defaults).

    python benchmarks/served_teacher.py [--student DIR --teacher DIR | --quick-sft DIR] [--steps 3] [--topk 8,32]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _server_cpu(pid: int) -> float:
    """utime + stime of a process in seconds (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


def _run(cfg, student_dir, teacher_dir, served, steps: int) -> list[dict]:
    from memopd.trainer.loop import Trainer, prepare

    bundle = prepare(cfg, log=lambda *_: None)
    trainer = Trainer(cfg, student_lm=bundle.student, teacher_lm=served if served is not None else bundle.teacher,
                      env=bundle.env, tasks=bundle.tasks, log=lambda *_: None)
    rows = []
    for step in range(steps):
        sent0, recv0 = (served.bytes_sent, served.bytes_received) if served is not None else (0, 0)
        srv0 = _server_cpu(served.server_pid) if served is not None else 0.0
        c0, w0 = time.process_time(), time.perf_counter()
        m = trainer.train_step(step)
        c1, w1 = time.process_time(), time.perf_counter()
        row = {"step": step + 1, "trainer_cpu_s": c1 - c0, "wall_s": w1 - w0, "kl_teacher": m["train/kl_teacher"],
               "action_tokens": m["rollout/action_tokens"]}
        if served is not None:
            row.update(sent=served.bytes_sent - sent0, received=served.bytes_received - recv0,
                       server_cpu_s=_server_cpu(served.server_pid) - srv0)
        rows.append(row)
    trainer.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--student")
    p.add_argument("--teacher")
    p.add_argument("--quick-sft", help="SFT the default-shape models here for a few steps (if not there yet)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--topk", default="8,32")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.quick_sft:
        from memopd.env.qa.sft import SFTConfig, run_sft

        if not os.path.isdir(os.path.join(args.quick_sft, "teacher")):
            quick = SFTConfig(steps=30, ks=(1, 2), calls_per_k=16)
            run_sft(args.quick_sft, sft_configs={"teacher": quick, "student": quick}, jobs=1, progress=False,
                    log=lambda *_: None)
        args.student, args.teacher = (os.path.join(args.quick_sft, r) for r in ("student", "teacher"))
    from memopd.teacher_client import ServedTeacher
    from memopd.trainer.config import TrainConfig

    base = dict(student=args.student, steps=args.steps, progress=False, checkpoint_every=0, seed=0, cpu_threads=1,
                run_dir="/tmp/unused")
    server = subprocess.Popen([sys.executable, "-m", "memopd.cli", "serve-teacher", args.teacher, "--port", "0",
                               "--threads", "1", "--rate", "0"], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        url = re.search(r"on (http://\S+)", server.stdout.readline()).group(1)
        transports = [("in-process", {}, None), ("served fp32 hidden", {}, "fp32"), ("served bf16 hidden", {}, "bf16")]
        transports += [(f"served top-{k}", {"teacher_topk": int(k)}, "fp32") for k in args.topk.split(",") if k]
        out = {}
        for name, extra, transport in transports:
            if transport is None:
                cfg = TrainConfig.from_dict({**base, "teacher": args.teacher})
                client = None
            else:
                cfg = TrainConfig.from_dict({**base, "teacher_url": url, "teacher_transport": transport, **extra})
                client = ServedTeacher(url, transport=transport)
                client.server_pid = server.pid
            rows = _run(cfg, args.student, args.teacher, client, args.steps)
            out[name] = rows
            tok = sum(r["action_tokens"] for r in rows)
            line = (f"{name:20s} trainer CPU {sum(r['trainer_cpu_s'] for r in rows) / len(rows):6.2f} s/step, "
                    f"wall {sum(r['wall_s'] for r in rows) / len(rows):6.2f} s/step")
            if client is not None:
                line += (f", server CPU {sum(r['server_cpu_s'] for r in rows) / len(rows):5.2f} s/step, request "
                         f"{sum(r['sent'] for r in rows) / tok:7.1f} B/token, answer {sum(r['received'] for r in rows) / tok:7.1f} "
                         f"B/token ({tok} action tokens)")
            print(line, flush=True)
    finally:
        server.terminate()
        server.wait()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
