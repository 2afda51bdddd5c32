"""Shared cases of the packed-attention tests: random metadata with the hard cases,
random inputs, the float64 oracle and the tolerance check. Imported by
test_packed_attention.py and test_packed_attention_triton.py (not collected itself)."""
import random

import torch

from memopd.layout import AttentionMeta, SegmentKind
from memopd.ops.reference_attention import reference_packed_attention

# max |error| allowed, relative to max(1, max |expected|), per input dtype
TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def random_meta(seed: int, tokens: int, shuffle: bool = False) -> AttentionMeta:
    """Packed layout with the hard cases: prefixes shared by 1..8 calls, calls without a
    prefix, length-1 prefixes and calls, calls of a couple of tokens (empty context),
    padding runs. shuffle=True puts the segments in random order, so calls may come before
    their prefix and the calls of different prefixes interleave."""
    rng = random.Random(seed)
    segs = []  # (kind, length, index of linked prefix in segs or -1)
    while sum(s[1] for s in segs) < tokens:
        r = rng.random()
        if r < 0.12:
            segs.append((SegmentKind.PAD, rng.choice([1, 3, 17, 40]), -1))
        elif r < 0.25:
            segs.append((SegmentKind.CALL, rng.choice([1, 2, 5, 33]), -1))
        else:
            p = len(segs)
            segs.append((SegmentKind.PREFIX, rng.choice([1, 7, 20, 45]), -1))
            for _ in range(rng.randint(1, 8)):
                segs.append((SegmentKind.CALL, rng.choice([1, 2, 3, 9, 16, 31, 50]), p))
    segs.append((SegmentKind.PAD, rng.choice([2, 19]), -1))  # always some padding
    order = list(range(len(segs)))
    if shuffle:
        rng.shuffle(order)
    pos = {old: new for new, old in enumerate(order)}
    cu, links, kinds = [0], [], []
    for old in order:
        kind, n, link = segs[old]
        cu.append(cu[-1] + n)
        kinds.append(kind)
        links.append(pos[link] if link >= 0 else -1)
    return AttentionMeta.from_segments(cu, links, kinds)


def random_token_meta(seed: int, T: int) -> AttentionMeta:
    """Arbitrary token-level metadata no packer builds: seg_start jumps around (not
    monotone), prefix intervals overlap the own range, lie after the row, or are empty,
    some rows see nothing. The kernels must still follow the visibility rule exactly."""
    g = torch.Generator().manual_seed(seed)
    i = torch.arange(T)
    ss = (torch.rand(T, generator=g) * (i + 2).float()).long().clamp(max=i + 1)
    a = torch.randint(0, T, (T,), generator=g)
    b = (a + torch.randint(0, 40, (T,), generator=g)).clamp(max=T)
    none = torch.rand(T, generator=g) < 0.3
    a, b = torch.where(none, 0, a), torch.where(none, 0, b)
    blind = none & (torch.rand(T, generator=g) < 0.4)  # rows that see nothing at all
    ss = torch.where(blind, i + 1, ss)
    return AttentionMeta(
        cu_seqlens=torch.tensor([0, T], dtype=torch.int32),
        prefix_segment=torch.tensor([-1], dtype=torch.int32),
        segment_kind=torch.tensor([SegmentKind.HISTORY], dtype=torch.int8),
        seg_start=ss.int(),
        prefix_start=a.int(),
        prefix_end=b.int(),
        max_seqlen=T,
        max_prefix_len=40,
    )


def make_inputs(T, Hq, Hkv, D, dtype, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(T, h, D, generator=g) for h in (Hq, Hkv, Hkv, Hq)]
    return [x.to(device=device, dtype=dtype) for x in xs]


def oracle(q, k, v, do, meta, scale=None):
    """float64 reference output and gradients."""
    q64, k64, v64 = (x.detach().cpu().double().requires_grad_() for x in (q, k, v))
    out = reference_packed_attention(q64, k64, v64, meta.to("cpu"), scale)
    return (out.detach(),) + torch.autograd.grad(out, (q64, k64, v64), do.cpu().double())


def assert_close(name, got, want, dtype):
    got = got.detach().cpu().double()
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    err = (got - want).abs().max().item()
    bound = TOL[dtype] * max(1.0, want.abs().max().item())
    assert err <= bound, f"{name}: max error {err:.3e} > {bound:.3e}"
