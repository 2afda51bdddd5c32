"""The `memopd` command line: one subcommand per job, each in its own function.

    memopd audit   RCE audit tables (embedded default: tiny Qwen2 + generated trajectories)
    memopd pack    layout statistics of a batch (what packing saves, what flatten adds)
    memopd sft     SFT of the teacher and the student on expert episodes
    memopd eval    EM/F1 of a model on held-out Q2/Q8/Q16
    memopd train   the main job: PPO / persistent / MemOPD run on the embedded default
    memopd plot    learning curves of a run directory

Errors: bad input is one line on stderr and exit code 2 (3: run-directory conflict), a
write the operating system fails (no space, read-only, I/O error) is one line and exit
code 74, a failed audit exits 1, a bug prints its traceback and exits 70; `--debug` (anywhere before
a `--`) or MEMOPD_DEBUG=1 shows the traceback of bad input too (`memopd.errors`).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

__all__ = ["main", "die_with_parent", "DIE_WITH_PARENT"]

_DTYPES = ("float32", "float64", "bfloat16", "float16")


def _load_model(path: str | None, arch: str, vocab_size: int, dtype_name: str, seed: int):
    import torch

    dtype = getattr(torch, dtype_name)
    if path:
        from .models import load_local_model

        return load_local_model(path, what="--model", dtype=dtype).eval()
    from .models import tiny_causal_lm

    # sharp random init: an untrained model whose predictions depend on the context
    return tiny_causal_lm(arch, vocab_size=vocab_size, initializer_range=0.2, seed=seed, dtype=dtype)


def _load_nonempty(path: str, what: str, vocab_size: int | None = None):
    from .records import RecordError, load_trajectories

    trajs = load_trajectories(path, vocab_size=vocab_size)
    if not trajs:
        raise RecordError(f"{path}: the file holds no trajectories; nothing to {what}")
    return trajs


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


_AUDIT_NOTE_TOKENS = 200_000  # a set this large is no longer a quick audit: say when it starts


def _cmd_audit(args) -> int:
    from .memory import POLICIES, random_trajectories
    from .rce import audit, format_table

    t0 = time.time()
    model = _load_model(args.model, args.arch, 256, args.dtype, args.seed)
    if args.device != "cpu":
        from memopd.trainer.device import resolve_device  # auto: cuda:LOCAL_RANK when there is a GPU

        model.to(resolve_device(args.device, local_rank=int(os.environ.get("LOCAL_RANK", "0") or 0)))
    vocab = model.get_output_embeddings().weight.shape[0]
    sets = []
    if args.trajectories:
        sets.append(("recorded", _load_nonempty(args.trajectories, "audit", vocab_size=vocab)))
    elif args.model and not args.random:
        sets += _own_samples(args)
    else:
        policies = POLICIES if args.policy == "all" else [args.policy]
        for p in policies:
            trajs = random_trajectories(
                p, args.num_trajectories, vocab_size=vocab, seed=args.seed, group_size=args.group_size,
                calls=(3, 6), obs_len=(2, 12), action_len=(2, 12),
            )
            sets.append((p, trajs))
    report = {"model": args.model or f"tiny-{args.arch} (random init)", "dtype": args.dtype, "policies": {}}
    failed = []
    for name, trajs in sets:
        # a call never splits across rows: the budget must hold the longest flattened episode
        longest = max(t.flattened_tokens for t in trajs)
        budget = max(args.max_tokens, longest)
        if budget > args.max_tokens:
            print(f"memopd audit: {name}: --max-tokens raised from {args.max_tokens} to {budget}, the longest "
                  "flattened episode (a call never splits across rows); the flatten layouts of such episodes take long",
                  file=sys.stderr)
        tokens = sum(t.flattened_tokens for t in trajs)
        if budget > args.max_tokens or tokens > _AUDIT_NOTE_TOKENS:  # a set that takes a while: say it started
            print(f"memopd audit: {name}: auditing {len(trajs)} trajectories ({tokens} flattened tokens)",
                  file=sys.stderr, flush=True)
        results = audit(model, trajs, max_tokens=budget, attention_backend=args.attention_backend)
        print(format_table(results, f"\n== {name}  ({len(trajs)} trajectories) =="))
        report["policies"][name] = [r.to_dict() for r in results]
        failed += [f"{name}/{r.variant}" for r in results if r.must_pass and not r.passed]
    if args.trajectories and args.model:
        failed += _sampler_audit(args, model, sets[0][1], report)
    report["seconds"] = round(time.time() - t0, 2)
    report["passed"] = not failed
    if args.json:
        from memopd.files import atomic_write_text

        # all at once: a failed write (exit 74) leaves no partial report
        atomic_write_text(args.json, json.dumps(report, indent=2))
        print(f"\nJSON report written to {args.json}")
    print(f"\naudit finished in {report['seconds']} s: " + ("aligned layouts PASS" if not failed else f"FAILED: {', '.join(failed)}"))
    return 0 if not failed else 1


def _sampler_audit(args, model, trajs, report: dict) -> list[str]:
    """Recorded trajectories and a real model: the sampler's recorded log-probs against
    the model's restored ones (aligned, flatten), at the temperature and vocabulary the
    trajectories record. Returns the failed checks (aligned over --sampler-tolerance)."""
    from .errors import UserError
    from .rce import format_sampler_audit, sampler_audit

    if not any(inv.sample_logprobs is not None for tr in trajs for inv in tr.invocations):
        print("\n(no call of these trajectories recorded its sampling log-probs: no sampler audit)")
        return []
    settings = {(tr.info.get("sampling") or {}).get("temperature") for tr in trajs}
    vocab = {(tr.info.get("sampling") or {}).get("vocab_size") for tr in trajs}
    if len(settings) > 1 or len(vocab) > 1:
        raise UserError(f"--trajectories {args.trajectories}: the trajectories were sampled with different settings "
                        f"(temperatures {sorted(map(str, settings))}, vocab sizes {sorted(map(str, vocab))}); audit each set alone")
    t = settings.pop()
    temperature = float(t) if t else 1.0  # greedy calls record temperature-1 log-probs
    v = vocab.pop()
    res = sampler_audit(model, trajs, ("aligned", "flatten"), temperature=temperature, vocab_size=v,
                        threshold=args.sampler_threshold, max_tokens=max(args.max_tokens, max(tr.flattened_tokens for tr in trajs)))
    print(f"\n== recorded sampling log-probs vs {args.model} restored (temperature {temperature:g}) ==")
    print(format_sampler_audit(res, args.sampler_threshold))
    report["sampler"] = {"temperature": temperature, "vocab_size": v, **res}
    ok = res["aligned"]["max_abs_dlogp"] <= args.sampler_tolerance
    print(f"aligned max|dlogp| {res['aligned']['max_abs_dlogp']:.3g} "
          f"{'<=' if ok else '>'} --sampler-tolerance {args.sampler_tolerance:g}: {'PASS' if ok else 'FAIL'}")
    return [] if ok else ["sampler/aligned"]


def _own_samples(args) -> list[tuple[str, list]]:
    """The model's own rollouts, one set per k: held-out sets of the world it was trained
    in (its memopd_env.json), or of the user's --corpus / --questions, each played once at
    --temperature (the sampling state a trainer would record)."""
    from .env.qa.evaluate import evaluate
    from .env.qa.sft import ENV_META_FILE
    from .errors import UserError

    played: list = []
    user = bool(args.corpus or args.questions)
    if not user and not os.path.exists(os.path.join(args.model, ENV_META_FILE)):
        raise UserError(f"--model {args.model!r} has no {ENV_META_FILE}, so it has no world to play: give "
                        "--corpus DOCS.jsonl --questions SETS.jsonl to audit it on its own rollouts there, "
                        "--trajectories FILE to audit recorded ones, or --random for random token ids")
    evaluate(args.model, ks=args.ks, n=args.n, seed=args.seed, temperature=args.temperature,
             corpus=args.corpus, questions=args.questions, trajectories=played)
    by_k: dict[int, list] = {}
    for t in played:
        by_k.setdefault(int(t.rewards["k"]), []).append(t)
    where = "user question sets" if user else "held-out sets"
    return [(f"own samples: Q{k}, {where}, temperature {args.temperature:g}", ts) for k, ts in sorted(by_k.items())]


def _cmd_pack(args) -> int:
    from .memory import random_trajectories
    from .packing import LAYOUTS, pack

    if args.trajectories:
        trajs = _load_nonempty(args.trajectories, "pack")
    else:
        trajs = random_trajectories(args.policy, args.num_trajectories, seed=args.seed, group_size=args.group_size,
                                    vocab_size=1000, calls=(4, 12), obs_len=(8, 40), action_len=(8, 40), prefix_len=(40, 120))
    rows = []
    for layout in LAYOUTS:
        rows.append(pack(trajs, layout=layout, max_tokens=args.max_tokens).stats())
    rows.append({**pack(trajs, layout="aligned", max_tokens=args.max_tokens, share_prefix="group").stats(),
                 "layout": "aligned (group prefix)"})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    keys = ["layout", "rows", "tokens", "padding_fraction", "prefix_segments", "action_tokens", "naive_action_tokens"]

    def cell(v) -> str:  # naive_action_tokens is only counted for flatten: "-" elsewhere
        return "-" if v is None else str(v)

    widths = [max(len(k), *(len(cell(r[k])) for r in rows)) for k in keys]
    print("  ".join(k.ljust(w) for k, w in zip(keys, widths)))
    for r in rows:
        print("  ".join(cell(r[k]).ljust(w) for k, w in zip(keys, widths)).rstrip())
    base = rows[LAYOUTS.index("independent")]["tokens"]
    print("\ntokens vs independent: " + ", ".join(f"{r['layout']} {r['tokens'] / base:.2f}x" for r in rows))
    return 0


def _add_audit(sub) -> None:
    from .memory import POLICIES

    p = sub.add_parser("audit", help="RCE audit: packed vs independent logits, per layout and memory policy",
                       description="RCE audit. With --model DIR: the model's own rollouts (a memopd agent plays "
                                   "held-out sets of its world; any HF model with --corpus/--questions plays "
                                   "those), or --trajectories FILE (e.g. from `memopd eval --save-trajectories`), "
                                   "or --random token-id trajectories. Without --model: a tiny random-init model "
                                   "on random trajectories per memory policy.")
    p.add_argument("--model", help="local HF checkpoint directory (default: a tiny random-init model)")
    p.add_argument("--arch", default="qwen2", choices=["qwen2", "llama"], help="architecture of the default model")
    p.add_argument("--trajectories", help="a trajectories .jsonl file to audit instead of sampled rollouts")
    p.add_argument("--random", action="store_true",
                   help="with --model: audit random token-id trajectories (per --policy) instead of its rollouts")
    p.add_argument("--ks", type=_positive_int, nargs="+", default=[2, 8],
                   help="own rollouts: question-set sizes played (default 2 8)")
    p.add_argument("--n", type=_positive_int, default=8, help="own rollouts: held-out sets per size (default 8)")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="own rollouts: sampling temperature (default 1; 0 = greedy)")
    p.add_argument("--corpus", help="own rollouts on your data: a corpus JSONL (with --questions)")
    p.add_argument("--questions", help="own rollouts on your data: question sets JSONL (with --corpus)")
    p.add_argument("--dtype", default="float32", choices=_DTYPES)
    p.add_argument("--policy", default="all", choices=["all", *POLICIES],
                   help="random trajectories: memory policy (own rollouts use the model's)")
    p.add_argument("--num-trajectories", type=_positive_int, default=8, help="random trajectories per policy")
    p.add_argument("--group-size", type=_positive_int, default=4,
                   help="random trajectories per group (share a prefix)")
    p.add_argument("--max-tokens", type=_positive_int, default=8192)
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton", "reference"])
    p.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"],
                   help="where the model runs (auto: the GPU when there is one; cuda without one is refused)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sampler-tolerance", type=float, default=1e-4,
                   help="--trajectories with --model: the largest |recorded - restored| sampling log-prob allowed "
                        "in the aligned layout (default 1e-4)")
    p.add_argument("--sampler-threshold", type=float, default=1e-3,
                   help="--trajectories with --model: |d log p| above it counts in the 'share >' column")
    p.add_argument("--json", help="also write a machine-readable report to this path")
    p.set_defaults(func=_cmd_audit)


def _add_pack(sub) -> None:
    from .memory import POLICIES

    p = sub.add_parser("pack", help="layout statistics: tokens, padding, prefixes, naive action domain")
    p.add_argument("--trajectories", help="a trajectories .jsonl file (default: generated)")
    p.add_argument("--policy", default="summary", choices=POLICIES)
    p.add_argument("--num-trajectories", type=_positive_int, default=16)
    p.add_argument("--group-size", type=_positive_int, default=4)
    p.add_argument("--max-tokens", type=_positive_int, default=8192)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=_cmd_pack)


def _add_external(sub, name: str, help_text: str) -> None:
    """Listed in `memopd --help`; `main` hands their raw argv to their own parsers."""
    sub.add_parser(name, help=help_text, add_help=False)


def _debug_requested(argv: list[str]) -> bool:
    """Take the global `--debug` flag out of `argv` (before or after the subcommand; never
    after a `--`); MEMOPD_DEBUG=1 in the environment does the same."""
    flag = False
    stop = argv.index("--") if "--" in argv else len(argv)
    for i in reversed(range(stop)):
        if argv[i] == "--debug":
            del argv[i]
            flag = True
    return flag or os.environ.get("MEMOPD_DEBUG", "").strip().lower() not in ("", "0", "false", "no")


def _one_line(msg: object) -> str:
    return "; ".join(part.strip() for part in str(msg).splitlines() if part.strip()) or type(msg).__name__


# the optional dependencies (pyproject.toml extras) by import name: (pip package, extra)
_OPTIONAL = {
    "transformers": ("transformers", "train"),
    "tokenizers": ("tokenizers", "train"),
    "safetensors": ("safetensors", "train"),
    "bm25s": ("bm25s", "train"),
    "tqdm": ("tqdm", "train"),
    "yaml": ("pyyaml", "train"),
    "matplotlib": ("matplotlib", "plot"),
    "tensorboard": ("tensorboard", "plot"),
    "deepspeed": ("deepspeed", "deepspeed"),
    "triton": ("triton", "triton"),
    "uvicorn": ("uvicorn", "serve"),
    "starlette": ("starlette", "serve"),
}
_TRAIN_MODULES = tuple(m for m, (_, extra) in _OPTIONAL.items() if extra == "train")
# checked before a command starts: train and sft run parts of the job in worker processes,
# which would otherwise be the first to meet a missing package
_COMMAND_NEEDS = {
    "train": _TRAIN_MODULES, "sft": _TRAIN_MODULES, "eval": _TRAIN_MODULES, "compare": _TRAIN_MODULES,
    "audit": ("transformers",), "plot": ("matplotlib",),
    "serve-teacher": ("transformers", "safetensors", "uvicorn", "starlette"),
}


def _missing_for(command: str) -> tuple[str, str] | None:
    """(package, extra) of the first optional dependency `command` needs that is not installed."""
    import importlib.util

    for module in _COMMAND_NEEDS.get(command, ()):
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a broken or blocked installation counts as missing
            found = False
        if not found:
            return _OPTIONAL[module]
    return None


def _missing_extra(e: BaseException) -> tuple[str, str] | None:
    """(package, extra) when `e`, or an error it was raised from, is the import of an
    optional dependency that is not installed; None otherwise (a bug)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, ModuleNotFoundError) and e.name and e.name.split(".")[0] in _OPTIONAL:
            return _OPTIONAL[e.name.split(".")[0]]
        e = e.__cause__ or e.__context__
    return None


def _install_hint(package: str, extra: str) -> str:
    return (f"this command needs {package}, which is not installed: "
            f"pip install 'memopd[{extra}]' (in a checkout: pip install '.[{extra}]')")


# OS errors about a path the user named (a missing input file, an unwritable output) are
# bad input, not bugs
_PATH_ERRORS = (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError, FileExistsError)


def _user_facing(e: Exception) -> tuple[int, str] | None:
    """(exit code, one-line message) of an error that is not a bug; None for a bug."""
    import errno

    from .errors import UserError, os_failure, output_error, system_failure

    if isinstance(e, UserError):
        return e.exit_code, _one_line(e)
    code = os_failure(e, getattr(e, "filename", None))
    # a failed write that was not reported where it happened (EACCES alone may also be an
    # input that cannot be read: that stays bad input, below)
    if code is not None and code not in (errno.EACCES, errno.EPERM):
        name = getattr(e, "filename", None)
        err = output_error(code, os.fspath(name) if name else "an output", "")
        return err.exit_code, _one_line(err)
    if isinstance(e, _PATH_ERRORS):
        return UserError.exit_code, _one_line(e)
    missing = _missing_extra(e) if isinstance(e, ImportError) else None
    if missing is not None:  # an optional dependency, not a bug
        return UserError.exit_code, _install_hint(*missing)
    return system_failure(e)  # a dead peer rank, no memory: not bugs either


DIE_WITH_PARENT = "MEMOPD_DIE_WITH_PARENT"  # set by `memopd compare` for its children: its pid


def die_with_parent() -> None:
    """In a child of `memopd compare` (DIE_WITH_PARENT names the parent's pid): have Linux
    SIGKILL this process when the parent dies (prctl PR_SET_PDEATHSIG), so no orphan keeps
    training and holding its run-directory lock; exit at once if the parent is already
    gone. Elsewhere a no-op."""
    want = os.environ.pop(DIE_WITH_PARENT, None)  # this process's own parent only, not its children's
    if not want or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0) != 0:
        return
    if str(os.getppid()) != want:  # it died before the prctl: no signal will come
        os._exit(128 + int(signal.SIGKILL))


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; return the process exit code (see `memopd.errors`).

    Bad input (`UserError` and its subclasses, argparse errors, a path that cannot be
    opened) is one line on stderr, `memopd <command>: error: <message>`, and exit code 2
    (3 for a run-directory conflict); an OS failure of a write is one line and exit code 74;
    anything else is a bug: traceback and exit code 70.
    `--debug` or MEMOPD_DEBUG=1 prints the traceback for bad input too.
    """
    import traceback

    from .errors import EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_TERMINATED, Terminated
    from .progress import no_library_bars_in_logs

    die_with_parent()
    restore_sigterm = _sigterm_as_interrupt()
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = _debug_requested(argv)
    no_library_bars_in_logs()  # stderr to a file: no library progress bars either
    prog = "memopd" + (f" {argv[0]}" if argv and not argv[0].startswith("-") else "")
    ok = False
    try:
        code = _dispatch(argv)
        ok = True
        return code
    except KeyboardInterrupt as e:
        if debug:
            traceback.print_exc()
        if isinstance(e, Terminated):
            print(f"{prog}: terminated (SIGTERM): stopped; what was complete is kept (a run continues with --resume)",
                  file=sys.stderr)
            return EXIT_TERMINATED
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as e:  # noqa: BLE001 - the last resort of the command line
        known = _user_facing(e)
        if known is None:
            traceback.print_exc()
            print(f"{prog}: internal error ({type(e).__name__}): this is a bug in memopd; "
                  "please report it with the traceback above", file=sys.stderr)
            return EXIT_INTERNAL
        if debug:
            traceback.print_exc()
        print(f"{prog}: error: {known[1]}", file=sys.stderr)
        return known[0]
    finally:
        _end_process_group(orderly=ok)
        restore_sigterm()


def _sigterm_as_interrupt():
    """Handle SIGTERM as Ctrl-C for the command's life (every write is atomic, so any point
    is a safe one to stop at); returns what puts the previous handler back."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def raise_terminated(_signum, _frame):
        from .errors import Terminated

        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process at once
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, raise_terminated)
    return lambda: signal.signal(signal.SIGTERM, previous)


def _end_process_group(orderly: bool) -> None:
    """Under torchrun, `train` and `compare` join a process group: end it before exit."""
    if "torch" not in sys.modules or "memopd.trainer.collectives" not in sys.modules:
        return  # nothing distributed was started (and importing torch here would cost seconds)
    from memopd.trainer.collectives import shutdown_distributed

    shutdown_distributed(orderly=orderly)


def _dispatch(argv: list[str]) -> int:
    from .errors import UserError

    missing = _missing_for(argv[0]) if argv else None
    if missing is not None:
        raise UserError(_install_hint(*missing))
    for name, module, func, _ in _EXTERNAL:
        if argv and argv[0] == name:
            import importlib

            # these subcommands own their parsers: hand them the raw arguments
            return int(getattr(importlib.import_module(module), func)(argv[1:]) or 0)
    parser = argparse.ArgumentParser(
        prog="memopd", description="Memory-Aligned On-Policy Distillation",
        epilog="Exit codes: 0 success, 1 a check failed (audit), 2 bad input, 3 run-directory conflict, "
               "69 a peer rank failed, 70 internal error, 71 out of memory, "
               "74 an output could not be written (disk full, read-only, I/O error), 130 interrupted, 143 terminated (SIGTERM). "
               "MEMOPD_DEBUG=1 shows tracebacks for bad input.",
    )
    parser.add_argument("--debug", action="store_true", help="print the traceback of an error, not just its message")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_audit(sub)
    _add_pack(sub)
    for name, _module, _func, text in _EXTERNAL:
        _add_external(sub, name, text)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


# (subcommand, module, function taking argv, help) — filled as the jobs land
_EXTERNAL: list[tuple[str, str, str, str]] = [
    ("sft", "memopd.env.cli", "sft_main", "SFT of the teacher and the student on scripted-expert episodes"),
    ("eval", "memopd.env.cli", "eval_main", "EM/F1 of a checkpoint on held-out Q2/Q8/Q16 question sets"),
    ("train", "memopd.trainer.cli", "train_main", "the main job: PPO / persistent / MemOPD training run"),
    ("plot", "memopd.trainer.plot", "plot_main", "learning curves of a run directory to PNG"),
    ("compare", "memopd.trainer.compare", "compare_main", "train several arms over seeds; EM/F1 table"),
    ("serve-teacher", "memopd.teacher_server", "serve_main",
     "serve a teacher's hidden states on restored packed batches (for train teacher_url=)"),
]


if __name__ == "__main__":
    sys.exit(main())
