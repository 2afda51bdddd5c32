"""Helper for tests/trainer/test_run_integrity.py: trainer processes to pause, kill or race.

    python tests/_rundir_worker.py pause CONFIG_JSON STATE_DIR PAUSE_AT
        Trainer.fit on the run of CONFIG_JSON (a TrainConfig as JSON); right after the
        metrics line of step PAUSE_AT it writes STATE_DIR/paused and waits for STATE_DIR/go
        (the test kills it there, or races a second trainer against it).
    torchrun --nproc_per_node 2 tests/_rundir_worker.py dist OUT
        Two ranks on a fixed batch (tests/_dist_worker_trainer.py's models): an
        uninterrupted run, a run stopped after 2 of 3 steps whose newest checkpoint rank 0
        then truncates, a rerun without --resume (refused on every rank) and a resume
        (falls back to step 1 on every rank). Each rank writes OUT/rank<r>.json.

The leading underscore keeps pytest from collecting it.
"""
from __future__ import annotations

import json
import os
import sys
import time


def pause(config_json: str, state_dir: str, pause_at: int) -> None:
    from memopd.trainer.config import TrainConfig
    from memopd.trainer.loop import Trainer, prepare

    cfg = TrainConfig.from_dict(json.loads(config_json))

    class Pausing(Trainer):
        def write_metrics(self, m):
            super().write_metrics(m)
            if m.get("step") == pause_at:
                with open(os.path.join(state_dir, "paused"), "w") as f:
                    f.write(str(os.getpid()))
                while not os.path.exists(os.path.join(state_dir, "go")):
                    time.sleep(0.05)

    student, teacher, env, world, *_ = prepare(cfg, log=lambda *_: None)
    Pausing(cfg, student_lm=student, teacher_lm=teacher, env=env, tasks=world, log=lambda *_: None).fit()


def dist(out: str) -> None:
    import torch

    from memopd.errors import RunDirError
    from memopd.trainer.collectives import init_distributed, shutdown_distributed
    from memopd.trainer.config import TrainConfig
    from memopd.trainer.loop import Trainer

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _dist_worker_trainer import N_TRAJ, global_batch, make_models

    info = init_distributed()

    class FixedBatch(Trainer):
        def rollout(self, step, actor):
            return global_batch()[self.rank::self.world_size], 2

    def make(name):
        cfg = TrainConfig(arm="memopd", steps=3, ppo_epochs=1, minibatches=1, tasks_per_step=N_TRAJ, group_size=1,
                          warmup_steps=0, actor_lr=1e-2, critic_lr=1e-2, checkpoint_every=1, progress=False,
                          run_dir=os.path.join(out, name)).validate()
        student, teacher = make_models()
        return FixedBatch(cfg, student_lm=student, teacher_lm=teacher, env=None, tasks=None, log=lambda *_: None)

    full = make("a").fit()
    make("b").fit(stop_after=2)
    if info.rank == 0:
        p = os.path.join(out, "b", "checkpoints", "step_2", "actor", "backend.pt")
        os.truncate(p, os.path.getsize(p) // 2)
    if info.world_size > 1:
        torch.distributed.barrier()
    refused = None
    try:
        make("b").fit()
    except RunDirError as e:
        refused = str(e)
    resumed = make("b").fit(resume=True)
    with open(os.path.join(out, f"rank{info.rank}.json"), "w") as f:
        json.dump({"world_size": info.world_size, "full": full, "resumed": resumed, "refused": refused}, f)
    shutdown_distributed()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if sys.argv[1] == "pause":
        pause(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    elif sys.argv[1] == "dist":
        dist(sys.argv[2])
    else:
        raise SystemExit(f"unknown mode {sys.argv[1]!r}")
