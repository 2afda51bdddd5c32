"""`memopd.ops.attention`: the exact PyTorch path against the float64 dense-mask
oracle (values and gradients), its per-layout plan cache, dispatch, and input validation. A CUDA-only test at the end
checks the compiled Triton kernels against the PyTorch path (skipped without a GPU); the
interpreter tests of the kernels live in test_packed_attention_triton.py.
"""
import os
import subprocess
import sys

import pytest
import torch

from memopd.layout import AttentionMeta, SegmentKind
from memopd.ops import packed_attention as op_entry
from memopd.ops.attention import packed_attention, plan_runs, resolve_backend
from memopd.ops.dispatch import BackendError

# the torch path's internals (its own module, imported by memopd.ops.attention)
pa_mod = sys.modules["memopd.ops.attention_torch"]

from _attention_cases import assert_close, make_inputs, oracle, random_meta, random_token_meta  # noqa: E402


def run(backend, q, k, v, do, meta, scale=None, **kw):
    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
    out = packed_attention(qq, kk, vv, meta, scale, backend=backend, **kw)
    out.backward(do)
    return out.detach(), qq.grad, kk.grad, vv.grad


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("shuffle", [False, True])
def test_torch_path_matches_reference(dtype, Hq, Hkv, shuffle):
    seed = Hq * 10 + Hkv + shuffle
    meta = random_meta(seed, 500, shuffle=shuffle)
    q, k, v, do = make_inputs(meta.num_tokens, Hq, Hkv, 32, dtype, seed)
    got = run("torch", q, k, v, do, meta)
    want = oracle(q, k, v, do, meta)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert a.dtype == dtype
        assert_close(name, a, b, dtype)
    # padding rows: exact zeros out, zero gradient
    empty = meta.visible().sum(1) == 0
    assert empty.any()
    assert (got[0][empty] == 0).all() and (got[1][empty] == 0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_torch_path_low_precision(dtype):
    meta = random_meta(7, 300, shuffle=True)
    q, k, v, do = make_inputs(meta.num_tokens, 4, 2, 64, dtype, 7)
    got = run("torch", q, k, v, do, meta)
    want = oracle(q, k, v, do, meta)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert a.dtype == dtype
        assert_close(name, a, b, dtype)


def test_torch_path_arbitrary_token_metadata():
    meta = random_token_meta(5, 120)
    assert (meta.seg_start[1:] < meta.seg_start[:-1]).any()
    runs = plan_runs(meta)
    assert any(r.overlap for r in runs) and any(r.zero for r in runs)
    q, k, v, do = make_inputs(120, 2, 1, 16, torch.float64, 5)
    got = run("torch", q, k, v, do, meta, scale=0.7)
    want = oracle(q, k, v, do, meta, scale=0.7)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert_close(name, a, b, torch.float64)


def test_plan_runs_are_the_segments():
    meta = random_meta(3, 400)
    runs = plan_runs(meta)
    cu = meta.cu_seqlens.tolist()
    kinds = meta.segment_kind.tolist()
    assert runs[0].start == 0 and runs[-1].stop == meta.num_tokens
    assert all(a.stop == b.start for a, b in zip(runs, runs[1:]))
    # every non-padding segment is exactly one run; padding merges into zero runs
    starts = {r.start for r in runs if not r.zero}
    for s, kind in enumerate(kinds):
        if kind != SegmentKind.PAD:
            assert cu[s] in starts
    assert len([r for r in runs if not r.zero]) == sum(k != SegmentKind.PAD for k in kinds)


def test_gradcheck_tiny():
    meta = AttentionMeta.from_segments(
        [0, 3, 5, 6, 8, 9], [-1, 0, 0, -1, -1], [SegmentKind.PREFIX, SegmentKind.CALL, SegmentKind.CALL,
                                                  SegmentKind.PAD, SegmentKind.CALL]
    )
    g = torch.Generator().manual_seed(0)
    q = torch.randn(9, 2, 4, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(9, 1, 4, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(9, 1, 4, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b, c: packed_attention(a, b, c, meta, backend="torch"), (q, k, v))


def test_auto_dispatch_uses_torch_on_cpu(monkeypatch):
    assert op_entry is packed_attention  # memopd.ops exports this op
    meta = random_meta(2, 100)
    q, k, v, _ = make_inputs(meta.num_tokens, 2, 2, 16, torch.float32, 2)
    assert resolve_backend(q) == "torch"
    calls = []
    for name in ("_torch_packed_attention", "_fused_cpu_forward"):  # the torch path's two forwards
        orig = getattr(pa_mod, name)

        def spy(*args, _orig=orig, _name=name):
            calls.append(_name)
            return _orig(*args)

        monkeypatch.setattr(pa_mod, name, spy)
    out = packed_attention(q, k, v, meta)
    assert calls == ["_fused_cpu_forward"]
    torch.testing.assert_close(out, packed_attention(q, k, v, meta, backend="reference"), atol=1e-5, rtol=1e-5)


def test_backend_environment_variable(monkeypatch):
    """MEMOPD_BACKEND replaces "auto"; an explicit backend still wins; a bad value is an error."""
    meta = random_meta(2, 60)
    q, k, v, _ = make_inputs(meta.num_tokens, 2, 1, 16, torch.float32, 2)
    monkeypatch.setenv("MEMOPD_BACKEND", "torch")
    assert resolve_backend(q) == "torch"
    assert resolve_backend(q, "reference") == "reference"
    monkeypatch.setenv("MEMOPD_BACKEND", "reference")  # not a choice for every op: refused
    with pytest.raises(BackendError, match="MEMOPD_BACKEND"):
        packed_attention(q, k, v, meta)


def test_triton_refuses_what_the_kernels_do_not_take(monkeypatch):
    """With the interpreter on (faked here), an explicit "triton" still refuses float64 and
    odd head dims with a BackendError naming the reason; "auto" never picks it on CPU."""
    import memopd.ops.dispatch as dispatch

    monkeypatch.setattr(dispatch, "interpreter_active", lambda: True)
    monkeypatch.setattr(dispatch, "triton_available", lambda: True)
    meta = random_meta(2, 60)
    T = meta.num_tokens
    with pytest.raises(BackendError, match="torch.float64 inputs"):
        packed_attention(*(torch.randn(T, 2, 16, dtype=torch.float64) for _ in range(3)), meta, backend="triton")
    with pytest.raises(BackendError, match="head dim 48"):
        packed_attention(*(torch.randn(T, 2, 48) for _ in range(3)), meta, backend="triton")
    assert resolve_backend(torch.randn(T, 2, 16)) == "torch"
    assert resolve_backend(torch.randn(T, 2, 16), "triton") == "triton"


def test_plan_is_built_once_per_layout(monkeypatch):
    """The torch path plans a layout once (forward, backward and later calls share it) and
    plans again after an in-place change of the metadata."""
    calls = []
    build = pa_mod._build_plan

    def counting(*args):
        calls.append(1)
        return build(*args)

    monkeypatch.setattr(pa_mod, "_build_plan", counting)
    meta = random_meta(11, 200)
    q, k, v, do = make_inputs(meta.num_tokens, 2, 2, 16, torch.float64, 11)
    first = run("torch", q, k, v, do, meta)
    second = run("torch", q, k, v, do, meta)
    assert len(calls) == 1
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    # one query row becomes blind (a row that sees nothing): a new plan, and a new result
    row = int(meta.prefix_end.argmax())
    meta.seg_start[row] = row + 1
    meta.prefix_end[row] = meta.prefix_start[row]
    third = run("torch", q, k, v, do, meta)
    assert len(calls) == 2
    assert (third[0][row] == 0).all() and not torch.equal(third[0], first[0])
    for name, a, b in zip(("out", "dq", "dk", "dv"), third, oracle(q, k, v, do, meta)):
        assert_close(name, a, b, torch.float64)


def test_backward_without_the_autograd_guard(monkeypatch):
    """Where torch lacks the private dispatch-key guard, the torch backward falls back to
    torch.func.vjp: same gradients."""
    monkeypatch.setattr(pa_mod, "_INCLUDE_AUTOGRAD", None)
    monkeypatch.setattr(pa_mod, "_fused_cpu_ok", lambda *a: False)  # the replaying backward
    meta = random_meta(12, 150, shuffle=True)
    q, k, v, do = make_inputs(meta.num_tokens, 4, 2, 16, torch.float64, 12)
    for name, a, b in zip(("out", "dq", "dk", "dv"), run("torch", q, k, v, do, meta), oracle(q, k, v, do, meta)):
        assert_close(name, a, b, torch.float64)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_fused_cpu_backward_equals_the_replaying_one(dtype, monkeypatch):
    """On CPU the torch path keeps the fused kernels' log-sum-exp and runs their backward per
    padded call; it must give the replaying backward's gradients (float64: to rounding),
    and both the float64 oracle's."""
    meta = random_meta(21, 400, shuffle=True)
    q, k, v, do = make_inputs(meta.num_tokens, 8, 2, 32, dtype, 21)
    plan = pa_mod._plan_of(meta.seg_start, meta.prefix_start, meta.prefix_end)
    assert pa_mod._fused_cpu_ok(q, k, v, plan), "segment layouts on CPU must take the fused path"
    fused = run("torch", q, k, v, do, meta)
    monkeypatch.setattr(pa_mod, "_fused_cpu_ok", lambda *a: False)
    replay = run("torch", q, k, v, do, meta)
    want = oracle(q, k, v, do, meta)
    for name, a, b, c in zip(("out", "dq", "dk", "dv"), fused, replay, want):
        assert_close(name, a, c, dtype)
        if dtype == torch.float64:
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_fused_cpu_path_steps_aside_for_non_finite_inputs():
    meta = random_meta(22, 200)
    q, k, v, _ = make_inputs(meta.num_tokens, 4, 2, 16, torch.float32, 22)
    plan = pa_mod._plan_of(meta.seg_start, meta.prefix_start, meta.prefix_end)
    assert pa_mod._fused_cpu_ok(q, k, v, plan)
    k = k.detach().clone()
    k[5, 1, 3] = float("nan")
    assert not pa_mod._fused_cpu_ok(q, k, v, plan)


def test_empty_stream():
    meta = AttentionMeta.from_segments([0], [], [])
    q = torch.zeros(0, 2, 16, requires_grad=True)
    out = packed_attention(q, q, q, meta)
    assert out.shape == (0, 2, 16)


def test_bad_inputs():
    meta = random_meta(1, 60)
    T = meta.num_tokens
    q = torch.randn(T, 4, 16)
    kv = torch.randn(T, 2, 16)
    with pytest.raises(ValueError, match=r"\[T, H, D\]"):
        packed_attention(q[:, 0], kv, kv, meta)
    with pytest.raises(ValueError, match="multiple"):
        packed_attention(q, torch.randn(T, 3, 16), torch.randn(T, 3, 16), meta)
    with pytest.raises(ValueError, match="same shape"):
        packed_attention(q, kv, torch.randn(T, 1, 16), meta)
    with pytest.raises(ValueError, match="metadata describes"):
        packed_attention(q[:-1], kv[:-1], kv[:-1], meta)
    with pytest.raises(ValueError, match="dtypes differ"):
        packed_attention(q, kv.double(), kv.double(), meta)
    with pytest.raises(ValueError, match="devices differ"):
        packed_attention(q, kv, kv, meta.to("meta"))
    with pytest.raises(BackendError, match="unknown backend 'flash'"):
        packed_attention(q, kv, kv, meta, backend="flash")
    with pytest.raises(TypeError, match="AttentionMeta"):
        packed_attention(q, kv, kv, meta.seg_start)


def test_triton_on_cpu_needs_the_interpreter():
    """Without TRITON_INTERPRET, backend="triton" on CPU tensors is a clear error. Checked in
    a fresh process: once an interpreter test file has set the variable, Triton stays in
    interpreter mode for the rest of this one."""
    pytest.importorskip("triton")
    code = (
        "import torch, pytest\n"
        "from _attention_cases import random_meta\n"
        "from memopd.ops.attention import packed_attention\n"
        "meta = random_meta(1, 40)\n"
        "q = torch.randn(meta.num_tokens, 2, 16)\n"
        "from memopd.ops.dispatch import BackendError\n"
        "with pytest.raises(BackendError, match='TRITON_INTERPRET'):\n"
        "    packed_attention(q, q, q, meta, backend='triton')\n"
        "print('raised')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__))), env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "raised" in res.stdout, res.stdout[-2000:] + res.stderr[-3000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU for the compiled Triton kernels")
@pytest.mark.parametrize(
    "dtype,D,Hq,Hkv",
    [(torch.bfloat16, 128, 8, 2), (torch.float16, 64, 4, 4), (torch.float32, 128, 4, 1)],
)
def test_cuda_triton_matches_torch_path(dtype, D, Hq, Hkv, monkeypatch):
    kern = pytest.importorskip("memopd.kernels.packed_attention")
    if kern.INTERPRET:
        pytest.skip("TRITON_INTERPRET=1 was set before the kernels were imported in this process")
    # the preferred fixed configuration, not the autotuner: one compile per kernel, and
    # the configuration a tuned run is most likely to pick (the benchmark runs the tuner)
    monkeypatch.setattr(kern, "AUTOTUNE", False)
    meta = random_meta(40 + D, 2000, shuffle=D == 128).to("cuda")
    q, k, v, do = make_inputs(meta.num_tokens, Hq, Hkv, D, dtype, D, device="cuda")
    assert resolve_backend(q) == "triton"
    want = oracle(q, k, v, do, meta)
    for det in (False, True):
        got = run("auto", q, k, v, do, meta, deterministic=det)
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            assert a.dtype == dtype
            assert_close(name, a, b, dtype)
    # the deterministic backward is bitwise reproducible on the GPU
    a = run("triton", q, k, v, do, meta, deterministic=True)
    b = run("triton", q, k, v, do, meta, deterministic=True)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_one_attention_autotuner_per_token_bucket(monkeypatch):
    """The attention kernels' autotuners are per size class of the stream's T
    (`tuning_bucket`), so the first call's T does not decide the tiles for every later one.
    Building a tuner needs no GPU: autotuning is switched on, the launchers run on CPU
    tensors up to the launch, and what they would launch is recorded instead."""
    kern = pytest.importorskip("memopd.kernels.packed_attention")
    if kern.INTERPRET:
        pytest.skip("the interpreter never autotunes (TRITON_INTERPRET=1 was set before the kernels were imported)")
    runtime = sys.modules["memopd.kernels.runtime"]
    ak = sys.modules["memopd.kernels.attention_kernels"]
    tuning = sys.modules["memopd.kernels.attention_tuning"]
    monkeypatch.setattr(kern, "AUTOTUNE", True)
    monkeypatch.setattr(kern, "_TUNERS", {})
    monkeypatch.setattr(runtime, "_AUTOTUNERS", {})
    sizes = (100, 5000, 8000, 20000, 10**6)
    for kind, raw, configs, key in (("fwd", ak.fwd_kernel, tuning.FWD_CONFIGS, ["HEAD_DIM", "GROUP", "PREC"]),
                                    ("dkdv", ak.bwd_dkdv_kernel, tuning.BWD_KV_CONFIGS,
                                     ["HEAD_DIM", "GROUP", "GROUP_P2", "PREC", "ATOMIC_DQ"]),
                                    ("dq", ak.bwd_dq_kernel, tuning.BWD_DQ_CONFIGS, ["HEAD_DIM", "GROUP", "PREC"])):
        tuner = {T: kern._tuner(kind, T) for T in sizes}
        assert tuner[5000] is tuner[8000] and tuner[20000] is tuner[10**6]
        assert len({id(t) for t in tuner.values()}) == 3
        for t in tuner.values():
            assert t.fn is raw and t.configs == configs and t.keys == key
            assert t.reset_to_zero == (["DQ"] if kind == "dkdv" else [])
    assert sorted(runtime._AUTOTUNERS) == sorted(f"{name}[T<={b}]" for b in (256, 8192, 16384)
                                                 for name in ("fwd_kernel", "bwd_dkdv_kernel", "bwd_dq_kernel"))
    # the launchers ask for the tuner of their own T
    launched, buckets = [], []
    monkeypatch.setattr(kern, "check_triton_inputs", lambda *a: None)
    monkeypatch.setattr(kern, "_launch_with_rerun", lambda raw, kernel, *a, **kw: launched.append(kernel))
    monkeypatch.setattr(kern, "_reduce_partials", lambda *a: None)  # the dK/dV split's sum (not tuned)
    for T in (300, 5000):
        meta = random_meta(T, T)
        T = meta.num_tokens
        q, k, v, do = make_inputs(T, 2, 1, 64, torch.float32, 0)
        out, lse = kern.packed_attention_fwd(q, k, v, meta.seg_start, meta.prefix_start, meta.prefix_end)
        kern.packed_attention_bwd(do, q, k, v, out, lse, meta.seg_start, meta.prefix_start, meta.prefix_end,
                                  deterministic=True)
        bucket = runtime.tuning_bucket(T)
        assert launched == [kern._TUNERS[kind, bucket] for kind in ("fwd", "dkdv", "dq")]
        buckets.append(bucket)
        launched_tuner = launched[0]
        launched.clear()
    assert len(set(buckets)) == 2  # two size classes, two tuners each
    # nothing is tuned where autotuning is off or the parameters are forced
    with monkeypatch.context() as forced:
        forced.setitem(tuning.FIXED, "BLOCK_M", 64)
        assert kern._tuner("fwd", 5000) is None
    assert kern._tuner("fwd", 5000) is launched_tuner
    monkeypatch.setattr(kern, "AUTOTUNE", False)
    assert kern._tuner("fwd", 5000) is None
