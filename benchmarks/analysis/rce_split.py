"""Where the fp32 RCE audit's |Δlogit| comes from: per action entry, by layout and by how
its prediction position reads its keys, against the independent call and against float64.

    python benchmarks/analysis/rce_split.py [--seeds 5] [--policies suffix,window,full]

The trajectories and models are those of the trie's audit test (tests/core/test_hf_rce.py:
tiny random-init Qwen2 and Llama, sharp init, groups of 3 sharing x_0 and two identical
first steps). Per entry, the max over the vocabulary of |packed logit − independent
logit| (fp32, the audit's measure), summarised over classes: the prediction position
inside a shared spine (a PREFIX segment, no prefix read), a call segment reading a prefix
(its keys split into the prefix and its own), a call segment alone. Then every layout
and the independent call against the same model in float64, and the packed forward
with the CPU path's one softmax over [prefix, own] keys (its padded, masked call) in
place of the fused path's two partial softmaxes merged by their log-sum-exps. Last, the
attention op alone on the same layouts' metadata (random fp32 q/k/v, sharp scores: q x 3):
per prefix-reading row the max |output - float64 output|, split against one softmax.
"""
from __future__ import annotations

import argparse
import copy
import itertools
from collections import defaultdict

import torch

import memopd.ops.attention_torch as attention_torch
from memopd import pack, random_trajectories
from memopd.hf import lm_head_of, packed_forward
from memopd.layout import SegmentKind
from memopd.models import tiny_causal_lm
from memopd.ops import packed_attention
from memopd.ops.reference_attention import reference_packed_attention
from memopd.rce import _reference_hidden

LAYOUTS = {"trie": ("trie", {}), "aligned_group": ("aligned", {"share_prefix": "group"}),
           "aligned_unshared": ("aligned_unshared", {})}
CLASSES = ("pred in a shared spine", "call reading a prefix", "call alone")


def _logits(model, h: torch.Tensor) -> torch.Tensor:
    return lm_head_of(model)(h).double()


def _classes(batch) -> torch.Tensor:
    a, p = batch.attn, batch.pred_index
    seg = torch.searchsorted(a.cu_seqlens[1:], p, right=True)
    spine = a.segment_kind[seg] == int(SegmentKind.PREFIX)
    return torch.where(spine, 0, torch.where(a.prefix_end[p] > a.prefix_start[p], 1, 2))


def _op_error(batches, seeds: int) -> None:
    """The attention op alone against float64 on prefix-reading rows, split vs one softmax."""
    fused_ok = attention_torch._fused_cpu_ok
    err = defaultdict(list)
    for (name, meta), seed in itertools.product(batches, range(seeds)):
        g = torch.Generator().manual_seed(seed)
        T = meta.num_tokens
        q, k, v = (torch.randn(T, h, 32, generator=g) for h in (8, 2, 2))
        q = q * 3
        truth = reference_packed_attention(q.double(), k.double(), v.double(), meta)
        reads = meta.prefix_end > meta.prefix_start
        for attention in ("split", "one softmax"):
            attention_torch._fused_cpu_ok = fused_ok if attention == "split" else (lambda *a: False)
            try:
                with torch.no_grad():
                    out = packed_attention(q, k, v, meta, backend="torch")
            finally:
                attention_torch._fused_cpu_ok = fused_ok
            err[(name, attention)].append((out.double() - truth).abs().amax((1, 2))[reads])
    print("attention op alone: per prefix-reading row max |output - float64 output| (fp32, 8/2 heads of 32)")
    for (name, attention), v in sorted(err.items()):
        x = torch.cat(v)
        print(f"{name:<17} {attention:<12} n={x.numel()} mean={x.mean():.2e} p99={x.quantile(0.99):.2e} max={x.max():.2e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--policies", default="suffix,window,full")
    args = ap.parse_args()
    torch.set_num_threads(1)
    models = {"qwen2": tiny_causal_lm("qwen2", vocab_size=128, initializer_range=0.2, seed=1),
              "llama": tiny_causal_lm("llama", vocab_size=128, initializer_range=0.2, seed=2)}
    doubles = {k: copy.deepcopy(m).double() for k, m in models.items()}
    fused_ok = attention_torch._fused_cpu_ok
    delta = defaultdict(list)  # (layout, attention, class) -> per-entry |dlogit| vs the fp32 call
    error = defaultdict(list)  # name -> per-entry |logit - float64 logit|
    metas = []  # (layout, attention metadata) of the prefix-sharing layouts, for `_op_error`
    for policy, seed, arch in itertools.product(args.policies.split(","), range(args.seeds), models):
        trajs = random_trajectories(policy, 6, seed=seed, group_size=3, vocab_size=128, calls=(3, 5), obs_len=(1, 8),
                                    initial_context_len=(4, 12), group_context=True, group_steps=2)
        m = models[arch]
        with torch.no_grad():
            ind = _logits(m, _reference_hidden(m, trajs)[0])
            truth = _logits(doubles[arch], _reference_hidden(doubles[arch], trajs)[0])
            error["independent call"].append((ind - truth).abs().amax(1))
            for name, (layout, kw) in LAYOUTS.items():
                batch = pack(trajs, layout, **kw)
                cls = _classes(batch)
                if name != "aligned_unshared" and arch == "qwen2":
                    metas.append((name, batch.attn))
                for attention in ("split", "one softmax"):
                    attention_torch._fused_cpu_ok = fused_ok if attention == "split" else (lambda *a: False)
                    try:
                        lp = _logits(m, packed_forward(m, batch, output="hidden", attention_backend="torch"))
                    finally:
                        attention_torch._fused_cpu_ok = fused_ok
                    d = (lp - ind).abs().amax(1)
                    for c in range(3):
                        if (cls == c).any():
                            delta[(name, attention, CLASSES[c])].append(d[cls == c])
                    if attention == "split":
                        error[name].append((lp - truth).abs().amax(1))
    print("per entry max |dlogit| over the vocabulary against the independent fp32 call")
    print(f"{'layout':<17} {'attention':<12} {'entries':<23} {'n':>5} {'mean':>8} {'p99':>8} {'max':>8} {'bit-exact':>9}")
    for (name, attention, cls), v in sorted(delta.items()):
        x = torch.cat(v)
        print(f"{name:<17} {attention:<12} {cls:<23} {x.numel():>5} {x.mean():>8.2e} {x.quantile(0.99):>8.2e} "
              f"{x.max():>8.2e} {(x == 0).double().mean():>9.0%}")
    print("per entry max |logit - float64 logit| (fused CPU attention)")
    for name, v in error.items():
        x = torch.cat(v)
        print(f"{name:<17} n={x.numel()} mean={x.mean():.2e} p99={x.quantile(0.99):.2e} max={x.max():.2e}")
    _op_error(metas, 2)


if __name__ == "__main__":
    main()
