"""Command-line entry points of the environment: `memopd sft` and `memopd eval`.

`sft_main(argv)` trains (or reuses) the teacher and student checkpoints;
`eval_main(argv)` evaluates one checkpoint (or the scripted expert) and prints a table,
optionally writing JSON. Both return 0 on success and raise `memopd.errors.UserError`
(or a subclass) for bad input; the `memopd` console script (`memopd.cli.main`) dispatches
to them and turns errors into one-line messages and exit codes.
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

__all__ = ["sft_main", "eval_main", "build_sft_parser", "build_eval_parser"]


def _ks(text: str) -> tuple[int, ...]:
    try:
        ks = tuple(int(x) for x in text.replace(",", " ").split())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like '1,2,4', got {text!r}") from None
    if not ks or any(k < 1 for k in ks):
        raise argparse.ArgumentTypeError(f"question-set sizes must be >= 1, got {text!r}")
    return ks


def _policies() -> tuple[str, ...]:
    from memopd.memory import POLICIES

    return tuple(POLICIES)


def _world_names() -> tuple[str, ...]:
    from .qa.world import WORLD_PRESETS

    return tuple(WORLD_PRESETS)


def build_sft_parser(prog: str = "memopd sft") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Train the tiny teacher and student agents on scripted-expert episodes of the generated "
                    "QA world (loss on action tokens only). Each role is saved as a HF checkpoint directory "
                    "OUT/<role> (weights, config, tokenizer, memopd_env.json); existing ones are reused. "
                    "The world preset picks the models and the recipe (docs/design.md §10).",
    )
    p.add_argument("--out", required=True, help="output directory (OUT/teacher, OUT/student)")
    p.add_argument("--world", default="default", choices=_world_names(),
                   help="world preset: 'default', 'replication' (held-out facts, multi-word answers, "
                        "a teacher trained on compact and full-history episodes) or 'info-gap' (replication plus "
                        "information-gap sets and per-set turn budgets; docs/research/replication.md)")
    p.add_argument("--roles", default="teacher,student", help="comma list of roles to train (default: both)")
    p.add_argument("--force", action="store_true", help="retrain even if a checkpoint exists")
    p.add_argument("--seed", type=int, default=0, help="world seed (the world, corpus and tasks derive from it)")
    p.add_argument("--entities", type=int, default=None, help="entities in the generated world (default per preset)")
    p.add_argument("--policy", default="summary", choices=_policies(),
                   help="memory policy the expert episodes use (default summary)")
    p.add_argument("--teacher-steps", type=int, default=None, help="teacher optimizer steps (default per preset)")
    p.add_argument("--student-steps", type=int, default=None, help="student optimizer steps (default per preset)")
    p.add_argument("--batch-tokens", type=int, default=None, help="padded tokens per batch (default per preset)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default per preset)")
    p.add_argument("--ks", type=_ks, default=None, help="question-set sizes of the expert data, e.g. '1,2,4,8,16'")
    p.add_argument("--copy-warmup-steps", type=int, default=None,
                   help="synthetic copy pre-training steps before SFT (default per preset; 0 = none)")
    p.add_argument("--calls-per-k", type=int, default=None, help="expert calls to train on per question-set size")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads per model (default 1)")
    p.add_argument("--jobs", type=int, default=None,
                   help="roles trained at once in separate processes (default: one per role, up to the CPU count)")
    p.add_argument("--json", default=None, help="write the training summary here as JSON")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    return p


def sft_main(argv: Sequence[str] | None = None) -> int:
    from dataclasses import replace

    from memopd.errors import UserError

    from .qa.env import EnvConfig
    from .qa.sft import role_presets, run_sft
    from .qa.world import world_preset

    args = build_sft_parser().parse_args(argv)
    world = world_preset(args.world, seed=args.seed)
    if args.entities is not None:
        world = replace(world, n_entities=args.entities)
    specs, presets = role_presets(world)
    roles = [r.strip() for r in args.roles.split(",") if r.strip()]
    unknown = [r for r in roles if r not in specs]
    if unknown or not roles:
        raise UserError(f"--roles: unknown role(s) {unknown or [args.roles]}; choose from {', '.join(specs)}")
    cfgs = {}
    for r in roles:
        over = {}
        steps = args.teacher_steps if r == "teacher" else args.student_steps
        for name, val in (("steps", steps), ("batch_tokens", args.batch_tokens), ("lr", args.lr), ("ks", args.ks),
                          ("calls_per_k", args.calls_per_k), ("warmup_copy_steps", args.copy_warmup_steps),
                          ("threads", args.threads)):
            if val is not None:
                over[name] = val
        cfgs[r] = replace(presets[r], **over)
    env = EnvConfig(policy=args.policy)
    summary = run_sft(args.out, roles=roles, force=args.force, world_config=world, env_config=env,
                      sft_configs=cfgs, jobs=args.jobs, progress=not args.no_progress)
    if args.json:
        from memopd.files import atomic_write_json

        atomic_write_json(args.json, summary)  # whole or not at all, and exit 74 on an OS failure
    return 0


def build_eval_parser(prog: str = "memopd eval") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Evaluate an agent checkpoint on held-out multi-question sets (Q2/Q8/Q16 by default): "
                    "EM/F1 (mean = fraction of sub-questions, sum = number right per episode), peak context "
                    "tokens, turns, wall time. Greedy decoding unless --temperature > 0.",
    )
    p.add_argument("model_dir", nargs="?", default=None, help="checkpoint directory (same as --model)")
    p.add_argument("--model", help="checkpoint directory written by `memopd sft` (e.g. OUT/teacher)")
    p.add_argument("--expert", action="store_true", help="evaluate the scripted expert instead (upper bound)")
    p.add_argument("--world", default=None, choices=_world_names(),
                   help="world preset: the expert's world; for a model, a check that it was trained in it")
    p.add_argument("--k", "--ks", dest="k", type=int, nargs="+", default=[2, 8, 16],
                   help="question-set sizes (default 2 8 16)")
    p.add_argument("--n", type=int, default=32, help="question sets per size (default 32)")
    p.add_argument("--seed", type=int, default=0, help="seed of the held-out sets and of sampling")
    p.add_argument("--policy", default=None, choices=_policies(),
                   help="memory policy (default: the one the model was trained with)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0)")
    p.add_argument("--samples", type=int, default=1,
                   help="episodes per set (with --temperature > 0; scores are means over them; default 1)")
    p.add_argument("--batch-size", type=int, default=32, help="episodes per generation batch")
    p.add_argument("--max-new-tokens", type=int, default=None, help="per-call limit (default 24 + 5k)")
    p.add_argument("--corpus", default=None, help="user corpus JSONL ({'id','text'} per line)")
    p.add_argument("--questions", default=None, help="user question sets JSONL ({'questions','answers'} per line)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1: fastest for tiny models, and robust on a busy machine)")
    p.add_argument("--json", default=None, help="also write the report as JSON to this path")
    p.add_argument("--save-trajectories", metavar="FILE", default=None,
                   help="also save every played episode (exact ids and sampling log-probs) as a trajectories "
                        "file, e.g. for `memopd audit --model DIR --trajectories FILE`")
    p.add_argument("--progress", action="store_true", help="show a progress bar per question-set size")
    p.add_argument("--engine", default="hf", choices=["hf", "vllm"],
                   help="rollout engine: hf (transformers, default) or vllm (README \"Rollouts with vLLM\")")
    return p


def eval_main(argv: Sequence[str] | None = None) -> int:
    from memopd.errors import UserError

    from .qa.evaluate import evaluate, format_table, write_json
    from .qa.world import world_preset

    args = build_eval_parser().parse_args(argv)
    if args.model_dir is not None and args.model is not None and args.model_dir != args.model:
        raise UserError(f"two checkpoints given ({args.model_dir!r} and --model {args.model!r}); give one")
    model = args.model or args.model_dir
    if (model is None) == (not args.expert):
        raise UserError("give exactly one of a checkpoint directory (DIR or --model DIR) or --expert")
    if args.samples < 1:
        raise UserError(f"--samples must be >= 1, got {args.samples}")
    if args.samples > 1 and not args.temperature > 0:
        raise UserError(f"--samples {args.samples} needs --temperature > 0: greedy decoding plays the same episode "
                        "every time")
    world = None
    if args.world is not None:
        world = world_preset(args.world, seed=args.seed if args.expert else 0)
        if model is not None:
            from .qa.sft import read_env_meta

            trained = read_env_meta(model).get("world", {}).get("preset", "default")
            if trained != args.world:
                raise UserError(f"{model!r} was trained in the {trained!r} world, not {args.world!r}")
    import torch

    old_threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.save_trajectories:
        _check_output_file(args.save_trajectories, "--save-trajectories")
    played: list = []
    try:
        report = evaluate(
            model, expert=args.expert, world_config=world, ks=args.k, n=args.n, seed=args.seed, policy=args.policy,
            temperature=args.temperature, top_p=args.top_p, samples=args.samples, batch_size=args.batch_size,
            max_new_tokens=args.max_new_tokens, corpus=args.corpus, questions=args.questions,
            progress=args.progress, trajectories=played, engine=args.engine,
        )
    finally:
        torch.set_num_threads(old_threads)
    print(format_table(report))
    if args.json:
        write_json(report, args.json)
        print(f"report written to {args.json}")
    if args.save_trajectories:
        from memopd.records import save_trajectories

        save_trajectories(args.save_trajectories, played)
        print(f"{len(played)} trajectories written to {args.save_trajectories}")
    return 0


def _check_output_file(path: str, option: str) -> None:
    """An output file's directory must exist and the path must not be a directory: found
    before the episodes are played, not after."""
    import os

    from memopd.errors import UserError

    if os.path.isdir(path):
        raise UserError(f"{option} {path!r} is a directory; give a file path")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise UserError(f"{option} {path!r}: the directory {parent!r} does not exist")


if __name__ == "__main__":  # python -m memopd.env.cli sft|eval ...
    if len(sys.argv) < 2 or sys.argv[1] not in ("sft", "eval"):
        print("usage: python -m memopd.env.cli {sft,eval} ...", file=sys.stderr)
        sys.exit(2)
    from memopd.cli import main

    sys.exit(main(sys.argv[1:]))
