"""`memopd plot RUN_DIR`: learning curves of a run (metrics.jsonl) drawn to PNG.

Panels: reward, EM / F1 per Qk (from evaluations), KL to the teacher, clip fraction,
entropy, peak context length. Metrics absent from the run are skipped, not faked.
"""
from __future__ import annotations

import argparse
import json
import os

from memopd.errors import UserError

from .stats import CLIP_FRAC, ENTROPY, KL_TEACHER, train_metric

__all__ = ["read_metrics", "plot_run", "plot_protocol_curves", "plot_main", "matplotlib_module", "save_png"]

PANELS = [
    ("reward", ["rollout/reward_mean"], "reward"),
    ("eval EM (mean)", ["eval/em_mean_q*"], "EM"),
    ("eval F1 (mean)", ["eval/f1_mean_q*"], "F1"),
    ("KL to teacher", [train_metric(KL_TEACHER)], "KL"),
    ("clip fraction", [train_metric(CLIP_FRAC)], "fraction"),
    ("entropy", [train_metric(ENTROPY)], "nats"),
    ("peak context", ["rollout/peak_context"], "tokens"),
    ("sampler vs trainer log-probs", ["mismatch/max_abs_dlogp", "mismatch/mean_abs_dlogp",
                                      "mismatch_flatten/max_abs_dlogp"], "|d log p|"),
]


def read_metrics(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isdir(run_dir):
        raise UserError(f"run directory {run_dir!r} does not exist")
    if not os.path.exists(path):
        raise UserError(f"{path} not found: is {run_dir!r} a memopd run directory (written by `memopd train`)?")
    rows = []
    with open(path, encoding="utf-8", errors="replace") as f:  # not text: the JSON check below says so
        for i, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except (ValueError, RecursionError) as e:
                raise UserError(f"{path}:{i}: not JSON ({str(e)[:160] or type(e).__name__})") from None
            if not isinstance(row, dict) or isinstance(row.get("step"), bool) or not isinstance(row.get("step"), int):
                raise UserError(f"{path}:{i}: not a metrics record (a JSON object with an integer \"step\"), got "
                                f"{type(row).__name__ if not isinstance(row, dict) else 'step ' + repr(row.get('step'))[:40]}")
            rows.append({k: v for k, v in row.items()
                         if k == "step" or (isinstance(v, (int, float)) and not isinstance(v, bool))})
    return rows


def _series(rows, pattern):
    import fnmatch

    keys = sorted({k for r in rows for k in r if fnmatch.fnmatch(k, pattern)})
    for k in keys:
        pts = [(r["step"], r[k]) for r in rows if k in r and r[k] is not None]
        if pts:
            yield k, pts


def matplotlib_module():
    """matplotlib, or a `UserError` naming the extra that installs it."""
    try:
        import matplotlib
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] != "matplotlib":
            raise
        raise UserError("plotting needs matplotlib, which is not installed: pip install 'memopd[plot]' "
                        "(or pip install matplotlib)") from None
    return matplotlib


def save_png(fig, out: str) -> None:
    """The figure to `out` all at once: a failed write (full disk, read-only) leaves no
    partial PNG and is one `OutputError` (exit 74)."""
    from memopd.files import atomic_file

    with atomic_file(out, what=f"plot {out}") as tmp:
        fig.savefig(tmp, dpi=110, format="png")


def plot_run(run_dir: str, out: str | None = None) -> str:
    matplotlib = matplotlib_module()
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    out = out or os.path.join(run_dir, "curves.png")
    panels = [(t, [s for p in pats for s in _series(rows, p)], y) for t, pats, y in PANELS]
    panels = [p for p in panels if p[1]]
    if not panels:
        raise UserError(f"no plottable metrics in {run_dir}/metrics.jsonl (has the run logged a step yet?)")
    cols = 3
    nrows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.0 * nrows), squeeze=False)
    for ax, (title, series, ylabel) in zip(axes.flat, panels):
        for key, pts in series:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, ms=3, label=key.split("/")[-1])
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        if len(series) > 1:
            ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(os.path.basename(os.path.normpath(run_dir)))
    fig.tight_layout()
    save_png(fig, out)
    plt.close(fig)
    return out


def plot_protocol_curves(bands: dict, ks, out: str, title: str = "", ylabel: str = "EM (held-out, greedy)") -> str:
    """One panel per Qk: each arm's held-out score (EM unless `ylabel` says otherwise) over
    steps, its mean as a line and ± std over seeds as a band. `bands`: {arm: {"Q2":
    {"steps", "mean", "std"}, ...}}."""
    matplotlib = matplotlib_module()
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(ks), figsize=(4.2 * len(ks), 3.4), squeeze=False)
    for ax, k in zip(axes.flat, ks):
        for arm, band in bands.items():
            b = band[f"Q{k}"]
            lo = [m - s for m, s in zip(b["mean"], b["std"])]
            hi = [m + s for m, s in zip(b["mean"], b["std"])]
            (line,) = ax.plot(b["steps"], b["mean"], marker="o", ms=3, label=arm)
            ax.fill_between(b["steps"], lo, hi, color=line.get_color(), alpha=0.15)
        ax.set_title(f"Q{k}")
        ax.set_xlabel("training step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    save_png(fig, out)
    plt.close(fig)
    return out


def plot_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="memopd plot", description=__doc__.splitlines()[0])
    p.add_argument("run_dir")
    p.add_argument("--out", help="PNG path (default RUN_DIR/curves.png)")
    args = p.parse_args(argv)
    path = plot_run(args.run_dir, args.out)
    print(f"wrote {path}")
    return 0
