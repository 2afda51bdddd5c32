"""Triton packed-attention kernels against the float64 dense-mask oracle.

On a machine without a GPU the kernels of `memopd.kernels.packed_attention` run on CPU
through the Triton interpreter: TRITON_INTERPRET=1 has to be set before that module is
imported, hence the first lines. On a GPU machine the interpreter is left off and the same
tests run the compiled kernels on CUDA tensors (setting it there would turn every Triton
kernel of the whole pytest process into the interpreter). Sizes stay at a few hundred
tokens because the interpreter is slow; block sizes are forced per test (small, unequal
BLOCK_M/BLOCK_N included) so that ragged segment edges, prefix ranges and skipped blocks
fall in different places.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

import memopd.kernels.packed_attention as kern  # noqa: E402
from memopd.layout import AttentionMeta, SegmentKind  # noqa: E402
from memopd.ops.packed_attention import packed_attention  # noqa: E402

import _attention_cases as _cases  # noqa: E402
from _attention_cases import assert_close, oracle, random_meta, random_token_meta  # noqa: E402

pytestmark = pytest.mark.skipif(
    not kern.INTERPRET and not torch.cuda.is_available(),
    reason="no GPU, and memopd.kernels.packed_attention was imported before TRITON_INTERPRET=1 "
    "was set; run this file in its own process",
)
DEVICE = "cpu" if kern.INTERPRET else "cuda"
interpreter_only = pytest.mark.skipif(not kern.INTERPRET, reason="inspects the interpreter's per-tile Python calls")


@pytest.fixture(autouse=True)
def _no_autotune(monkeypatch):
    """On a GPU: one fixed configuration per kernel instead of compiling every autotune
    candidate for each of the many small shapes here (the benchmark runs the tuner)."""
    monkeypatch.setattr(kern, "AUTOTUNE", False)


def make_inputs(T, Hq, Hkv, D, dtype, seed):
    return _cases.make_inputs(T, Hq, Hkv, D, dtype, seed, device=DEVICE)


def run_triton(q, k, v, do, meta, blocks, deterministic, scale=None, monkeypatch=None):
    monkeypatch.setitem(kern._FIXED, "BLOCK_M", blocks[0])
    monkeypatch.setitem(kern._FIXED, "BLOCK_N", blocks[1])
    if DEVICE == "cuda":  # warps and stages that suit such small tiles
        monkeypatch.setitem(kern._FIXED, "num_warps", 4)
        monkeypatch.setitem(kern._FIXED, "num_stages", 2)
    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
    meta = meta.to(DEVICE)
    out = packed_attention(qq, kk, vv, meta, scale, backend="triton", deterministic=deterministic)
    out.backward(do)
    return out.detach(), qq.grad, kk.grad, vv.grad


CASES = [
    # dtype, Hq, Hkv, D, (BLOCK_M, BLOCK_N), deterministic, shuffle, tokens
    pytest.param(torch.float32, 4, 4, 32, (16, 16), False, False, 300, id="fp32-mha-d32-b16"),
    pytest.param(torch.float32, 4, 2, 64, (32, 16), True, True, 260, id="fp32-gqa2-d64-shuffled-det"),
    pytest.param(torch.float16, 4, 1, 16, (16, 32), False, True, 280, id="fp16-gqa4-d16-shuffled"),
    pytest.param(torch.float16, 2, 2, 32, (32, 32), True, False, 240, id="fp16-mha-d32-det"),
    pytest.param(torch.bfloat16, 4, 2, 32, (32, 16), False, False, 260, id="bf16-gqa2-d32"),
    pytest.param(torch.float32, 2, 1, 128, (16, 16), True, True, 120, id="fp32-gqa2-d128-det"),
]


@pytest.mark.parametrize("dtype,Hq,Hkv,D,blocks,det,shuffle,tokens", CASES)
def test_kernels_match_float64_reference(dtype, Hq, Hkv, D, blocks, det, shuffle, tokens, monkeypatch):
    seed = Hq * 100 + D + tokens
    meta = random_meta(seed, tokens, shuffle=shuffle)
    q, k, v, do = make_inputs(meta.num_tokens, Hq, Hkv, D, dtype, seed)
    got = run_triton(q, k, v, do, meta, blocks, det, monkeypatch=monkeypatch)
    want = oracle(q, k, v, do, meta)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert a.dtype == dtype
        assert_close(name, a, b, dtype)
    # padding rows see nothing: exact zeros, and padding keys get no gradient
    pad = meta.seg_start.long() > torch.arange(meta.num_tokens)
    pad &= meta.prefix_end.long() <= meta.prefix_start.long()
    assert pad.any()
    assert (got[0].cpu()[pad] == 0).all() and (got[1].cpu()[pad] == 0).all()


def test_arbitrary_token_metadata(monkeypatch):
    """Overlapping prefix/own ranges and non-monotone seg_start: the O(T) range bounds fall
    back to conservative walks and the element mask keeps the result exact."""
    meta = random_token_meta(3, 90)
    assert (meta.seg_start[1:] < meta.seg_start[:-1]).any()
    assert (meta.visible().sum(1) == 0).any()
    q, k, v, do = make_inputs(90, 2, 1, 16, torch.float32, 3)
    for det in (False, True):
        got = run_triton(q, k, v, do, meta, (16, 16), det, monkeypatch=monkeypatch)
        want = oracle(q, k, v, do, meta)
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            assert_close(name, a, b, torch.float32)
    assert (got[0].cpu()[meta.visible().sum(1) == 0] == 0).all()


def test_softmax_scale_and_noncontiguous_inputs(monkeypatch):
    meta = random_meta(11, 120)
    T = meta.num_tokens
    q, k, v, do = make_inputs(T, 2, 2, 32, torch.float32, 11)
    # [T, D, H] storage viewed as [T, H, D]: the op must make it contiguous itself
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)
    assert not qt.is_contiguous()
    got = run_triton(qt, k, v, do, meta, (16, 16), False, scale=0.3, monkeypatch=monkeypatch)
    want = oracle(q, k, v, do, meta, scale=0.3)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert_close(name, a, b, torch.float32)


def test_every_output_element_is_written():
    """Poison the output buffers with NaN: the kernels must overwrite every element, rows
    that see nothing and keys nobody sees included."""
    meta = random_meta(5, 150, shuffle=True)
    T = meta.num_tokens
    q, k, v, do = make_inputs(T, 4, 2, 16, torch.float32, 5)
    ss, ps, pe = (x.to(DEVICE) for x in (meta.seg_start, meta.prefix_start, meta.prefix_end))
    out = torch.full_like(q, float("nan"))
    out2, lse = kern.packed_attention_fwd(q, k, v, ss, ps, pe, None, out=out)
    assert out2.data_ptr() == out.data_ptr()
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    want = oracle(q, k, v, do, meta)
    assert_close("out", out, want[0], torch.float32)
    # rows that see nothing have LSE -inf; all others finite
    empty = meta.visible().sum(1) == 0
    lse = lse.cpu()
    assert torch.isneginf(lse[:, empty]).all() and torch.isfinite(lse[:, ~empty]).all()
    dq, dk, dv = (torch.full_like(x, float("nan")) for x in (q, k, v))
    kern.packed_attention_bwd(do, q, k, v, out, lse.to(DEVICE), ss, ps, pe, None, deterministic=True,
                              dq=dq, dk=dk, dv=dv)
    for name, a, b in zip(("dq", "dk", "dv"), (dq, dk, dv), want[1:]):
        assert not torch.isnan(a).any(), name
        assert_close(name, a, b, torch.float32)


def test_deterministic_and_atomic_backward_agree(monkeypatch):
    meta = random_meta(8, 120)
    q, k, v, do = make_inputs(meta.num_tokens, 2, 1, 16, torch.float32, 8)
    a = run_triton(q, k, v, do, meta, (16, 16), False, monkeypatch=monkeypatch)
    b = run_triton(q, k, v, do, meta, (16, 16), True, monkeypatch=monkeypatch)
    c = run_triton(q, k, v, do, meta, (16, 16), True, monkeypatch=monkeypatch)
    for x, y, z in zip(a, b, c):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
        assert torch.equal(y, z)  # deterministic mode is bitwise reproducible


def _needed_block_pairs(meta, bm, bn):
    """[query block, key block] pairs holding at least one visible (query, key) pair."""
    T = meta.num_tokens
    vis = meta.visible()
    nq, nk = -(-T // bm), -(-T // bn)
    pad = torch.zeros(nq * bm, nk * bn, dtype=torch.bool)
    pad[:T, :T] = vis
    return pad.view(nq, bm, nk, bn).any(3).any(1)


@interpreter_only
@pytest.mark.parametrize("shuffle", [False, True])
def test_only_needed_blocks_are_computed(shuffle, monkeypatch):
    """Count the (query block, key block) tiles the kernels actually compute: every tile
    holding a visible pair, and no fully masked tile (the interpreter runs the per-tile
    step helpers as plain Python, so they can be wrapped)."""
    bm, bn = 16, 16
    meta = random_meta(31 + shuffle, 200, shuffle=shuffle)
    T = meta.num_tokens
    need = _needed_block_pairs(meta, bm, bn)
    q, k, v, do = make_inputs(T, 1, 1, 16, torch.float32, 1)
    seen = {"fwd": [], "kv": [], "dq": []}

    def counted(name, fn):
        def wrapped(*args):
            seen[name].append(1)
            return fn(*args)
        return wrapped

    monkeypatch.setattr(kern, "_fwd_step", counted("fwd", kern._fwd_step))
    monkeypatch.setattr(kern, "_bwd_dq_step", counted("dq", kern._bwd_dq_step))
    orig_kv = kern._bwd_kv_step

    def kv(*args):  # args[15] = query rows, args[16] = keys of the tile
        seen["kv"].append((int(args[15].handle.data[0]) // bm, int(args[16].handle.data[0]) // bn))
        return orig_kv(*args)

    monkeypatch.setattr(kern, "_bwd_kv_step", kv)
    got = run_triton(q, k, v, do, meta, (bm, bn), True, monkeypatch=monkeypatch)
    want = oracle(q, k, v, do, meta)
    assert_close("dk", got[2], want[2], torch.float32)
    # key-major backward: exactly the needed tiles, each once
    kv_tiles = seen["kv"]
    assert len(kv_tiles) == len(set(kv_tiles)) == int(need.sum())
    assert all(need[m, n] for m, n in kv_tiles)
    # query-major kernels: each needed key block once per query block, nothing else (they
    # could visit a padding-only block lying inside a query block's own range, which these
    # layouts do not have)
    for name in ("fwd", "dq"):
        assert len(seen[name]) == int(need.sum()), name


def test_tiny_streams(monkeypatch):
    """All padding; one token; a prefix whose only call is one token."""
    cases = [
        AttentionMeta.from_segments([0, 5], [-1], [SegmentKind.PAD]),
        AttentionMeta.from_segments([0, 1], [-1], [SegmentKind.CALL]),
        AttentionMeta.from_segments([0, 3, 4, 6], [-1, 0, -1], [SegmentKind.PREFIX, SegmentKind.CALL, SegmentKind.PAD]),
    ]
    for meta in cases:
        q, k, v, do = make_inputs(meta.num_tokens, 2, 1, 16, torch.float32, 0)
        got = run_triton(q, k, v, do, meta, (16, 16), False, monkeypatch=monkeypatch)
        want = oracle(q, k, v, do, meta)
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            assert_close(name, a, b, torch.float32)


def test_key_query_ranges_cover_every_reader():
    """Per key token, the precomputed query ranges must contain every row that sees it
    (through the prefix or the own segment), and the gap-free flag must be truthful."""
    for meta in (random_meta(21, 400, shuffle=True), random_meta(22, 400), random_token_meta(4, 120)):
        vis = meta.visible()  # [query, key]
        T = meta.num_tokens
        kqr = kern.key_query_ranges(meta.seg_start, meta.prefix_start, meta.prefix_end).long()
        if DEVICE == "cuda":  # same answer on the device
            kqr_dev = kern.key_query_ranges(*(x.cuda() for x in (meta.seg_start, meta.prefix_start, meta.prefix_end)))
            assert torch.equal(kqr_dev.cpu().long(), kqr)
        rows = torch.arange(T).unsqueeze(1)
        in_pre = (rows >= kqr[0]) & (rows < kqr[1])
        in_own = (rows >= kqr[2]) & (rows < kqr[3])
        assert not (vis & ~(in_pre | in_own)).any()
        # gap-free prefix range: every row in it reads the key through its prefix
        pre_vis = (meta.prefix_start.long().unsqueeze(1) <= torch.arange(T)) & (
            torch.arange(T) < meta.prefix_end.long().unsqueeze(1)
        )
        dense = kqr[4].bool()
        assert not (in_pre & ~pre_vis)[:, dense].any()


def test_errors():
    meta = random_meta(1, 40)
    T = meta.num_tokens
    dmeta = meta.to(DEVICE)
    q = torch.randn(T, 2, 48, device=DEVICE)
    with pytest.raises(ValueError, match="head dims"):
        packed_attention(q, q, q, dmeta, backend="triton")
    q = torch.randn(T, 2, 16, dtype=torch.float64, device=DEVICE)
    with pytest.raises(ValueError, match="float16, bfloat16 and float32"):
        packed_attention(q, q, q, dmeta, backend="triton")
    q = torch.randn(T, 2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="devices differ"):
        packed_attention(q, q, q, meta.to("meta"), backend="triton")
    with pytest.raises(ValueError, match="on meta"):
        kern.packed_attention_fwd(q, q, q, dmeta.seg_start.to("meta"), dmeta.prefix_start, dmeta.prefix_end)
    with pytest.raises(ValueError, match="out must be"):
        kern.packed_attention_fwd(q, q, q, dmeta.seg_start, dmeta.prefix_start, dmeta.prefix_end,
                                  out=torch.empty(T, 2, 8, device=DEVICE))


_COMPILE_SCRIPT = r'''
import sys
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import memopd.kernels.packed_attention as kern

assert not kern.INTERPRET
D, GROUP = 128, 4
q = torch.empty(1, 1, D, dtype=torch.bfloat16)
P = "*bf16"
jobs = [
    (kern._fwd_kernel, kern._FWD_CONFIGS, kern._FWD_PRUNE,
     dict(Q=P, K=P, V=P, O=P, LSE="*fp32", SEG="*i32", PST="*i32", PEND="*i32"), dict(GROUP=GROUP)),
    (kern._bwd_dkdv_kernel, kern._BWD_KV_CONFIGS, kern._BWD_KV_PRUNE,
     dict(Q=P, K=P, V=P, DO=P, DQ="*fp32", DK=P, DV=P, LSE="*fp32", DELTA="*fp32", SEG="*i32", PST="*i32",
          PEND="*i32", KQR="*i32"), dict(GROUP=GROUP, GROUP_P2=GROUP, ATOMIC_DQ=True)),
    (kern._bwd_dq_kernel, kern._BWD_DQ_CONFIGS, kern._BWD_DQ_PRUNE,
     dict(Q=P, K=P, V=P, DO=P, DQ=P, LSE="*fp32", DELTA="*fp32", SEG="*i32", PST="*i32", PEND="*i32"),
     dict(GROUP=GROUP)),
]
for fn, configs, prune, ptrs, extra in jobs:
    c = prune(configs, {"HEAD_DIM": D, "Q": q, "GROUP_P2": GROUP})[0]
    consts = dict(HEAD_DIM=D, BLOCK_M=c.kwargs["BLOCK_M"], BLOCK_N=c.kwargs["BLOCK_N"], UPCAST=False, PREC="tf32",
                  **extra)
    sig = {n: "constexpr" if n in consts else ptrs.get(n, "fp32" if n.endswith("scale") else "i32")
           for n in fn.arg_names}
    # what the launcher specialises: 16-byte aligned pointers, strides divisible by 16
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if n in ptrs or n.startswith("stride")}
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()},
                    attrs=attrs)
    out = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                         options=dict(num_warps=c.num_warps, num_stages=c.num_stages))
    ttgir = out.asm["ttgir"]
    print(fn.__name__, "shared", out.metadata.shared, "wgmma", "warp_group_dot" in ttgir)
    assert out.metadata.shared <= 232448, "over the 227 KB of shared memory a block may use"
    assert "warp_group_dot" in ttgir, "expected Hopper wgmma instructions"
'''


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the other tests compile and run the kernels")
def test_kernels_compile_for_hopper():
    """The interpreter does not check what only the compiler does (types, layouts, shared
    memory): compile the three kernels offline for sm_90 (H100/H200) in a process without
    TRITON_INTERPRET, at the production shape (bf16, D=128, 4 query heads per kv head) with
    the configuration used when autotuning is off. Triton's own compiler and ptxas run on
    CPU; the compiled kernels are cached in Triton's cache directory."""
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    assert r.stdout.count("wgmma True") == 3, r.stdout
