"""A learning curve of one `memopd sft` run, from the run itself: its resume states.

While `memopd sft` trains a role it rewrites `OUT/<role>.resume-sft.pt` about once a
minute (memopd/env/qa/sft.py). This script watches that file, keeps a copy the first time
the run passes each of `--steps`, turns every copy into a checkpoint directory like the
final one (same world, tokenizer, model spec and metadata as `memopd sft` writes) and
evaluates it as `memopd eval --model DIR --policy P --ks 2 --n 100` would, one JSON line
per snapshot and view in `--out`. It stops when the final checkpoint appears and every
snapshot is evaluated. Without `--watch`, it evaluates resume-state files given by path.

    python benchmarks/analysis/sft_curve.py --watch .memopd_cache/sft-info-gap --world info-gap \\
        --role teacher --steps 4000,8000,12000 --out runs/teacher_curve.jsonl
    python benchmarks/analysis/sft_curve.py --world info-gap --role teacher SNAPSHOT.pt ...

docs/research/replication.md ("The second teacher") reports such a curve.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import time


def snapshot_checkpoint(state_file: str, out_dir: str, world: str, role: str, seed: int = 0) -> int:
    """Write the model of an SFT resume state as a checkpoint directory `out_dir` that
    `memopd eval --model` loads; returns the state's step."""
    import torch

    from memopd.env.qa import EnvConfig
    from memopd.env.qa.sft import CHECKPOINT_VERSION, make_model, role_presets, save_checkpoint
    from memopd.env.qa.tokenizer import build_tokenizer
    from memopd.env.qa.world import World, world_preset

    wc = world_preset(world, seed=seed)
    specs, cfgs = role_presets(wc)
    tok = build_tokenizer(World.generate(wc).vocabulary_texts(), kind="word")
    model = make_model(specs[role], tok, seed=cfgs[role].seed)
    state = torch.load(state_file, map_location="cpu", weights_only=True)
    model.load_state_dict(state["model"])
    meta = {"format": "memopd.env.checkpoint", "version": CHECKPOINT_VERSION, "role": role, "world": wc.to_json(),
            "env": dataclasses.asdict(EnvConfig()), "tokenizer_kind": "word",
            "model_spec": dataclasses.asdict(specs[role]), "sft_config": cfgs[role].to_json(),
            "sft": {"snapshot_of": os.path.abspath(state_file), "step": state["step"],
                    "ema_action_token_acc": state["ema_acc"], "ema_loss": state["ema_loss"]}}
    save_checkpoint(model, tok, out_dir, meta)
    return int(state["step"])


def evaluate_snapshot(state_file: str, world: str, role: str, policies, ks, n: int, work_dir: str) -> list[dict]:
    from memopd.env.qa.evaluate import evaluate

    ckpt = os.path.join(work_dir, os.path.splitext(os.path.basename(state_file))[0])
    step = snapshot_checkpoint(state_file, ckpt, world, role)
    rows = []
    for policy in policies:
        rep = evaluate(ckpt, ks=ks, n=n, seed=0, policy=policy)
        for q, r in rep["results"].items():
            rows.append({"snapshot": os.path.basename(state_file), "step": step, "policy": policy, "set": q,
                         **{k: r[k] for k in ("em_mean", "f1_mean", "answered", "format_errors", "turns")}})
    return rows


def _read_step(path: str, scratch: str) -> tuple[int, str] | None:
    import torch

    try:
        shutil.copy(path, scratch)  # the trainer replaces the file atomically: a copy is one whole state
        return int(torch.load(scratch, map_location="cpu", weights_only=True)["step"]), scratch
    except (OSError, RuntimeError, EOFError, KeyError):
        return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("snapshots", nargs="*", help="resume-state files to evaluate (without --watch)")
    ap.add_argument("--watch", help="the `memopd sft --out` directory of a running build")
    ap.add_argument("--world", default="info-gap", help="world preset the run trains in (default info-gap)")
    ap.add_argument("--role", default="teacher")
    ap.add_argument("--steps", default="4000,8000,12000", help="with --watch: steps to keep a snapshot at")
    ap.add_argument("--policies", default="summary,full", help="memory policies to evaluate under")
    ap.add_argument("--ks", default="2")
    ap.add_argument("--n", type=int, default=100, help="held-out sets per k")
    ap.add_argument("--out", required=True, help="JSON lines, appended")
    a = ap.parse_args(argv)
    policies = [p for p in a.policies.split(",") if p]
    ks = tuple(int(k) for k in a.ks.split(","))
    work = os.path.splitext(a.out)[0] + ".snapshots"
    os.makedirs(work, exist_ok=True)

    def record(state_file: str) -> None:
        for row in evaluate_snapshot(state_file, a.world, a.role, policies, ks, a.n, work):
            with open(a.out, "a") as f:
                f.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)

    if not a.watch:
        if not a.snapshots:
            ap.error("give resume-state files, or --watch DIR")
        for s in a.snapshots:
            record(s)
        return 0
    src = os.path.join(a.watch, f"{a.role}.resume-sft.pt")
    final = os.path.join(a.watch, a.role, "config.json")
    todo = sorted(int(s) for s in a.steps.split(",") if s)
    scratch = os.path.join(work, "_current.pt")
    while todo and not os.path.exists(final):
        time.sleep(15)
        got = _read_step(src, scratch) if os.path.exists(src) else None
        if got is None or got[0] < todo[0]:
            continue
        while todo and got[0] >= todo[0]:
            todo.pop(0)
        kept = os.path.join(work, f"{a.role}-step{got[0]}.pt")
        os.replace(scratch, kept)
        record(kept)
    if todo:
        print(f"the run ended before steps {todo}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
