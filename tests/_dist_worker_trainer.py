"""Helper for tests/trainer/test_trainer_dist.py: two trainer steps (PPO + OPD) on a fixed batch.

Run as ``python tests/_dist_worker_trainer.py OUT DOMAIN SCENARIO...`` (one process) or under
``torchrun --standalone --nproc_per_node 2``. Every scenario builds the same tiny
student, critic, reference and teacher, replaces the environment rollout by a fixed
global batch of recorded trajectories (rank r takes every world_size-th one), runs two
`Trainer.train_step`s (scoring, GAE, global advantage whitening, 2 PPO epochs of one
minibatch: two optimiser steps each on actor and critic; the second step has a nonzero
reference-KL penalty) and writes the full actor and critic weights and the metrics
from rank 0. The leading underscore keeps pytest from collecting it.
"""
from __future__ import annotations

import json
import os
import random
import sys

import torch

VOCAB = 96
N_TRAJ = 8
SCENARIOS = {
    "plain": None,
    "zero2": {"zero_optimization": {"stage": 2}},
    "zero3": {"zero_optimization": {"stage": 3}},
}


def global_batch():
    from memopd import random_trajectories

    trajs = random_trajectories("summary", N_TRAJ, seed=11, group_size=2, vocab_size=VOCAB, calls=(2, 4))
    rng = random.Random(5)
    for tr in trajs:
        tr.reward = rng.choice([0.0, 0.5, 1.0])
    return trajs


def make_models():
    from memopd.models import tiny_causal_lm

    student = tiny_causal_lm("qwen2", vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4,
                             num_kv_heads=2, initializer_range=0.2, seed=3)
    teacher = tiny_causal_lm("llama", vocab_size=VOCAB, hidden_size=48, num_heads=4, num_kv_heads=4,
                             initializer_range=0.2, seed=4)
    return student, teacher


def run_scenario(name: str, out: str, action_domain: str) -> None:
    from memopd.trainer.config import TrainConfig
    from memopd.trainer.loop import Trainer
    from memopd.trainer.settings import PPOSettings

    ds = ""
    if SCENARIOS[name] is not None:
        ds = os.path.join(out, f"{name}.json")
        with open(ds, "w") as f:
            json.dump(SCENARIOS[name], f)
    cfg = TrainConfig(arm="memopd", steps=1, ppo_epochs=2, minibatches=1, tasks_per_step=N_TRAJ, group_size=1,
                      ppo=PPOSettings(ref_kl_coef=0.05, entropy_coef=0.01), warmup_steps=0, actor_lr=1e-2, critic_lr=1e-2,
                      checkpoint_every=0, progress=False, deepspeed=ds, run_dir=os.path.join(out, name),
                      action_domain=action_domain).validate()

    class FixedBatch(Trainer):
        def rollout(self, step, actor):
            return global_batch()[self.rank::self.world_size], 2

    student, teacher = make_models()
    if os.environ.get("MEMOPD_TEST_DEVICE") == "cuda":  # the NCCL run of benchmarks/gpu_check.sh
        student.to(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}")
    tr = FixedBatch(cfg, student_lm=student, teacher_lm=teacher, env=None, tasks=None, log=lambda *_: None)
    metrics = [tr.train_step(0), tr.train_step(1)]
    actor, critic = tr.inference_modules()  # full weights on every rank, also under ZeRO-3
    if tr.rank == 0:
        torch.save({"actor": {k: v.detach().cpu() for k, v in actor.state_dict().items()},
                    "critic": {k: v.detach().cpu() for k, v in critic.state_dict().items()},
                    "metrics": metrics, "world_size": tr.world_size},
                   os.path.join(out, f"{name}_{action_domain}.pt"))


def main() -> None:
    out, action_domain, names = sys.argv[1], sys.argv[2], sys.argv[3:]
    from memopd.trainer.collectives import init_distributed

    pg = os.environ.get("MEMOPD_TEST_PROCESS_GROUP")
    if pg and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # e.g. "cuda:gloo": a default group that serves CUDA tensors only, as NCCL does,
        # so a collective on a CPU tensor fails here as it would on a GPU machine
        import torch.distributed as dist

        dist.init_process_group(backend=pg, init_method="env://")
    init_distributed()
    os.makedirs(out, exist_ok=True)
    for name in names:
        run_scenario(name, out, action_domain)
    from memopd.trainer.collectives import shutdown_distributed

    shutdown_distributed()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
