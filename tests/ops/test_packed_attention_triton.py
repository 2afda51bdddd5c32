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
import dataclasses
import os
import re
import subprocess
import sys

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import _attention_cases as _cases  # noqa: E402
import pytest  # noqa: E402
from _attention_cases import assert_close, oracle, random_meta, random_token_meta  # noqa: E402

import memopd.kernels.attention_kernels as ak  # noqa: E402
import memopd.kernels.attention_plan as kplan  # noqa: E402
import memopd.kernels.attention_tuning as tuning  # noqa: E402
import memopd.kernels.packed_attention as kern  # noqa: E402
from memopd.layout import AttentionMeta, SegmentKind, cached_on_metadata  # noqa: E402
from memopd.ops.attention import packed_attention  # noqa: E402
from memopd.ops.dispatch import BackendError  # noqa: E402

# No GPU, and the kernels were imported (compiled) before this file could set the
# interpreter: the whole file then runs in a child process (test_interpreter_suite_in_subprocess).
IN_PROCESS = kern.INTERPRET or torch.cuda.is_available()
_SUBPROCESS_TEST = "test_interpreter_suite_in_subprocess"


@pytest.fixture(autouse=True)
def _in_this_process_or_the_child(request):
    if not IN_PROCESS and request.node.name != _SUBPROCESS_TEST:
        pytest.skip(f"runs under the interpreter in a child process ({_SUBPROCESS_TEST})")


@pytest.mark.skipif(IN_PROCESS, reason="the interpreter tests run in this process")
def test_interpreter_suite_in_subprocess():
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__], env=env,
                         capture_output=True, text=True, timeout=1800)
    print(res.stdout[-5000:], res.stderr[-3000:])
    assert res.returncode == 0, f"interpreted packed-attention tests failed:\n{res.stdout[-5000:]}"
    assert re.search(r"\b\d+ passed", res.stdout), f"the child ran no test:\n{res.stdout[-3000:]}"


DEVICE = "cpu" if kern.INTERPRET else "cuda"
interpreter_only = pytest.mark.skipif(not kern.INTERPRET, reason="inspects the interpreter's per-tile Python calls")


@pytest.fixture(autouse=True)
def _no_autotune(monkeypatch):
    """On a GPU: one fixed configuration per kernel instead of compiling every autotune
    candidate for each of the many small shapes here (the benchmark runs the tuner)."""
    monkeypatch.setattr(kern, "AUTOTUNE", False)


def make_inputs(T, Hq, Hkv, D, dtype, seed):
    return _cases.make_inputs(T, Hq, Hkv, D, dtype, seed, device=DEVICE)


def run_triton(q, k, v, do, meta, blocks, deterministic, scale=None, monkeypatch=None, split="auto"):
    """Forward + backward through the op. split: the dK/dV split setting (`SPLIT_ROWS`:
    "auto" leaves the default, 0 turns it off, N caps the query rows per program)."""
    monkeypatch.setitem(tuning.FIXED, "BLOCK_M", blocks[0])
    monkeypatch.setitem(tuning.FIXED, "BLOCK_N", blocks[1])
    monkeypatch.setattr(kplan, "SPLIT_ROWS", None if split == "auto" else split)
    if DEVICE == "cuda":  # warps and stages that suit such small tiles
        monkeypatch.setitem(tuning.FIXED, "num_warps", 4)
        monkeypatch.setitem(tuning.FIXED, "num_stages", 2)
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


@pytest.mark.parametrize("dtype,Hq,Hkv,D,blocks,shuffle", [
    pytest.param(torch.float32, 2, 1, 16, (16, 16), False, id="fp32-gqa2-d16"),
    # GQA group 8 (one dK/dV tile stacks 8 heads, so 8 query heads add to one dQ row of
    # each head from every key block), shared prefixes read by several calls, shuffled
    pytest.param(torch.bfloat16, 8, 1, 16, (32, 16), True, id="bf16-gqa8-d16-shuffled"),
])
def test_deterministic_and_atomic_backward_agree(dtype, Hq, Hkv, D, blocks, shuffle, monkeypatch):
    """The atomic dQ (relaxed fp32 adds from the dK/dV programs, in any order) and the
    deterministic query-major dQ are the same sum: equal up to rounding, both as close to
    the float64 oracle as the dtype allows; dK/dV and the output are the same kernels in
    both modes, so bitwise equal; the deterministic mode is bitwise reproducible."""
    meta = random_meta(8 + Hq, 64 if Hq > 2 else 120, shuffle=shuffle)
    q, k, v, do = make_inputs(meta.num_tokens, Hq, Hkv, D, dtype, 8)
    a = run_triton(q, k, v, do, meta, blocks, False, monkeypatch=monkeypatch)
    b = run_triton(q, k, v, do, meta, blocks, True, monkeypatch=monkeypatch)
    c = run_triton(q, k, v, do, meta, blocks, True, monkeypatch=monkeypatch)
    want = oracle(q, k, v, do, meta)
    for name, x, y, z, w in zip(("out", "dq", "dk", "dv"), a, b, c, want):
        assert torch.equal(y, z), f"{name}: deterministic mode not reproducible"
        assert_close(name + " (atomic)", x, w, dtype)
        assert_close(name + " (deterministic)", y, w, dtype)
        if name == "dq":
            tol = 1e-5 if dtype == torch.float32 else 1.6e-2  # one rounding of the fp32 sum apart
            torch.testing.assert_close(x, y, atol=tol, rtol=tol)
        else:
            assert torch.equal(x, y), f"{name}: differs between the two backward modes"


def _needed_block_pairs(meta, bm, bn):
    """[query block, key block] pairs holding at least one visible (query, key) pair."""
    T = meta.num_tokens
    vis = meta.visible()
    nq, nk = -(-T // bm), -(-T // bn)
    pad = torch.zeros(nq * bm, nk * bn, dtype=torch.bool)
    pad[:T, :T] = vis
    return pad.view(nq, bm, nk, bn).any(3).any(1)


@interpreter_only
@pytest.mark.parametrize("shuffle,split", [(False, 0), (True, 0), (False, 32), (True, 32)])
def test_only_needed_blocks_are_computed(shuffle, split, monkeypatch):
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

    monkeypatch.setattr(ak, "_fwd_step", counted("fwd", ak._fwd_step))
    monkeypatch.setattr(ak, "_bwd_dq_step", counted("dq", ak._bwd_dq_step))
    orig_kv = ak._bwd_kv_step

    def kv(*args):  # args[15] = query rows, args[16] = keys of the tile
        seen["kv"].append((int(args[15].handle.data[0]) // bm, int(args[16].handle.data[0]) // bn))
        return orig_kv(*args)

    monkeypatch.setattr(ak, "_bwd_kv_step", kv)
    got = run_triton(q, k, v, do, meta, (bm, bn), True, monkeypatch=monkeypatch, split=split)
    if split:  # the split pieces still walk each needed tile once, whichever piece it is
        plan = kplan.dkdv_split_plan(_cached_ranges(meta), *kplan.dkdv_plan_spec(1))
        assert (plan.reduce[1] > 1).any()
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


# --------------------------------------------------------------------------------------
# non-finite inputs stay with the rows/keys that can see them (the torch and reference
# backends' counterpart is tests/ops/test_packed_attention_isolation.py)
# --------------------------------------------------------------------------------------
def _isolation_meta(long_call=False):
    """4 trajectories (connected components) whose segments share tiles of 16/32 tokens:
    A = prefix 0-6 with calls 7-15 and 33-45; B = a lone call 16-20; C = prefix 21-32 with
    calls 46-56 and 60-65; E = a lone call 66-79 (long_call: 66-129, which gives fully
    visible 16x16 tiles, e.g. rows 96-111 x keys 80-95); then 2 padding tokens."""
    P, C, D = SegmentKind.PREFIX, SegmentKind.CALL, SegmentKind.PAD
    end = 130 if long_call else 80
    return AttentionMeta.from_segments(
        [0, 7, 16, 21, 33, 46, 57, 60, 66, end, end + 2],
        [-1, 0, -1, -1, 0, 3, -1, 3, -1, -1],
        [P, C, C, P, C, C, D, C, C, D],
    )


ISOLATION_CASES = [
    # tensor, value, token, head, all dims (else one element), dtype, blocks, deterministic.
    # Token 39 lies mid-call (rows 33-38 of its segment and the other trajectories' rows in
    # its tiles must not see it); token 25 is a prefix token read by two calls; token 90
    # (in the long call) is read through fully visible tiles too.
    pytest.param("v", "nan", 39, 1, True, torch.float32, (16, 16), True, id="v-nan-call"),
    pytest.param("v", "inf", 25, 0, False, torch.float32, (32, 16), False, id="v-inf-elem-prefix"),
    pytest.param("k", "nan", 25, 1, False, torch.bfloat16, (16, 32), False, id="k-nan-elem-prefix-bf16"),
    pytest.param("k", "inf", 39, 0, True, torch.float16, (16, 16), True, id="k-inf-call-fp16"),
    pytest.param("q", "nan", 40, 2, True, torch.float32, (16, 16), False, id="q-nan-row"),
    pytest.param("do", "inf", 50, 1, False, torch.float32, (32, 16), True, id="do-inf-elem-row"),
    pytest.param("v", "inf", 90, 0, False, torch.float32, (16, 16), False, id="v-inf-elem-long-call"),
    pytest.param("k", "nan", 90, 1, True, torch.float16, (32, 16), True, id="k-nan-long-call-fp16"),
]


# some of them again with every key block's readers split over programs of at most 16 query
# rows: the plain launch flags the piece, the SAFE launch redoes that piece's partial sums
# (and its dQ adds), and the reduction sums clean and redone pieces
ISOLATION_PARAMS = [pytest.param(*c.values, "auto", id=c.id) for c in ISOLATION_CASES] + [
    pytest.param(*ISOLATION_CASES[i].values, 16, id=ISOLATION_CASES[i].id + "-split16") for i in (0, 2, 5, 7)]


@pytest.mark.parametrize("which,bad,tok,head,all_dims,dtype,blocks,det,split", ISOLATION_PARAMS)
def test_nonfinite_input_stays_with_its_readers(which, bad, tok, head, all_dims, dtype, blocks, det, split,
                                                monkeypatch):
    """A NaN/inf in one k/v row (of one kv head) or one q/dO row (of one query head): every
    output element, and every dq/dk/dv element, that cannot depend on it is finite and
    bitwise the clean run's (masked weights are exact zeros, and 0 * NaN must not reach
    them; the atomic dq: equal up to rounding), in particular everything of the other
    trajectories; rows that read a bad key or value get NaN across the head dim (as on the
    torch backend). Fails on kernels that multiply masked zeros with the bad row."""
    meta = _isolation_meta(long_call=tok >= 80)
    T, Hq, Hkv, D = meta.num_tokens, 4, 2, 16
    group = Hq // Hkv
    q, k, v, do = make_inputs(T, Hq, Hkv, D, dtype, 7)
    clean = run_triton(q, k, v, do, meta, blocks, det, monkeypatch=monkeypatch, split=split)
    x = {"q": q, "k": k, "v": v, "do": do}[which].clone()
    x[tok, head, slice(None) if all_dims else 3] = float(bad)
    args = {"q": q, "k": k, "v": v, "do": do, which: x}
    got = run_triton(args["q"], args["k"], args["v"], args["do"], meta, blocks, det, monkeypatch=monkeypatch,
                     split=split)

    vis = meta.visible()
    rows = torch.zeros(T, dtype=torch.bool)  # rows (of the heads below) whose out/dq may change
    if which in ("k", "v"):
        rows |= vis[:, tok]
        keys = vis[rows].any(0)  # keys (of kv head kv_h) whose dk/dv may change
        keys[tok] = True
        kv_h, q_heads = head, list(range(head * group, (head + 1) * group))
    else:
        rows[tok] = True
        keys = vis[tok].clone()
        kv_h, q_heads = head // group, [head]
    # some query tiles hold readers and non-readers (where 0 * NaN used to leak)
    tile = torch.arange(T) // blocks[0]
    assert any(bool((~rows & (tile == t)).any()) for t in tile[rows].unique())
    out_rows = rows if which != "do" else torch.zeros_like(rows)
    q_mask = torch.zeros(T, Hq, dtype=torch.bool)
    q_mask[:, q_heads] = rows.unsqueeze(1)
    out_mask = torch.zeros(T, Hq, dtype=torch.bool)
    out_mask[:, q_heads] = out_rows.unsqueeze(1)
    kv_mask = torch.zeros(T, Hkv, dtype=torch.bool)
    kv_mask[:, kv_h] = keys
    # the clean parts: finite and bitwise equal; except the atomic dQ, whose order of adds
    # varies on a GPU, and changes here too when a key block holding the bad value adds its
    # share later (in its SAFE rerun): equal up to rounding, as between any two atomic runs
    for name, a, b, may_change in zip(("out", "dq", "dk", "dv"), got, clean, (out_mask, q_mask, kv_mask, kv_mask)):
        a, b = a.cpu()[~may_change], b.cpu()[~may_change]
        assert torch.isfinite(a).all(), f"{name}: non-finite values outside the readers of the bad value"
        if name == "dq" and not det:
            assert_close(name, a, b.double(), dtype)
        else:
            # (on a GPU, last-bit differences here, in blocks the SAFE launch redid, would
            # mean that it compiled the same arithmetic with other FMA contractions)
            assert torch.equal(a, b), f"{name}: changed outside the readers of the bad value"
    # the rows that read the bad query/key/value: NaN over the whole head dim
    if which != "do":
        assert out_rows.sum() >= (2 if which != "q" else 1)
        assert torch.isnan(got[0].cpu()[out_mask]).all()
    assert (~torch.isfinite(got[2].cpu()[kv_mask])).any()  # the poison did reach the gradients


# --------------------------------------------------------------------------------------
# the dK/dV split over programs
# --------------------------------------------------------------------------------------
SPLIT_CASES = [
    # dtype, Hq, Hkv, D, (BLOCK_M, BLOCK_N), shuffle, tokens, max rows per program
    pytest.param(torch.float32, 4, 2, 32, (16, 16), False, 200, 16, id="fp32-gqa2-d32-rows16"),
    pytest.param(torch.float32, 8, 1, 16, (32, 16), True, 160, 32, id="fp32-gqa8-d16-shuffled-rows32"),
    pytest.param(torch.float32, 4, 4, 64, (16, 32), False, 150, 16, id="fp32-mha-d64-bn32"),
    pytest.param(torch.bfloat16, 4, 1, 16, (16, 16), True, 180, 16, id="bf16-gqa4-d16-shuffled"),
]


@pytest.mark.parametrize("dtype,Hq,Hkv,D,blocks,shuffle,tokens,rows", SPLIT_CASES)
def test_split_backward_matches_unsplit(dtype, Hq, Hkv, D, blocks, shuffle, tokens, rows, monkeypatch):
    """Key blocks split over programs of at most `rows` query rows: dK/dV are the unsplit
    kernel's up to the order of the fp32 sum (fp32: a few ulps), both as close to the float64
    oracle as the dtype allows; the output and the deterministic dQ do not depend on the
    split (bitwise); the deterministic backward is bitwise reproducible with the split."""
    meta = random_meta(40 + Hq + D, tokens, shuffle=shuffle)
    q, k, v, do = make_inputs(meta.num_tokens, Hq, Hkv, D, dtype, 40)
    base = run_triton(q, k, v, do, meta, blocks, True, monkeypatch=monkeypatch, split=0)
    split = run_triton(q, k, v, do, meta, blocks, True, monkeypatch=monkeypatch, split=rows)
    again = run_triton(q, k, v, do, meta, blocks, True, monkeypatch=monkeypatch, split=rows)
    atomic = run_triton(q, k, v, do, meta, blocks, False, monkeypatch=monkeypatch, split=rows)
    plan = kplan.dkdv_split_plan(_cached_ranges(meta.to(DEVICE)), *kplan.dkdv_plan_spec(Hkv, kplan.sm_count(DEVICE)))
    assert int((plan.reduce[1] > 1).sum()) >= 3, "the case does not split"
    want = oracle(q, k, v, do, meta)
    tol = 2e-6 if dtype == torch.float32 else 1.6e-2  # fp32: reassociated sums; bf16: one rounding
    for i, name in enumerate(("out", "dq", "dk", "dv")):
        assert torch.equal(split[i], again[i]), f"{name}: split deterministic backward not reproducible"
        assert_close(name + " (split)", split[i], want[i], dtype)
        assert_close(name + " (split, atomic dq)", atomic[i], want[i], dtype)
        if name in ("out", "dq"):
            assert torch.equal(split[i], base[i]), name
        else:
            torch.testing.assert_close(split[i], base[i], atol=tol, rtol=tol)
            assert torch.equal(atomic[i], split[i]), f"{name}: differs between the two backward modes"


def test_split_setting_from_the_environment():
    assert [kplan._split_setting(x) for x in (None, "auto", " AUTO ", "off", "0", "256")] == [None, None, None, 0, 0, 256]
    with pytest.raises(ValueError, match="MEMOPD_ATTENTION_SPLIT"):
        kplan._split_setting("-3")


def test_split_plan_host_facts():
    """The plan on CPU tensors: every key block present with all its pieces, their windows
    tile the query axis on aligned cuts, split blocks' slots contiguous and in bounds, the
    longest pieces first, and no split at all when switched off."""
    meta = random_meta(25, 400)
    kqr = _cached_ranges(meta)
    T = meta.num_tokens
    for block_n, align_m, rows in ((16, 16, None), (32, 16, 24), (64, 32, 0)):
        plan = kplan.dkdv_split_plan(kqr, block_n, align_m, rows)
        n_blocks = -(-T // block_n)
        table, counts, first = plan.table.long(), plan.reduce[1].long(), plan.reduce[0].long()
        used = table[0] < n_blocks
        assert torch.equal(torch.bincount(table[0][used], minlength=n_blocks), counts.clamp(min=1))
        for g in range(n_blocks):
            mine = table[:, table[0] == g]
            lo, hi = torch.sort(mine[1]).values, torch.sort(mine[2]).values
            assert lo[0] == 0 and hi[-1] == kplan._WINDOW_END and torch.equal(lo[1:], hi[:-1])
            assert bool((lo % align_m == 0).all())
            if counts[g] > 1:
                assert torch.equal(torch.sort(mine[3]).values, torch.arange(int(first[g]), int(first[g] + counts[g])))
            else:
                assert (mine[3] == -1).all()
        assert int(counts.sum()) <= plan.n_slots
        if rows == 0:
            assert plan.n_slots == 0 and int(counts.sum()) == 0 and plan.n_pieces == n_blocks
        else:
            assert (counts > 1).any()


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


def _trie_meta(seed=0):
    """A trie batch's metadata: spines read to several depths (nested prefix intervals with
    one start), identical early calls of a group."""
    from memopd import pack, random_trajectories

    trajs = random_trajectories("full", 6, seed=seed, group_size=3, vocab_size=6, calls=(2, 4), obs_len=(1, 5),
                                initial_context_len=(2, 6), group_context=True, group_steps=1)
    meta = pack(trajs, "trie").attn
    starts = [s for s, e in set(zip(meta.prefix_start.tolist(), meta.prefix_end.tolist())) if e > s]
    assert len(starts) > len(set(starts))
    return meta


@pytest.mark.parametrize("det", [False, True])
def test_trie_layout_metadata(det, monkeypatch):
    """The trie layout's metadata goes through the kernels unchanged: a spine is a prefix
    segment that each call reads to its own depth (its token-level interval)."""
    meta = _trie_meta()
    # the dK/dV walk's reader ranges stay per spine (no fallback to every query row)
    kqr = kplan.key_query_ranges(meta.seg_start, meta.prefix_start, meta.prefix_end).long()
    read = meta.prefix_end.long() > meta.prefix_start.long()
    spine_keys = torch.zeros(meta.num_tokens, dtype=torch.bool)
    spine_keys[meta.prefix_start.long()[read]] = True
    assert spine_keys.any() and ((kqr[1] - kqr[0])[spine_keys] < meta.num_tokens).all()
    q, k, v, do = make_inputs(meta.num_tokens, 4, 2, 16, torch.float32, 5)
    got = run_triton(q, k, v, do, meta, (16, 16), det, monkeypatch=monkeypatch)
    want = oracle(q, k, v, do, meta)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert_close(name, a, b, torch.float32)


def test_key_query_ranges_cover_every_reader():
    """Per key token, the precomputed query ranges must contain every row that sees it
    (through the prefix or the own segment), and the gap-free flag must be truthful."""
    for meta in (random_meta(21, 400, shuffle=True), random_meta(22, 400), random_token_meta(4, 120), _trie_meta(1)):
        vis = meta.visible()  # [query, key]
        T = meta.num_tokens
        kqr = kplan.key_query_ranges(meta.seg_start, meta.prefix_start, meta.prefix_end).long()
        if DEVICE == "cuda":  # same answer on the device
            kqr_dev = kplan.key_query_ranges(*(x.cuda() for x in (meta.seg_start, meta.prefix_start, meta.prefix_end)))
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


def _cached_ranges(meta):
    return cached_on_metadata(meta.seg_start, meta.prefix_start, meta.prefix_end, "key_query_ranges",
                              kplan.key_query_ranges)


def _cloned(meta):
    """Metadata of the same values in tensors of its own."""
    return AttentionMeta(**{f.name: getattr(meta, f.name).clone() if isinstance(getattr(meta, f.name), torch.Tensor)
                            else getattr(meta, f.name) for f in dataclasses.fields(meta)})


def test_key_query_ranges_cached_per_metadata():
    """Host side only (CPU tensors): the cached ranges are the function's own, the same
    tensor for the same metadata, and rebuilt after an in-place change of seg_start."""
    meta = random_meta(23, 300)
    first = _cached_ranges(meta)
    assert torch.equal(first, kplan.key_query_ranges(meta.seg_start, meta.prefix_start, meta.prefix_end))
    assert _cached_ranges(meta) is first
    # other tensors with the same values: a metadata object of their own
    copy = _cloned(meta)
    assert _cached_ranges(copy) is not first and torch.equal(_cached_ranges(copy), first)
    # a call row becomes padding (sees nothing, read by nobody): new ranges, the function's
    row = int(torch.nonzero(meta.seg_start < torch.arange(meta.num_tokens)).max())
    meta.seg_start[row] = row + 1
    changed = _cached_ranges(meta)
    assert changed is not first and not torch.equal(changed, first)
    assert torch.equal(changed, kplan.key_query_ranges(meta.seg_start, meta.prefix_start, meta.prefix_end))
    assert _cached_ranges(meta) is changed


def test_backward_computes_key_ranges_once_per_metadata(monkeypatch):
    """Two attention layers over one metadata object: one `key_query_ranges` for both
    backwards, and the gradients bitwise those of metadata that has to compute its own."""
    calls = []
    build = kplan.key_query_ranges

    def counting(*args):
        calls.append(1)
        return build(*args)

    monkeypatch.setattr(kplan, "key_query_ranges", counting)
    plans = []
    build_plan = kplan.dkdv_split_plan

    def counting_plan(*args):
        plans.append(1)
        return build_plan(*args)

    monkeypatch.setattr(kplan, "dkdv_split_plan", counting_plan)
    monkeypatch.setattr(kplan, "SPLIT_ROWS", 16)  # a plan that splits
    monkeypatch.setitem(tuning.FIXED, "BLOCK_M", 16)
    monkeypatch.setitem(tuning.FIXED, "BLOCK_N", 16)
    if DEVICE == "cuda":
        monkeypatch.setitem(tuning.FIXED, "num_warps", 4)
        monkeypatch.setitem(tuning.FIXED, "num_stages", 2)
    meta = random_meta(24, 90).to(DEVICE)
    q, k, v, do = make_inputs(meta.num_tokens, 2, 2, 16, torch.float32, 24)

    def two_layers(meta):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        hidden = packed_attention(*leaves, meta, backend="triton")
        packed_attention(hidden, leaves[1], leaves[2], meta, backend="triton").backward(do)
        return [x.grad for x in leaves]

    shared = two_layers(meta)
    assert len(calls) == 1 and len(plans) == 1
    assert all(torch.equal(a, b) for a, b in zip(shared, two_layers(_cloned(meta))))
    assert len(calls) == 2 and len(plans) == 2
    # another split setting: another plan, cached beside the first
    monkeypatch.setattr(kplan, "SPLIT_ROWS", 0)
    two_layers(meta)
    assert len(calls) == 2 and len(plans) == 3
    with pytest.raises(ValueError, match="key_ranges"):
        kern.packed_attention_bwd(do, q, k, v, q, torch.zeros(2, meta.num_tokens, device=DEVICE),
                                  meta.seg_start, meta.prefix_start, meta.prefix_end,
                                  key_ranges=_cached_ranges(meta)[:, 1:])
    with pytest.raises(ValueError, match="split_plan"):
        kern.packed_attention_bwd(do, q, k, v, q, torch.zeros(2, meta.num_tokens, device=DEVICE),
                                  meta.seg_start, meta.prefix_start, meta.prefix_end,
                                  split_plan=kplan.dkdv_split_plan(_cached_ranges(meta), 32, 16, 0))


def test_errors():
    meta = random_meta(1, 40)
    T = meta.num_tokens
    dmeta = meta.to(DEVICE)
    q = torch.randn(T, 2, 48, device=DEVICE)
    with pytest.raises(BackendError, match="head dim 48"):
        packed_attention(q, q, q, dmeta, backend="triton")
    with pytest.raises(ValueError, match="head dims"):  # the kernels' own check, for direct callers
        kern.packed_attention_fwd(q, q, q, dmeta.seg_start, dmeta.prefix_start, dmeta.prefix_end)
    q = torch.randn(T, 2, 16, dtype=torch.float64, device=DEVICE)
    with pytest.raises(BackendError, match="float16, bfloat16 and float32"):
        packed_attention(q, q, q, dmeta, backend="triton")
    q = torch.randn(T, 2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="devices differ"):
        packed_attention(q, q, q, meta.to("meta"), backend="triton")
    with pytest.raises(ValueError, match="on meta"):
        kern.packed_attention_fwd(q, q, q, dmeta.seg_start.to("meta"), dmeta.prefix_start, dmeta.prefix_end)
    with pytest.raises(ValueError, match="out must be"):
        kern.packed_attention_fwd(q, q, q, dmeta.seg_start, dmeta.prefix_start, dmeta.prefix_end,
                                  out=torch.empty(T, 2, 8, device=DEVICE))
