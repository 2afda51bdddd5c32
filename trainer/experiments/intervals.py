"""The statistics the experiments report: paired bootstrap intervals over held-out sets
(and seeds), Student t intervals over per-seed differences, the minimal detectable effect,
relative changes and the area under a learning curve. Plain numpy and math, no torch.
"""
from __future__ import annotations

import math
import statistics

import numpy as np

__all__ = ["BOOTSTRAP_SEED", "BOOTSTRAP_DRAWS", "BOOTSTRAP_LEVEL", "MDE_ALPHA", "MDE_POWER", "paired_bootstrap",
           "relative_change", "bootstrap_seeds_sets", "minimal_detectable_effect", "t_interval", "student_t_cdf",
           "student_t_quantile", "curve_area"]

BOOTSTRAP_SEED = 0
BOOTSTRAP_DRAWS = 10000
BOOTSTRAP_LEVEL = 0.95
MDE_ALPHA = 0.05
MDE_POWER = 0.8


def paired_bootstrap(a, b, *, draws: int = BOOTSTRAP_DRAWS, seed: int = BOOTSTRAP_SEED, level: float = 0.95) -> dict:
    """Mean difference a − b and its percentile bootstrap interval, resampling the sets only
    (the paper protocol's intervals): `bootstrap_seeds_sets` with the seeds held fixed.

    `a`, `b`: [seeds, sets] per-set scores of two arms on the same held-out sets and
    seeds. Each draw resamples the sets with replacement and applies the same draw to
    both arms and to every seed (the pairing); the statistic is the mean over seeds and
    drawn sets. Seeds are not resampled: their spread is reported as the std."""
    return bootstrap_seeds_sets(a, b, draws=draws, seed=seed, level=level, resample_seeds=False)


def relative_change(new: float, base: float) -> float | None:
    """100 · (new − base) / base, the paper's "+x% over" form; None when base is 0."""
    return None if base == 0 else 100.0 * (new - base) / base


def bootstrap_seeds_sets(a, b, *, draws: int = BOOTSTRAP_DRAWS, seed: int = BOOTSTRAP_SEED,
                         level: float = BOOTSTRAP_LEVEL, resample_seeds: bool = True) -> dict:
    """Mean difference a − b and its percentile bootstrap interval, resampling seeds and
    sets. `a`, `b`: [seeds, sets] scores of two arms, row s of both from seed s, column j
    from set j (a [seeds] vector is one score per seed). Each draw resamples the seeds and
    the sets with replacement and applies both draws to both arms: the pairing by seed
    and by set. The statistic is the mean over the drawn seeds and sets, computed from the
    draw counts (w_seeds · (a − b) · w_sets / (S · N)). `resample_seeds=False` keeps every
    seed in every draw (`paired_bootstrap`)."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.ndim == 1 and resample_seeds:  # one score per seed (without seeds to resample: no sets either)
        a, b = a[:, None], b[:, None] if b.ndim == 1 else b
    if a.ndim != 2 or a.shape != b.shape or a.size == 0:
        name = "bootstrap_seeds_sets" if resample_seeds else "paired_bootstrap"
        raise ValueError(f"{name} needs two [seeds, sets] arrays of one shape, got {a.shape} and {b.shape}")
    if not 0 < level < 1 or draws < 1:
        raise ValueError(f"level must be in (0, 1) and draws >= 1, got {level}, {draws}")
    d = a - b
    S, N = d.shape
    rng = np.random.default_rng(seed)
    if resample_seeds:
        ws = np.stack([np.bincount(r, minlength=S) for r in rng.integers(0, S, size=(draws, S))]).astype(np.float64)
    else:
        ws = np.ones((draws, S))
    wn = np.stack([np.bincount(r, minlength=N) for r in rng.integers(0, N, size=(draws, N))]).astype(np.float64)
    stats = np.einsum("ds,sn,dn->d", ws, d, wn) / (S * N)
    lo, hi = np.quantile(stats, [(1 - level) / 2, 1 - (1 - level) / 2])
    per_seed = d.mean(axis=1)
    return {"diff": float(d.mean()), "lo": float(lo), "hi": float(hi), "level": level, "draws": draws, "seed": seed,
            "seeds": S, "sets": N, "per_seed": [float(x) for x in per_seed],
            "positive_seeds": int((per_seed > 0).sum())}


def minimal_detectable_effect(per_seed_diffs, *, alpha: float = MDE_ALPHA, power: float = MDE_POWER,
                              seeds: int | None = None) -> float | None:
    """The smallest true mean difference a two-sided paired t-test at `alpha` detects with
    probability `power` over `seeds` seeds (default: as many as given), taking the spread
    of the per-seed differences given as the truth: (t_{1-α/2} + t_{power}) · sd / √n with
    n − 1 degrees of freedom. None with fewer than two seeds."""
    d = np.asarray(per_seed_diffs, dtype=np.float64)
    n = int(seeds if seeds is not None else d.size)
    if d.size < 2 or n < 2:
        return None
    sd = float(d.std(ddof=1))
    return float((student_t_quantile(1 - alpha / 2, n - 1) + student_t_quantile(power, n - 1)) * sd / np.sqrt(n))


def t_interval(per_seed, level: float = BOOTSTRAP_LEVEL) -> dict:
    """Mean of per-seed values (differences) and its Student t interval over them:
    mean ± t_{(1+level)/2, n-1} · sd / √n. Needs two seeds or more."""
    xs = [float(x) for x in per_seed]
    n = len(xs)
    if n < 2:
        raise ValueError(f"a t-interval needs at least two seeds, got {n}")
    m, sd = statistics.mean(xs), statistics.stdev(xs)
    h = student_t_quantile(1 - (1 - level) / 2, n - 1) * sd / math.sqrt(n)
    return {"mean": m, "lo": m - h, "hi": m + h, "sd": sd, "n": n, "level": level}


def student_t_cdf(x: float, df: int) -> float:
    """P(T <= x) for Student's t with an integer `df` >= 1, in closed form (the finite
    series in θ = atan(x/√df) of Abramowitz & Stegun 26.7.3-4), so that the replication's
    statistics need no scipy."""
    if int(df) != df or df < 1:
        raise ValueError(f"student_t_cdf: df must be a positive integer, got {df!r}")
    df = int(df)
    theta = math.atan(x / math.sqrt(df))
    s, c2 = math.sin(theta), math.cos(theta) ** 2
    if df % 2 == 0:  # A = sinθ (1 + ½cos²θ + (1·3)/(2·4) cos⁴θ + ... up to cos^(df-2)θ)
        term, total = 1.0, 1.0
        for k in range(2, df - 1, 2):
            term *= c2 * (k - 1) / k
            total += term
        a = s * total
    else:  # A = (2/π)(θ + sinθ cosθ (1 + (2/3)cos²θ + ... up to cos^(df-3)θ)); df = 1: 2θ/π
        total = 0.0
        if df > 1:
            term, total = 1.0, 1.0
            for k in range(3, df - 1, 2):
                term *= c2 * (k - 1) / k
                total += term
        a = 2 / math.pi * (theta + s * math.cos(theta) * total)
    return 0.5 + 0.5 * a


def student_t_quantile(p: float, df: int) -> float:
    """The x with P(T <= x) = p for Student's t with an integer `df` >= 1 (bisection on
    `student_t_cdf` to float precision)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"student_t_quantile: p must lie in (0, 1), got {p!r}")
    if p < 0.5:
        return -student_t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while student_t_cdf(hi, df) < p:
        lo, hi = hi, hi * 2.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if mid in (lo, hi):
            break
        lo, hi = (mid, hi) if student_t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


def curve_area(points) -> float:
    """The area under a curve [(step, score), ...] (trapezoid) divided by its span of
    steps: the mean score over training. One point: that score."""
    pts = sorted(dict(points).items())
    if not pts:
        raise ValueError("an empty curve has no area")
    if len(pts) == 1:
        return float(pts[0][1])
    xs = np.array([p[0] for p in pts], dtype=np.float64)
    ys = np.array([p[1] for p in pts], dtype=np.float64)
    return float(np.sum((xs[1:] - xs[:-1]) * (ys[1:] + ys[:-1]) / 2) / (xs[-1] - xs[0]))
