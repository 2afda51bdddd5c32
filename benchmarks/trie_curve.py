"""The trie layout against one prefix per group: token ratios and actor-step times over
group size and call-0 context length, and the table of the packing benchmark's 9
configurations with the trie beside ind/shared.

    python benchmarks/trie_curve.py                       # the curve (tokens + timed grid)
    python benchmarks/trie_curve.py --configs SUMMARY.json  # the 9-configuration table of a
                                                            # `pytest benchmarks/bench_packing.py` summary

Trajectories: `bench_packing.qa_shaped_trajectories` (Q8-shaped expert episodes, summary
memory) whose rollouts of one group also share an initial context x_0 of `context0` ids
(documents given with the question; the expert shape has none, x_0 = []). Under summary
memory x_0 is only in call 0, so what the trie saves beyond the shared layout is each
group's call-0 context (group size - 1 copies of it) plus the `<mem>` span and notes
that later calls of an episode start with.

Tokens (independent incl. padding, `aligned` with share_prefix="group", `trie`) are counted
on a wide grid (no model). Times: one actor forward + backward per layout, measured as the
packing benchmark measures it (`bench_packing.measure_config`: an untimed log-prob check
against independent, then interleaved rounds on the process CPU clock, one thread) on a
smaller grid. Writes benchmarks/results/trie_curve.{json,md} (or `--out PREFIX`).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (HERE, ROOT):
    if _p not in sys.path:
        sys.path.insert(0, _p)


def _ints(raw: str) -> list[int]:
    return [int(v) for v in raw.split(",") if v.strip()]


def token_rows(k: int, batch: int, groups: list[int], contexts: list[int]) -> list[dict]:
    from bench_packing import qa_shaped_trajectories

    from memopd import pack

    rows = []
    for g in groups:
        for c in contexts:
            trajs = qa_shaped_trajectories(k, batch, group_size=g, seed=batch, context0_len=c or None)
            ind = pack(trajs, "independent", max_tokens=1 << 20).num_tokens
            real = sum(len(inv.input_ids) for tr in trajs for inv in tr.invocations)
            shr = pack(trajs, "aligned", max_tokens=4096, share_prefix="group").num_tokens
            trie = pack(trajs, "trie", max_tokens=4096).num_tokens
            rows.append({"group_size": g, "context0": c, "calls": sum(len(t) for t in trajs), "unpadded": real,
                         "shared": shr, "trie": trie, "shared_over_trie": round(shr / trie, 3),
                         "unpadded_over_trie": round(real / trie, 3), "independent_padded_one_row": ind})
    return rows


def timed_rows(k: int, batch: int, groups: list[int], contexts: list[int], rounds: int) -> tuple[list[dict], str]:
    from bench_packing import CLOCK, make_setup, measure_config

    setup = make_setup()
    rows = []
    for g in groups:
        for c in contexts:
            recs = measure_config(setup, k, batch, rounds, group_size=g, context0_len=c or None,
                                  layouts=("independent", "aligned_shared", "trie"))
            ind = recs["independent"]
            row = {"group_size": g, "context0": c, "calls": ind["calls"], "clock": CLOCK}
            for lay, r in recs.items():
                row[lay] = {"tokens": r["tokens"], "median_s": r["median_s"], "times_s": r["times_s"],
                            "logprob_max_abs_diff": r["logprob_max_abs_diff"]}
                if r["logprob_max_abs_diff"] > r["logprob_tol"]:
                    raise AssertionError(f"g{g} x0={c}: {lay} log-probs differ from independent by "
                                         f"{r['logprob_max_abs_diff']:.3g}")
            for lay in ("aligned_shared", "trie"):
                row[f"ind_over_{lay}"] = round(ind["median_s"] / recs[lay]["median_s"], 3)
                row[f"token_ratio_{lay}"] = round(ind["tokens"] / recs[lay]["tokens"], 3)
            row["shared_over_trie_time"] = round(recs["aligned_shared"]["median_s"] / recs["trie"]["median_s"], 3)
            row["shared_over_trie_paired"] = [round(a / b, 3) for a, b in zip(recs["aligned_shared"]["times_s"],
                                                                             recs["trie"]["times_s"])]
            row["loadavg"] = ind["rounds"].get("loadavg")
            rows.append(row)
            print(f"g{g} x0={c}: tokens ind/shr/trie {ind['tokens']}/{row['aligned_shared']['tokens']}/"
                  f"{row['trie']['tokens']}, ind/shr {row['ind_over_aligned_shared']}x, ind/trie "
                  f"{row['ind_over_trie']}x, shr/trie {row['shared_over_trie_time']}x", flush=True)
    return rows, setup.name


def curve_md(tok: list[dict], timed: list[dict], meta: dict) -> str:
    out = [f"# Trie vs one prefix per group: {meta['shape']}", "",
           "## Tokens (no model; budget 4096 per row)", "",
           "| group size | call-0 context | calls | unpadded tokens | shared (aligned, group prefix) | trie | "
           "shared / trie | unpadded / trie |", "|---|---|---|---|---|---|---|---|"]
    for r in tok:
        out.append(f"| {r['group_size']} | {r['context0']} | {r['calls']} | {r['unpadded']} | {r['shared']} | "
                   f"{r['trie']} | {r['shared_over_trie']:.2f}x | {r['unpadded_over_trie']:.2f}x |")
    if timed:
        out += ["", f"## Actor step (forward + backward), {meta['model']}, {meta['clock']} clock, "
                f"{meta['rounds']} interleaved rounds, {meta['threads']} thread", "",
                "| group size | call-0 context | tokens ind / shr / trie | s ind | s shr | s trie | ind/shr | "
                "**ind/trie** | shr/trie (per round) | token ratio shr/trie | max abs dlogp | load |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in timed:
            loads = [v for v in (r.get("loadavg") or []) if v is not None]
            dlp = max(r[lay]["logprob_max_abs_diff"] for lay in ("aligned_shared", "trie"))
            paired = r["shared_over_trie_paired"]
            out.append(
                f"| {r['group_size']} | {r['context0']} | {r['independent']['tokens']} / "
                f"{r['aligned_shared']['tokens']} / {r['trie']['tokens']} | {r['independent']['median_s']:.3f} | "
                f"{r['aligned_shared']['median_s']:.3f} | {r['trie']['median_s']:.3f} | "
                f"{r['ind_over_aligned_shared']:.2f}x | **{r['ind_over_trie']:.2f}x** | "
                f"{r['shared_over_trie_time']:.2f}x ({min(paired):.2f}-{max(paired):.2f}) | "
                f"{r['aligned_shared']['tokens'] / r['trie']['tokens']:.2f} | {dlp:.1e} | "
                f"{'-' if not loads else f'{min(loads):.1f}-{max(loads):.1f}'} |")
    return "\n".join(out) + "\n"


def configs_md(summary: dict) -> str:
    """The 9-configuration table of a bench_packing summary, trie beside ind/shared."""
    out = [f"# Packing benchmark: trie beside ind/shared ({summary['model']}, {summary['clock']} clock, "
           f"{summary['cpu_threads']} thread, {summary['rounds']} interleaved rounds, commit {summary['commit']})", "",
           "| config | tokens ind / shr / trie | token ratio ind/shr | token ratio ind/trie | s ind | s shr | s trie | "
           "ind/shr | **ind/trie** | shr/trie | max abs dlogp | load |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in summary["configs"]:
        loads = [v for v in (r.get("loadavg") or []) if v is not None]
        dlp = max(r[lay]["logprob_max_abs_diff"] for lay in ("aligned", "aligned_shared", "trie"))
        out.append(
            f"| {r['config']} | {r['independent']['tokens']} / {r['aligned_shared']['tokens']} / {r['trie']['tokens']} | "
            f"{r['token_ratio_aligned_shared']:.2f} | {r['token_ratio_trie']:.2f} | {r['independent']['median_s']:.3f} | "
            f"{r['aligned_shared']['median_s']:.3f} | {r['trie']['median_s']:.3f} | {r['speedup_aligned_shared']:.2f}x | "
            f"**{r['speedup_trie']:.2f}x** | "
            f"{r['aligned_shared']['median_s'] / r['trie']['median_s']:.2f}x | {dlp:.1e} | "
            f"{'-' if not loads else f'{min(loads):.1f}-{max(loads):.1f}'} |")
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--k", type=int, default=8, help="questions per episode (default 8)")
    ap.add_argument("--batch", type=int, default=16, help="trajectories per batch for the token grid (default 16)")
    ap.add_argument("--groups", default="1,2,4,8,16", help="group sizes of the token grid")
    ap.add_argument("--contexts", default="0,64,256,1024", help="call-0 context lengths of the token grid")
    ap.add_argument("--time-batch", type=int, default=8, help="trajectories per timed batch (default 8)")
    ap.add_argument("--time-groups", default="2,4,8", help="group sizes timed")
    ap.add_argument("--time-contexts", default="0,128,512", help="call-0 context lengths timed")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    ap.add_argument("--no-time", action="store_true", help="tokens only")
    ap.add_argument("--configs", default=None, help="write the 9-configuration table of this bench_packing summary")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "trie_curve"), help="output prefix (.json, .md)")
    args = ap.parse_args()
    if args.configs:
        with open(args.configs) as f:
            summary = json.load(f)
        with open(args.out + ".md", "w") as f:
            f.write(configs_md(summary))
        print(configs_md(summary))
        return
    import torch

    tok = token_rows(args.k, args.batch, _ints(args.groups), _ints(args.contexts))
    timed, model = ([], None) if args.no_time else timed_rows(args.k, args.time_batch, _ints(args.time_groups),
                                                             _ints(args.time_contexts), args.rounds)
    meta = {"shape": f"Q{args.k}-shaped episodes, summary memory, {args.batch} trajectories (tokens) / "
                     f"{args.time_batch} (times)", "model": model, "clock": timed[0]["clock"] if timed else None,
            "rounds": args.rounds, "threads": torch.get_num_threads(),
            "loadavg_at_end": os.getloadavg()[0]}
    with open(args.out + ".json", "w") as f:
        json.dump({**meta, "tokens": tok, "timed": timed}, f, indent=1)
    md = curve_md(tok, timed, meta)
    with open(args.out + ".md", "w") as f:
        f.write(md)
    print(md)
    if timed:
        print("median shared/trie time over the timed grid:",
              statistics.median(r["shared_over_trie_time"] for r in timed))


if __name__ == "__main__":
    main()
