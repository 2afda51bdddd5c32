"""Speed and peak memory of `memopd.pack` itself, the array compiler against the list-building
reference it replaced, side by side in one run.

    python benchmarks/bench_pack_speed.py                      # 1k, 10k, 100k calls, every layout
    python benchmarks/bench_pack_speed.py --calls 1000,10000 --layouts aligned --json out.json

Trajectories: Q8-shaped expert episodes (`bench_packing.qa_shaped_trajectories`, summary
memory, groups of 4, provenance and sampling log-probs on every call, ~36 context and ~20
action ids per call), drawn once per size and pickled; each measurement then runs in a
fresh process that unpickles them, so no contender inherits another's heap. In that
process, after one call on 8 trajectories (first-use costs), `pack(..., validate=True)`
(the default) runs once for the peak memory
(`_fresh_process.measure_call`: peak RSS above the RSS right before the call, the
counter reset through /proc/self/clear_refs), then `--repeats` more times for the time,
the median of all runs on the process CPU clock with one torch thread. For each
configuration the new compiler runs first, then the reference. `aligned` runs with
share_prefix="group"; `naive` rows use action_domain="naive". Reported per configuration:
µs per call, peak bytes per packed token, the returned tensors' bytes per packed token and
the peak over them, for the reference (`old`) and `memopd.pack` (`new`); and that both
returned the same batch (a checksum of every tensor). The `trie` layout postdates the
reference: its rows have the new compiler alone.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _paths() -> None:
    """This checkout's memopd, the benchmark helpers and the reference compiler (tests/)."""
    for path in (HERE, os.path.join(ROOT, "tests"), ROOT):
        if path not in sys.path:
            sys.path.insert(0, path)

CONFIGS = {  # name: (layout, pack keywords)
    "aligned": ("aligned", {"share_prefix": "group"}),
    "aligned_unshared": ("aligned_unshared", {}),
    "independent": ("independent", {}),
    "flatten": ("flatten", {}),
    "aligned-naive": ("aligned", {"share_prefix": "group", "action_domain": "naive"}),
    "trie": ("trie", {}),
}
# layouts the list-building reference never had: `memopd.pack` alone (no old column)
NEW_ONLY = ("trie",)
MAX_TOKENS = 16384


def _trajectories(calls: int, path: str) -> int:
    from bench_packing import qa_shaped_trajectories

    trajs, n = [], 0
    seed = 0
    while n < calls:
        batch = qa_shaped_trajectories(8, 64, seed=seed)
        for tr in batch:
            if n >= calls:
                break
            keep = tr.invocations[: calls - n]
            tr.invocations = keep
            trajs.append(tr)
            n += len(keep)
        seed += 1
    with open(path, "wb") as f:
        pickle.dump(trajs, f, protocol=pickle.HIGHEST_PROTOCOL)
    return n


def _batch_bytes(batch) -> int:
    import torch

    return sum(v.numel() * v.element_size() for obj in (batch, batch.attn) for v in vars(obj).values()
               if isinstance(v, torch.Tensor))


def _checksum(batch) -> str:
    import torch

    h = hashlib.sha256()
    for obj in (batch, batch.attn):
        for k, v in sorted(vars(obj).items()):
            if isinstance(v, torch.Tensor):
                h.update(k.encode() + str(v.dtype).encode() + v.contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _child(path: str, config: str, impl: str, repeats: int) -> dict:
    import ctypes

    import torch

    torch.set_num_threads(1)
    from _fresh_process import measure_call
    from _pack_reference import reference_pack

    from memopd.packing import pack

    with open(path, "rb") as f:
        trajs = pickle.load(f)
    layout, kw = CONFIGS[config]
    fn = pack if impl == "new" else reference_pack
    fn(trajs[:8], layout=layout, max_tokens=MAX_TOKENS, **kw)  # first-use costs (lazy imports, allocator pools)
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    batch, m = measure_call(lambda: fn(trajs, layout=layout, max_tokens=MAX_TOKENS, **kw))
    times = [m["cpu_s"]]
    info = {"tokens": batch.num_tokens, "calls": sum(len(t) for t in trajs), "bytes": _batch_bytes(batch),
            "checksum": _checksum(batch), "peak_bytes": m["peak_kb"] * 1024}
    del batch
    for _ in range(repeats):
        t0 = time.process_time()
        fn(trajs, layout=layout, max_tokens=MAX_TOKENS, **kw)
        times.append(time.process_time() - t0)
    info["cpu_s"] = times
    return info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", default="1000,10000,100000", help="comma-separated batch sizes in calls")
    ap.add_argument("--layouts", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    ap.add_argument("--repeats", type=int, default=None, help="timed runs after the first (default: 6 up to 2k calls, else 3)")
    ap.add_argument("--json", default=None, help="write the rows here too")
    ap.add_argument("--child", nargs=4, metavar=("PATH", "CONFIG", "IMPL", "REPEATS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    _paths()
    if args.child:
        path, config, impl, repeats = args.child
        print(json.dumps(_child(path, config, impl, int(repeats))))
        return
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    rows = []
    print(f"clock: process CPU time, 1 thread; load average at start {os.getloadavg()[0]:.2f}")
    print(f"{'config':<17} {'calls':>7} {'tok/call':>8} | {'us/call old':>11} {'new':>6} {'x':>5} | "
          f"{'peak B/tok old':>14} {'new':>6} | {'out B/tok':>9} | {'peak/out old':>12} {'new':>5} | same")
    with tempfile.TemporaryDirectory() as tmp:
        for calls in (int(c) for c in args.calls.split(",")):
            path = os.path.join(tmp, f"trajs{calls}.pkl")
            n = _trajectories(calls, path)
            repeats = args.repeats if args.repeats is not None else (6 if n <= 2000 else 3)
            for config in args.layouts.split(","):
                res = {}
                for impl in ("new",) if CONFIGS[config][0] in NEW_ONLY else ("new", "old"):
                    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", path, config, impl,
                                          str(repeats)], capture_output=True, text=True, env=env, check=False)
                    if out.returncode:
                        sys.exit(f"{config} {impl} {calls} calls failed:\n{out.stderr[-3000:]}")
                    res[impl] = json.loads(out.stdout.strip().splitlines()[-1])
                w = res["new"]
                o = res.get("old")
                T = w["tokens"]
                us = {k: statistics.median(r["cpu_s"]) / n * 1e6 for k, r in res.items()}
                row = {"config": config, "calls": n, "tokens": T, "load": os.getloadavg()[0],
                       "us_per_call": us, "peak_bytes_per_token": {k: r["peak_bytes"] / T for k, r in res.items()},
                       "out_bytes_per_token": w["bytes"] / T, "peak_over_out": {k: r["peak_bytes"] / r["bytes"] for k, r in res.items()},
                       "same_batch": None if o is None else o["checksum"] == w["checksum"],
                       "cpu_s": {k: r["cpu_s"] for k, r in res.items()}}
                rows.append(row)

                def old(v, fmt, o=o):
                    return format(v, fmt) if o is not None else "-"

                print(f"{config:<17} {n:>7} {T / n:>8.1f} | {old(us.get('old'), '>11.1f'):>11} {us['new']:>6.1f} "
                      f"{old(o and us['old'] / us['new'], '>5.1f'):>5} | "
                      f"{old(row['peak_bytes_per_token'].get('old'), '>14.0f'):>14} "
                      f"{row['peak_bytes_per_token']['new']:>6.0f} | "
                      f"{row['out_bytes_per_token']:>9.1f} | {old(row['peak_over_out'].get('old'), '>12.2f'):>12} "
                      f"{row['peak_over_out']['new']:>5.2f} | "
                      f"{'-' if o is None else 'yes' if row['same_batch'] else 'NO'}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if not all(r["same_batch"] is not False for r in rows):
        sys.exit("the two compilers returned different batches")


if __name__ == "__main__":
    main()
