"""Rollout Context Equivalence (RCE) audit (docs/design.md §4).

For every action token, compare the full-vocabulary logits of a packed forward with
those of an independent forward of that call alone (`[q, x_t, a_t]`, positions 0..).
Reported per layout: max L-inf of the logits, max and p99 |delta log-prob| of the
sampled tokens, top-1 changes, and the fraction of tokens whose PPO ratio
`exp(logp_packed - logp_reference)` leaves [0.8, 1.2]; for `flatten` also the spurious
decision positions of the naive action domain. Two ablations of the aligned layout
show which half of the sampling state matters: restored visibility with row-global
positions (`positions_broken`) and restored positions with plain causal visibility over
the row (`visibility_broken`).

Logits are formed chunk by chunk from hidden states, so the audit never holds
[action tokens x vocab] for a large vocabulary.

The sampler audit compares what a real sampler recorded (`Invocation.sample_logprobs`,
e.g. vLLM's) with the model's log-probs of the same tokens restored by a packed forward
(`restored_logprobs`): per layout, max and mean |d| (d = log p_restored - log p_sampler),
the k3 estimate of KL(sampler || restored), mean((exp(d) - 1) - d), and the share of
tokens with |d| over a threshold (`mismatch_sums` / `mismatch_figures`, also the
trainer's per-step `mismatch/*` metrics).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Sequence

import torch

from .hf import independent_forward, lm_head_of, packed_forward
from .layout import AttentionMeta, PackedBatch, SegmentKind
from .packing import pack
from .records import RecordError, Trajectory

__all__ = ["RCEResult", "audit", "default_tolerance", "VARIANTS", "BROKEN_VARIANTS", "broken_batch", "format_table",
           "restored_logprobs", "mismatch_sums", "mismatch_figures", "sampler_audit", "format_sampler_audit"]

VARIANTS = (
    "aligned",
    "aligned_group",
    "aligned_unshared",
    "trie",
    "flatten",
    "positions_broken",
    "visibility_broken",
)
# which variants must pass (the restored states); the others are there to fail
MUST_PASS = ("aligned", "aligned_group", "aligned_unshared", "trie")


def default_tolerance(dtype: torch.dtype) -> float:
    return {torch.float64: 1e-8, torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}.get(dtype, 1e-4)


@dataclass
class RCEResult:
    variant: str
    actions: int
    max_logit_linf: float
    max_dlogp: float
    p99_dlogp: float
    top1_changes: int
    ratio_out_frac: float
    spurious_positions: int | None
    tolerance: float
    must_pass: bool

    @property
    def passed(self) -> bool:
        return self.max_logit_linf <= self.tolerance

    def to_dict(self) -> dict:
        d = asdict(self)
        d["passed"] = self.passed
        return d


def _row_positions(batch: PackedBatch) -> PackedBatch:
    """Aligned visibility, but positions counted 0.. along each row (not restored)."""
    pos = torch.empty_like(batch.position_ids)
    for r, n in enumerate(batch.row_lengths):
        s = int(batch.cu_rows[r])
        pos[s : s + n] = torch.arange(n)
    return replace(batch, position_ids=pos)


def _row_causal(batch: PackedBatch) -> PackedBatch:
    """Restored positions, but plain causal attention over each whole row."""
    n = batch.num_rows
    meta = AttentionMeta.from_segments(batch.cu_rows, [-1] * n, [SegmentKind.HISTORY] * n)
    return replace(batch, attn=meta.to(batch.input_ids.device))


# the two ablations of the aligned layout, by name (also the teacher states of the
# negative-control arms, trainer/config.py)
BROKEN_VARIANTS = ("positions_broken", "visibility_broken")


def broken_batch(batch: PackedBatch, variant: str) -> PackedBatch:
    """An aligned `batch` with one half of its sampling state broken (`BROKEN_VARIANTS`):
    row-global positions, or plain causal visibility over each row."""
    if variant == "positions_broken":
        return _row_positions(batch)
    if variant == "visibility_broken":
        return _row_causal(batch)
    raise ValueError(f"unknown broken variant {variant!r}; choose from {', '.join(BROKEN_VARIANTS)}")


def _reference_hidden(model, trajs: Sequence[Trajectory]) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    """Hidden states [A, H] predicting each action token in an independent forward."""
    rows = []
    keys = []
    for b, tr in enumerate(trajs):
        for t, inv in enumerate(tr.invocations):
            h = independent_forward(model, inv.input_ids, output="hidden")
            start = len(inv.prefix_ids) + len(inv.context_ids) - 1
            rows.append(h[start : start + len(inv.action_ids)])
            keys += [(b, t, k) for k in range(len(inv.action_ids))]
    return torch.cat(rows), keys


def _compare(head, h_pack, h_ref, targets, chunk: int = 256) -> dict:
    linf = 0.0
    dlogps = []
    top1 = 0
    out = 0
    for s in range(0, h_ref.shape[0], chunk):
        lp_pack = head(h_pack[s : s + chunk]).float()
        lp_ref = head(h_ref[s : s + chunk]).float()
        linf = max(linf, float((lp_pack - lp_ref).abs().max()))
        top1 += int((lp_pack.argmax(-1) != lp_ref.argmax(-1)).sum())
        y = targets[s : s + chunk].unsqueeze(1)
        a = torch.log_softmax(lp_pack, -1).gather(1, y).squeeze(1)
        b = torch.log_softmax(lp_ref, -1).gather(1, y).squeeze(1)
        d = a - b
        dlogps.append(d.abs())
        ratio = torch.exp(d)
        out += int(((ratio < 0.8) | (ratio > 1.2)).sum())
    dl = torch.cat(dlogps).double()
    n = dl.numel()
    return {
        "max_logit_linf": linf,
        "max_dlogp": float(dl.max()) if n else 0.0,
        "p99_dlogp": float(torch.quantile(dl, 0.99)) if n else 0.0,
        "top1_changes": top1,
        "ratio_out_frac": out / max(1, n),
    }


@torch.no_grad()
def audit(
    model,
    trajectories: Sequence[Trajectory],
    variants: Sequence[str] = VARIANTS,
    *,
    max_tokens: int = 8192,
    tolerance: float | None = None,
    attention_backend: str = "auto",
) -> list[RCEResult]:
    """Run the RCE audit of `variants` (see `VARIANTS`) and return one result each."""
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown audit variants {unknown}; choose from {', '.join(VARIANTS)}")
    trajectories = list(trajectories)
    if not trajectories:
        raise RecordError("no trajectories to audit")
    vocab = lm_head_of(model).weight.shape[0]
    for tr in trajectories:
        tr.validate(vocab_size=vocab)
    was_training = model.training
    model.eval()
    dtype = next(model.parameters()).dtype
    tol = default_tolerance(dtype) if tolerance is None else tolerance
    head = lm_head_of(model)
    try:
        h_ref, keys = _reference_hidden(model, trajectories)
        results = []
        for v in variants:
            if v == "aligned":
                batch = pack(trajectories, "aligned", max_tokens)
            elif v == "aligned_group":
                batch = pack(trajectories, "aligned", max_tokens, share_prefix="group")
            elif v == "aligned_unshared":
                batch = pack(trajectories, "aligned_unshared", max_tokens)
            elif v == "trie":
                batch = pack(trajectories, "trie", max_tokens)
            elif v == "flatten":
                batch = pack(trajectories, "flatten", max_tokens)
            else:
                batch = broken_batch(pack(trajectories, "aligned", max_tokens), v)
            got = list(zip(batch.traj_index.tolist(), batch.call_index.tolist(), batch.token_index.tolist()))
            if got != keys:  # both are in (trajectory, call, k) order by contract
                raise RuntimeError("packed batch and reference disagree on the action order")
            h_pack = packed_forward(model, batch, output="hidden", attention_backend=attention_backend)
            targets = batch.target_ids.to(h_pack.device)
            m = _compare(head, h_pack, h_ref, targets)
            spurious = None
            if batch.naive_action_mask is not None:
                spurious = int(batch.naive_action_mask.sum()) - int(batch.action_mask.sum())
            results.append(
                RCEResult(variant=v, actions=len(keys), spurious_positions=spurious, tolerance=tol,
                          must_pass=v in MUST_PASS, **m)
            )
        return results
    finally:
        model.train(was_training)


def _fmt(x: float) -> str:
    if x == 0:
        return "0"
    return f"{x:.2e}" if (abs(x) < 1e-2 or abs(x) >= 1e3) else f"{x:.3f}"


def format_table(results: Sequence[RCEResult], title: str = "") -> str:
    """Plain-text table of audit results (one line per variant)."""
    head = ["layout", "actions", "max|dlogits|", "max|dlogp|", "p99|dlogp|", "top1 chg", "ratio out", "spurious", "verdict"]
    rows = []
    for r in results:
        verdict = ("PASS" if r.passed else "FAIL") if r.must_pass else ("fails (expected)" if not r.passed else "passes?!")
        rows.append([
            r.variant, str(r.actions), _fmt(r.max_logit_linf), _fmt(r.max_dlogp), _fmt(r.p99_dlogp),
            str(r.top1_changes), f"{100 * r.ratio_out_frac:.1f}%", "-" if r.spurious_positions is None else str(r.spurious_positions),
            verdict,
        ])
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths))  # noqa: E731
    out = []
    if title:
        out.append(title)
    out.append(line(head))
    out.append(line(["-" * w for w in widths]))
    out += [line(r) for r in rows]
    if results:
        out.append(f"(tolerance {results[0].tolerance:g} on max|dlogits|; ratio = exp(logp_packed - logp_independent))")
    return "\n".join(out)


# ---------------------------------------------------------------------- sampler audit


@torch.no_grad()
def restored_logprobs(model, trajectories: Sequence[Trajectory], layout: str = "aligned", *, temperature: float = 1.0,
                      vocab_size: int | None = None, max_tokens: int = 8192,
                      attention_backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs [A], recorded sampler log-probs [A], NaN where none) of every action token
    in (trajectory, call, k) order: the model's log_softmax(logits[:vocab_size] /
    temperature) at the sampled id, from a packed forward in `layout` ("aligned": each
    call's own restored state; "flatten": the persistent history)."""
    from .hf import head_of
    from .ops import fused_linear_logprob_entropy

    batch = pack(trajectories, layout, max_tokens, share_prefix="group")
    head = head_of(model)
    V = vocab_size or int(head.weight.shape[0])
    was_training = model.training
    model.eval()
    try:
        parts, ids = [], []
        for mb in batch.micro_batches(max_tokens):
            h = packed_forward(model, mb, output="hidden", attention_backend=attention_backend)
            lp = fused_linear_logprob_entropy(h, head.weight, mb.target_ids.to(h.device), bias=head.bias,
                                              temperature=temperature / head.scale, vocab_size=V).logprobs
            parts.append(lp.float().cpu())
            ids.append(mb.action_id.cpu())
    finally:
        model.train(was_training)
    order = torch.cat(ids).argsort()
    return torch.cat(parts)[order], batch.sample_logprobs.float().cpu()


def mismatch_sums(logp: torch.Tensor, logp_sampler: torch.Tensor, threshold: float = 1e-3) -> dict:
    """Sums over the tokens with a recorded sampler log-prob (NaN: none) of d = logp -
    logp_sampler: count n, sum |d|, max |d|, sum of k3 = (exp(d) - 1) - d, and the count
    of |d| > threshold. Sums, so that ranks or batches add them before `mismatch_figures`."""
    if logp.shape != logp_sampler.shape:
        raise ValueError(f"logp has shape {tuple(logp.shape)}, logp_sampler {tuple(logp_sampler.shape)}")
    d = logp.double().cpu() - logp_sampler.double().cpu()
    d = d[~torch.isnan(d)]
    return {"n": float(d.numel()), "abs_sum": float(d.abs().sum()), "abs_max": float(d.abs().max()) if d.numel() else 0.0,
            "k3_sum": float((torch.expm1(d) - d).sum()), "over": float((d.abs() > threshold).sum())}


def mismatch_figures(sums: dict, prefix: str = "mismatch") -> dict:
    """`{prefix}/max_abs_dlogp, mean_abs_dlogp, k3_kl, share_over_threshold` from (summed)
    `mismatch_sums`; NaN where no token has a recorded log-prob."""
    n = sums["n"]
    keys = ("max_abs_dlogp", "mean_abs_dlogp", "k3_kl", "share_over_threshold")
    if n <= 0:
        return {f"{prefix}/{k}": float("nan") for k in keys}
    vals = (sums["abs_max"], sums["abs_sum"] / n, sums["k3_sum"] / n, sums["over"] / n)
    return {f"{prefix}/{k}": v for k, v in zip(keys, vals)}


def sampler_audit(model, trajectories: Sequence[Trajectory], layouts: Sequence[str] = ("aligned", "flatten"), *,
                  temperature: float = 1.0, vocab_size: int | None = None, threshold: float = 1e-3,
                  max_tokens: int = 8192) -> dict[str, dict]:
    """Per layout, the mismatch figures (`mismatch_figures`, keys without prefix) and the
    token count between the trajectories' recorded sampler log-probs and `model`'s
    restored ones. Raises `RecordError` when no call recorded log-probs."""
    trajectories = list(trajectories)
    if not trajectories:
        raise RecordError("no trajectories to audit")
    if not any(inv.sample_logprobs is not None for tr in trajectories for inv in tr.invocations):
        raise RecordError("no call of these trajectories recorded its sampling log-probs (sample_logprobs)")
    out = {}
    for layout in layouts:
        lp, rec = restored_logprobs(model, trajectories, layout, temperature=temperature, vocab_size=vocab_size,
                                    max_tokens=max_tokens)
        sums = mismatch_sums(lp, rec, threshold)
        out[layout] = {k.split("/", 1)[1]: v for k, v in mismatch_figures(sums).items()} | {"tokens": int(sums["n"])}
    return out


def format_sampler_audit(res: dict[str, dict], threshold: float = 1e-3) -> str:
    """Plain-text table of `sampler_audit`."""
    head = ["layout", "tokens", "max|dlogp|", "mean|dlogp|", "k3 KL", f"share >{threshold:g}"]
    rows = [[lay, str(r["tokens"]), _fmt(r["max_abs_dlogp"]), _fmt(r["mean_abs_dlogp"]), _fmt(r["k3_kl"]),
             f"{100 * r['share_over_threshold']:.1f}%"] for lay, r in res.items()]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(head), line(["-" * w for w in widths]), *map(line, rows),
                      "(dlogp = log p restored by the packed forward - log p recorded by the sampler)"])
