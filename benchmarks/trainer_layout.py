"""The trainer's update step under its two packing layouts (`pack_layout=aligned` and
`trie`) on the default run's own rollouts: tokens per packed batch and the process CPU
time of one step's scoring (`trainer.update.score`) and update (`trainer.update.update`).

    OMP_NUM_THREADS=1 python benchmarks/trainer_layout.py --cache DIR/.memopd_cache

The embedded default config (`TrainConfig()`, memopd arm, its SFT'd models from `--cache`,
built there if missing) samples `--steps` rollout batches once; then, in `--rounds`
rounds alternating which layout goes first, each layout scores and updates every batch
from the same saved weights and optimiser state. The statistics both layouts log for the
same batch are compared (max |difference|): they agree to rounding when the trie batch
trains the same loss. One torch thread, `time.process_time`; the load average is printed.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # this checkout's memopd, not an installed one
    sys.path.insert(0, ROOT)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", default=".memopd_cache", help="cache_dir holding (or receiving) the SFT'd models")
    ap.add_argument("--steps", type=int, default=3, help="rollout batches (steps 0..N-1 of the default run)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default="", help="write the figures here too")
    ap.add_argument("--student", help="an SFT'd student directory to use instead of the cache's default one")
    ap.add_argument("--teacher", help="an SFT'd teacher directory to use instead of the cache's default one")
    args = ap.parse_args(argv)

    import torch

    from memopd.trainer.config import TrainConfig
    from memopd.trainer.loop import Trainer, prepare, set_seed
    from memopd.trainer.update import UpdateSettings, pack_layout, score, update

    torch.set_num_threads(1)
    quiet = lambda *_: None  # noqa: E731
    models = [f"{role}={path}" for role, path in (("student", args.student), ("teacher", args.teacher)) if path]
    cfg = TrainConfig.load(None, [f"cache_dir={args.cache}", f"run_dir={tempfile.mkdtemp()}", "progress=false", *models])
    set_seed(cfg.seed)
    bundle = prepare(cfg, quiet)
    tr = Trainer(cfg, student_lm=bundle.student, teacher_lm=bundle.teacher, env=bundle.env, tasks=bundle.tasks, log=quiet)
    actor, critic = tr.inference_modules()
    batches = [tr.rollout(s, actor)[0] for s in range(args.steps)]
    saved = copy.deepcopy((tr.actor.module.state_dict(), tr.critic.module.state_dict(),
                           tr.actor.state_dict(), tr.critic.state_dict()))

    def restore():
        a, c, ao, co = copy.deepcopy(saved)
        tr.actor.module.load_state_dict(a)
        tr.critic.module.load_state_dict(c)
        tr.actor.load_state_dict(ao)
        tr.critic.load_state_dict(co)

    layouts = ("aligned", "trie")
    times = {L: {"score": [], "update": []} for L in layouts}
    stats = {L: {} for L in layouts}
    for r in range(args.rounds):
        for L in (layouts if r % 2 == 0 else layouts[::-1]):
            c = dataclasses.replace(cfg, pack_layout=L)
            t_score = t_update = 0.0
            for s, trajs in enumerate(batches):
                restore()
                tr.actor.module.eval()
                tr.critic.module.eval()
                t0 = time.process_time()
                sc = score(tr.actor.module, tr.critic.module, tr.ref_lm, tr.teacher_lm, trajs,
                           teacher_layout=c.teacher_layout, max_tokens=c.max_tokens, ppo=c.ppo,
                           action_domain=c.action_domain, layout=L)
                t1 = time.process_time()
                tr.actor.module.train()
                tr.critic.module.train()
                st = update(tr.actor, tr.critic, trajs, sc, UpdateSettings.from_config(c), teacher_head=tr.teacher_head,
                            generator=torch.Generator().manual_seed(s))
                t_score += t1 - t0
                t_update += time.process_time() - t1
                stats[L][s] = st
            times[L]["score"].append(t_score)
            times[L]["update"].append(t_update)
    tokens = {L: [pack_layout(t, cfg.max_tokens, cfg.action_domain, L).num_tokens for t in batches] for L in layouts}
    actions = [pack_layout(t, cfg.max_tokens, cfg.action_domain).num_actions for t in batches]
    diff = {k: max(abs(stats["aligned"][s][k] - stats["trie"][s][k]) for s in range(args.steps))
            for k in stats["aligned"][0]}
    rel = {k: max(abs(stats["aligned"][s][k] - stats["trie"][s][k]) / max(abs(stats["aligned"][s][k]), 1e-12)
                  for s in range(args.steps)) for k in stats["aligned"][0]}
    med = {L: {k: statistics.median(v) for k, v in times[L].items()} for L in layouts}
    out = {"steps": args.steps, "rounds": args.rounds, "clock": "process", "threads": torch.get_num_threads(),
           "loadavg": open("/proc/loadavg").read().split()[:3], "tokens": tokens, "action_entries": actions,
           "times": times, "median_s": med, "stat_max_abs_diff": diff, "stat_max_rel_diff": rel}
    for L in layouts:
        print(f"{L:8s} tokens/batch {tokens[L]}  score {med[L]['score']:.2f} s  update {med[L]['update']:.2f} s "
              f"(CPU, {args.steps} batches, median of {args.rounds})")
    print(f"trie/aligned tokens {sum(tokens['trie']) / sum(tokens['aligned']):.3f}  score "
          f"{med['trie']['score'] / med['aligned']['score']:.3f}  update {med['trie']['update'] / med['aligned']['update']:.3f}")
    print("max |aligned - trie| per logged statistic:", {k: f"{v:.2e}" for k, v in diff.items()})
    print("load average:", " ".join(out["loadavg"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
