"""`memopd train`: run the PPO / persistent / MemOPD trainer from a config and overrides.

    memopd train                                  # the embedded default (CPU, minutes)
    memopd train arm=ppo steps=20 run_dir=runs/ppo
    memopd train --config my.yaml --resume        # continue from the newest complete checkpoint
    memopd train --overwrite run_dir=runs/ppo     # discard that run directory's previous run
    torchrun --nproc_per_node 2 -m memopd.cli train deepspeed=trainer/configs/ds_zero2.json
"""
from __future__ import annotations

import argparse

from .config import TrainConfig

__all__ = ["train_main"]


def train_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="memopd train",
        description="PPO + on-policy distillation of a compact-memory agent (arms: ppo, persistent, memopd).",
        epilog="Overrides are key=value pairs of TrainConfig (trainer/config.py), e.g. arm=ppo steps=20; the "
               "environment section's keys as env.KEY or flat, e.g. env.policy=full or policy=full.",
    )
    p.add_argument("--config", help="YAML file of TrainConfig fields")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--resume", action="store_true",
                      help="continue from the run directory's newest complete checkpoint (same config, except "
                           "steps, checkpoint_every, eval_every, progress, tensorboard, cpu_threads)")
    mode.add_argument("--overwrite", action="store_true",
                      help="delete the previous run's outputs in run_dir and start over (a used run_dir is "
                           "refused without --resume or --overwrite)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("overrides", nargs="*", help="key=value overrides")
    args = p.parse_args(argv)
    # a ConfigError (a memopd.errors.UserError) is reported by memopd.cli.main: one line, exit 2
    cfg, asked = TrainConfig.load_given(args.config, args.overrides)
    if args.print_config:
        import yaml

        print(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        return 0
    from .loop import train

    train(cfg, resume=args.resume, overwrite=args.overwrite, asked=asked)
    return 0
