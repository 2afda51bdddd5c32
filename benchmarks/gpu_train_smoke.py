"""The training smoke of benchmarks/gpu_check.sh: `memopd train` and `memopd audit` on the GPU.

    python3 benchmarks/gpu_train_smoke.py WORK_DIR [--device cuda] [--backend triton]

1. A tiny SFT'd student/teacher pair of the default world (on the CPU, seconds).
2. `memopd train device=cuda dtype=bf16 steps=2` (arm memopd: rollouts, reference,
   teacher and critic on the GPU) with MEMOPD_BACKEND=triton: every packed attention and
   fused lm-head op on its Triton kernel, refused rather than falling back.
3. `memopd audit --random` of a tiny Qwen2-shaped random-init model on the GPU with
   `--attention-backend triton`, in fp32 (the fp32 attention kernels, against the
   model's own attention at fp32's tolerance; the audit's sharp random init, logits of
   tens of units, exceeds its bf16 tolerance on any backend, the CPU's included).

Each prints one summary line; the full output is in WORK_DIR/{train,audit}.log. Exit 0
when both ran and the audit passed. `--device cpu --backend torch` walks the same steps on
CPU (gpu_check.sh --dry-run).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("work", help="directory for the models, the run and the logs")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--backend", default="triton", choices=["triton", "torch"])
    a = ap.parse_args(argv)
    os.makedirs(a.work, exist_ok=True)
    os.environ["MEMOPD_BACKEND"] = a.backend
    from memopd.cli import main as memopd_main
    from memopd.env.qa.sft import SFTConfig, run_sft

    t0 = time.time()
    sft = os.path.join(a.work, "sft")
    tiny = SFTConfig(steps=3, ks=(1, 2), calls_per_k=8)
    run_sft(sft, sft_configs={"teacher": tiny, "student": tiny}, jobs=1, progress=False, log=lambda *_: None)
    t_sft = time.time() - t0
    run_dir = os.path.join(a.work, "run")
    argv_train = ["train", "--overwrite", f"device={a.device}", "dtype=bf16", "steps=2", "arm=memopd",
                  f"student={sft}/student", f"teacher={sft}/teacher", f"run_dir={run_dir}", "tasks_per_step=2",
                  "group_size=2", "train_k=1", "eval_k=1", "eval_tasks=2", "ppo_epochs=1", "minibatches=2",
                  "checkpoint_every=0", "progress=false"]
    rc = 1
    with open(os.path.join(a.work, "train.log"), "w") as log, contextlib.redirect_stdout(log), \
            contextlib.redirect_stderr(log):
        rc = memopd_main(argv_train)
    if rc != 0:
        print(f"train smoke: memopd train exit {rc} (see train.log): "
              + open(os.path.join(a.work, "train.log")).read().strip().splitlines()[-1][:200])
        return 1
    rep = json.load(open(os.path.join(run_dir, "report.json")))
    last = rep["last_step"]
    print(f"train smoke: memopd train {' '.join(argv_train[2:5])} MEMOPD_BACKEND={a.backend}: "
          f"{last['step']} steps, rce/max_dlogp_vs_sampling {last['rce/max_dlogp_vs_sampling']:.1e}, "
          f"kl_teacher {last['train/kl_teacher']:.4f}, pg_loss {last['train/pg_loss']:.4f}; "
          f"{rep['wall_s']} s (+{t_sft:.1f} s tiny SFT on CPU)")
    t1 = time.time()
    audit_log = os.path.join(a.work, "audit.log")
    with open(audit_log, "w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        rc = memopd_main(["audit", "--random", "--arch", "qwen2", "--dtype", "float32", "--device", a.device,
                          "--attention-backend", a.backend, "--num-trajectories", "4"])
    lines = [ln for ln in open(audit_log).read().splitlines() if ln.strip()]
    print(f"audit smoke: memopd audit --random --dtype float32 --device {a.device} --attention-backend {a.backend}: "
          f"exit {rc}, {time.time() - t1:.1f} s: {lines[-1][:200] if lines else '(no output)'}")
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
