"""Fused linear distillation (and its teacher-less log-prob + entropy mode): the Triton
kernels, run by the Triton interpreter on CPU.

`TRITON_INTERPRET=1` has to be set before Triton itself is imported (Triton decorates
its own `tl.*` helpers at import time, in one mode or the other), so this file sets it
at the very top. Two ways to run:

* In process (a CPU-only session where Triton is not yet imported, the normal CI
  case): the variable is set and the kernel module imported. The variable is left
  set: Triton itself is now imported in interpreter mode for the whole process, so
  any Triton kernel imported later on this GPU-less machine needs the interpreter
  too (and Triton reads the variable again at launch time). Un-setting it afterwards
  would only make later modules disagree with the already-imported Triton.
* In a subprocess (a GPU host, or a session where Triton was already imported in
  compiled mode): the in-process tests are skipped and `test_interpreter_suite_in_subprocess`
  runs this same file in a fresh `python -m pytest` with TRITON_INTERPRET=1 and no
  visible GPU, so the interpreted Triton never shares a process with compiled kernels.

Sizes stay tiny (N <= 64, V <= 300, H <= 64): the interpreter runs each tile in numpy.
bf16 arithmetic is unreliable in the interpreter, so the kernels upcast loaded tiles to
fp32 there (the UPCAST constexpr); fp32 / fp16 / bf16 inputs are all exercised.
"""
from __future__ import annotations

import os
import subprocess
import sys

import _fused_cases as cases
import pytest
import torch
from _fused_cases import as64, reference_lpe_loss, run_lpe, run_lpe_loss, weighted_grads

_CHILD = os.environ.get("MEMOPD_TRITON_INTERP_CHILD") == "1"
_PREV_INTERPRET = os.environ.get("TRITON_INTERPRET")
_TRITON_COMPILED_LOADED = "triton" in sys.modules and _PREV_INTERPRET != "1"
IN_PROCESS = _CHILD or (not _TRITON_COMPILED_LOADED and not torch.cuda.is_available())

runtime = None
if IN_PROCESS:
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton  # noqa: F401
    except ImportError:  # pragma: no cover - triton is a test dependency on Linux
        IN_PROCESS = False
    else:
        import memopd.kernels.fused_distill  # noqa: F401
        import memopd.kernels.runtime as runtime

from memopd.ops import (  # noqa: E402
    fused_linear_distill,
    fused_linear_logprob_entropy,
    reference_linear_distill,
    reference_linear_logprob_entropy,
)
from memopd.ops.dispatch import BackendError  # noqa: E402

DIVS = ["reverse_kl", "forward_kl", "jsd"]
inproc = pytest.mark.skipif(not IN_PROCESS, reason="interpreted Triton runs in a subprocess here "
                            "(GPU host or Triton already imported in compiled mode)")


@pytest.mark.skipif(IN_PROCESS, reason="the interpreter tests run in this process")
def test_interpreter_suite_in_subprocess():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", MEMOPD_TRITON_INTERP_CHILD="1",
               CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    print(res.stdout[-5000:], res.stderr[-3000:])
    assert res.returncode == 0, f"interpreted Triton tests failed:\n{res.stdout[-5000:]}"


def make_inputs(seed, N=48, Hs=40, Ht=24, V=300, close=False, **kw):
    return cases.make_inputs(seed, N=N, Hs=Hs, Ht=Ht, V=V, teacher="close" if close else None, **kw)


def run(fn, inp, weights=None, **kw):
    out = fn(inp["hs"], inp["ws"], inp["ht"], inp["wt"], inp["y"], mask=inp["mask"],
             student_bias=inp["bs"], teacher_bias=inp["bt"], **kw)
    return out, None if weights is None else weighted_grads(out, inp, weights)


def weights_for(seed, N, which=("loss", "kl", "logprobs", "entropy")):
    g = torch.Generator().manual_seed(seed + 11)
    return {k: (torch.tensor(0.8) if k == "loss" else torch.randn(N, generator=g)) for k in which}


def assert_close(a, b, atol, rtol, what, seed):
    a, b = a.detach().double(), b.detach().double()
    assert torch.isfinite(a).all(), f"{what}: non-finite (seed={seed})"
    err = (a - b).abs()
    assert (err <= atol + rtol * b.abs()).all(), (
        f"{what}: max abs err {err.max().item():.3e} (atol={atol}, rtol={rtol}, seed={seed})")


def check(seed, inp, weights, kw, val_tol=(3e-5, 3e-5), grad_tol=(3e-5, 2e-4), **triton_kw):
    out, g = run(fused_linear_distill, inp, weights, backend="triton", **kw, **triton_kw)
    ref, gr = run(reference_linear_distill, as64(inp), weights, **kw)
    for name in ("loss", "kl", "logprobs", "entropy"):
        assert_close(getattr(out, name), getattr(ref, name), *val_tol, name, seed)
    for name, a, b in zip(("d_hidden", "d_weight", "d_bias"), g, gr):
        assert_close(a, b, grad_tol[0] * (b.abs().max().item() + 1e-12), grad_tol[1], name, seed)
    return out, g


@inproc
def test_runs_in_interpreter_mode():
    from memopd.ops.dispatch import interpreter_active

    assert runtime.INTERPRET and not runtime.USE_AUTOTUNE and interpreter_active()


@inproc
@pytest.mark.parametrize("gradients", [None, "recompute"], ids=["auto", "recompute"])
@pytest.mark.parametrize("divergence", DIVS)
def test_values_and_grads_vs_float64(seed, divergence, gradients):
    # padded teacher vocab, teacher bias, Hs != Ht, temperature, masked rows, and token
    # chunks of the scratch; "auto" takes the loss's gradients in the forward and
    # recomputes the per-token outputs' ones, "recompute" recomputes all of them
    inp = make_inputs(seed, V=300, Vt=311, teacher_bias=True)
    with torch.no_grad():
        inp["wt"][300:] = 40.0  # padded rows must never enter the teacher softmax
    check(seed, inp, weights_for(seed, 48),
          dict(divergence=divergence, temperature=1.4, vocab_size=300, beta=0.35),
          token_chunk_size=16, gradients=gradients)


@inproc
@pytest.mark.parametrize("which", ["kl", "logprobs", "entropy"])
def test_each_output_alone(seed, which):
    inp = make_inputs(seed, N=40, V=200)
    check(seed, inp, weights_for(seed, 40, (which,)), dict(temperature=0.8))


@inproc
def test_padded_student_vocab(seed):
    inp = make_inputs(seed, N=32, V=260, Vt=250)
    out, g = check(seed, inp, weights_for(seed, 32), dict(vocab_size=250))
    assert g[1][250:].abs().max() == 0 and g[2][250:].abs().max() == 0, f"seed={seed}"


@inproc
@pytest.mark.parametrize("divergence", DIVS)
def test_close_distributions(seed, divergence):
    inp = make_inputs(seed, N=48, Hs=32, V=300, bias=False, close=True, scale=0.6)
    out, _ = run(fused_linear_distill, inp, backend="triton", divergence=divergence)
    ref, _ = run(reference_linear_distill, as64(inp), divergence=divergence)
    err = (out.kl.double() - ref.kl).abs()
    assert (out.kl >= 0).all(), f"negative divergence (seed={seed})"
    assert err.max() <= 1e-6, f"abs err {err.max().item():.2e} (seed={seed})"
    # within 1% of the divergence, down to the fp32-logit floor (see test_fused_distill.py)
    kept = inp["mask"]
    excess = (err - (1e-2 * ref.kl.abs() + 2e-9))[kept]
    assert not kept.any() or excess.max() <= 0, f"excess {excess.max().item():.2e} (seed={seed})"


@inproc
@pytest.mark.parametrize("divergence", DIVS)
def test_far_distributions(seed, divergence):
    """More than 80 nats between student and teacher on the teacher's favourite token
    (tests/_fused_cases.far_inputs): values and gradients against float64, both gradient
    modes; the JSD stays at most log 2."""
    inp = cases.far_inputs(seed, N=16, V=64, close_rows=3)
    for gradients in (None, "recompute"):
        out, _ = check(seed, inp, weights_for(seed, 16), dict(divergence=divergence), gradients=gradients)
    if divergence == "jsd":
        assert out.kl.max().item() <= 0.6932, f"JSD above log 2: {out.kl.max().item():.4f} (seed={seed})"


@inproc
def test_all_masked(seed):
    inp = make_inputs(seed, N=40, V=150)
    inp["mask"] = torch.zeros(40, dtype=torch.bool)
    for div in DIVS:
        out, g = run(fused_linear_distill, inp, weights_for(seed, 40), backend="triton", divergence=div)
        assert out.loss.item() == 0.0, f"seed={seed}"
        for t in (out.kl, out.logprobs, out.entropy, *g):
            assert torch.isfinite(t).all() and t.abs().max() == 0, f"{div} (seed={seed})"


@inproc
def test_leading_rows_masked_and_partial_blocks(seed):
    # kept rows scattered behind masked ones: exercises the device-side compaction
    inp = make_inputs(seed, N=45, V=130)
    inp["mask"][:20] = False
    check(seed, inp, weights_for(seed, 45), dict(divergence="jsd", beta=0.7), token_chunk_size=8)


@inproc
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs(seed, dtype):
    inp = make_inputs(seed, N=32, Hs=32, Ht=32, V=160, dtype=dtype)
    # fp32 statistics keep the values tight; grads are rounded to the 16-bit dtype
    out, g = check(seed, inp, weights_for(seed, 32), dict(temperature=1.1), val_tol=(3e-5, 3e-5),
                   grad_tol=(1.5e-2, 1.5e-2))
    assert g[1].dtype == dtype


@inproc
def test_triton_matches_torch_path(seed):
    inp = make_inputs(seed, N=33, V=120, teacher_bias=True)  # one vocabulary split: no merge
    w = weights_for(seed, 33)
    a, ga = run(fused_linear_distill, inp, w, backend="triton", divergence="reverse_kl")
    b, gb = run(fused_linear_distill, inp, w, backend="torch", divergence="reverse_kl")
    for name in ("kl", "logprobs", "entropy"):
        assert_close(getattr(a, name), getattr(b, name), 2e-6, 1e-5, name, seed)
    for x, y_ in zip(ga, gb):
        assert_close(x, y_, 2e-6 * y_.abs().max().item(), 1e-4, "grad", seed)


# ----------------------------------------------------------------------------------
# teacher-less mode: fused_linear_logprob_entropy (HAS_TEACHER=False forward kernel)
# ----------------------------------------------------------------------------------
def check_lpe(seed, inp, weights, kw, val_tol=(3e-5, 3e-5), grad_tol=(3e-5, 2e-4), **triton_kw):
    out, g = run_lpe(fused_linear_logprob_entropy, inp, weights, backend="triton", **kw, **triton_kw)
    ref, gr = run_lpe(reference_linear_logprob_entropy, as64(inp), weights, **kw)
    for name in ("logprobs", "entropy"):
        assert getattr(out, name).dtype == torch.float32
        assert_close(getattr(out, name), getattr(ref, name), *val_tol, name, seed)
    for name, a, b in zip(("d_hidden", "d_weight", "d_bias"), g, gr):
        assert_close(a, b, grad_tol[0] * (b.abs().max().item() + 1e-12), grad_tol[1], name, seed)
    return out, g


@inproc
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_lpe_values_and_grads_vs_float64(seed, dtype):
    # 3 vocabulary splits (merged on the device), 28 padded lm_head rows with huge logits,
    # masked rows, temperature, bias, and a backward in several token chunks
    inp = make_inputs(seed, N=45, Hs=32, V=300, dtype=dtype)
    inp["y"] = inp["y"] % 272
    with torch.no_grad():
        inp["ws"][272:] = 30.0
        inp["bs"][272:] = 60.0
    half = dtype != torch.float32
    out, g = check_lpe(seed, inp, weights_for(seed, 45, ("logprobs", "entropy")),
                       dict(temperature=1.4, vocab_size=272),
                       grad_tol=(1.5e-2, 1.5e-2) if half else (3e-5, 2e-4), token_chunk_size=16)
    m = inp["mask"]
    assert (out.logprobs[~m] == 0).all() and (out.entropy[~m] == 0).all(), f"seed={seed}"
    assert g[1][272:].abs().max() == 0 and g[2][272:].abs().max() == 0, f"seed={seed}"
    assert (g[0][~m] == 0).all() and g[1].dtype == dtype, f"seed={seed}"


@inproc
@pytest.mark.parametrize("which", ["logprobs", "entropy"])
def test_lpe_each_output_alone_one_split(seed, which):
    inp = make_inputs(seed, N=33, V=120, bias=False)  # V <= 128: one split, no merge
    inp["mask"][:10] = False  # kept rows behind masked ones: device-side compaction
    check_lpe(seed, inp, weights_for(seed, 33, (which,)), dict(temperature=0.8))


@inproc
def test_lpe_matches_reverse_kl_and_torch_path(seed):
    inp = make_inputs(seed, N=40, V=260, teacher_bias=True)
    w = weights_for(seed, 40, ("logprobs", "entropy"))
    a, ga = run_lpe(fused_linear_logprob_entropy, inp, w, backend="triton", temperature=1.2)
    b, gb = run(fused_linear_distill, inp, w, backend="triton", temperature=1.2)
    c, gc = run_lpe(fused_linear_logprob_entropy, inp, w, backend="torch", temperature=1.2)
    for name in ("logprobs", "entropy"):
        # same student tiles, same merge: the teacher-less kernel gives the same numbers
        assert_close(getattr(a, name), getattr(b, name), 1e-6, 1e-6, name, seed)
        assert_close(getattr(a, name), getattr(c, name), 2e-6, 1e-5, name + " vs torch", seed)
    for x, y_, z in zip(ga, gb, gc):
        assert_close(x, y_, 1e-6 * y_.abs().max().item(), 1e-5, "grad vs reverse_kl", seed)
        assert_close(x, z, 2e-6 * z.abs().max().item(), 1e-4, "grad vs torch", seed)


@inproc
def test_lpe_all_masked_and_no_grad(seed):
    inp = make_inputs(seed, N=40, V=150)
    inp["mask"] = torch.zeros(40, dtype=torch.bool)
    out, g = run_lpe(fused_linear_logprob_entropy, inp, weights_for(seed, 40, ("logprobs", "entropy")),
                     backend="triton")
    for t in (out.logprobs, out.entropy, *g):
        assert torch.isfinite(t).all() and t.abs().max() == 0, f"seed={seed}"
    inp = make_inputs(seed, N=40, V=150)
    with torch.no_grad():
        ng, _ = run_lpe(fused_linear_logprob_entropy, inp, backend="triton")
    ref, _ = run_lpe(reference_linear_logprob_entropy, as64(inp))
    assert ng.logprobs.grad_fn is None
    assert_close(ng.logprobs, ref.logprobs, 3e-5, 3e-5, "no-grad logprobs", seed)
    assert_close(ng.entropy, ref.entropy, 3e-5, 3e-5, "no-grad entropy", seed)


@inproc
def test_lpe_float64_refused_on_triton():
    h, w = torch.randn(4, 8, dtype=torch.float64), torch.randn(16, 8, dtype=torch.float64)
    with pytest.raises(BackendError, match="float64"):
        fused_linear_logprob_entropy(h, w, torch.zeros(4, dtype=torch.long), backend="triton")


# ----------------------------------------------------------------------------------
# teacher-less mode with its loss declared: fused_linear_logprob_entropy(logprob_weight=, ...) (the
# forward-grads row kernel without a teacher, or the recomputing kernels)
# ----------------------------------------------------------------------------------
def lpe_loss_weights(seed, N):
    g = torch.Generator().manual_seed(seed + 21)
    return -torch.randn(N, generator=g), 0.5 * torch.randn(N, generator=g)


def check_lpe_loss(seed, inp, weights, kw, extra=None, grad_tol=(3e-5, 2e-4), **triton_kw):
    out, g = run_lpe_loss(fused_linear_logprob_entropy, inp, *weights, extra=extra, backend="triton", **kw,
                          **triton_kw)
    ref, gr = reference_lpe_loss(inp, *weights, extra=extra, **kw)
    for name in ("loss", "logprobs", "entropy"):
        assert getattr(out, name).dtype == torch.float32
        assert_close(getattr(out, name), getattr(ref, name), 3e-5, 3e-5, name, seed)
    for name, a, b in zip(("d_hidden", "d_weight", "d_bias"), g, gr):
        assert_close(a, b, grad_tol[0] * (b.abs().max().item() + 1e-12), grad_tol[1], name, seed)
    return out, g


@inproc
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lpe_loss_vs_float64_and_recompute(seed, dtype):
    # ragged N = 37 over token chunks of 16, vocab_size = 203 (padded scratch rows) with
    # 7 padded lm_head rows of huge logits, masked rows first and between, temperature, bias
    inp = make_inputs(seed, N=37, Hs=24, V=210, dtype=dtype)
    inp["y"] = inp["y"] % 203
    inp["mask"][:5] = False
    with torch.no_grad():
        inp["ws"][203:] = 30.0
        inp["bs"][203:] = 60.0
    half = dtype != torch.float32
    kw = dict(temperature=1.3, vocab_size=203)
    w = lpe_loss_weights(seed, 37)
    fwd, gf = check_lpe_loss(seed, inp, w, kw, grad_tol=(1.5e-2, 1.5e-2) if half else (3e-5, 2e-4),
                             gradients="forward", token_chunk_size=16)
    rec, gr = run_lpe_loss(fused_linear_logprob_entropy, inp, *w, backend="triton", gradients="recompute", **kw)
    if not half:
        for name in ("loss", "logprobs", "entropy"):
            assert_close(getattr(fwd, name), getattr(rec, name), 2e-6, 2e-5, name + " vs recompute", seed)
        for name, a, b in zip(("d_hidden", "d_weight", "d_bias"), gf, gr):
            assert_close(a, b, 2e-6 * b.abs().max().item(), 1e-4, name + " vs recompute", seed)
    assert gf[1][203:].abs().max() == 0 and gf[2][203:].abs().max() == 0, f"padded rows got gradient (seed={seed})"
    assert (gf[0][~inp["mask"]] == 0).all() and gf[1].dtype == dtype, f"seed={seed}"


@inproc
def test_lpe_loss_float_weights_and_per_token_gradients_too(seed):
    # float weights (one of them 0: no entropy term in the kernel), and gradients reaching
    # logprobs / entropy as well: the held loss gradient plus the recomputing backward's
    inp = make_inputs(seed, N=30, V=150, bias=False)
    g = torch.Generator().manual_seed(seed + 5)
    extra = {"logprobs": torch.randn(30, generator=g), "entropy": torch.randn(30, generator=g)}
    check_lpe_loss(seed, inp, (-0.7, 0.0), dict(temperature=0.9), gradients="forward")
    check_lpe_loss(seed, inp, (-0.7, -0.05), dict(temperature=0.9), extra=extra, gradients="forward")


@inproc
def test_lpe_loss_all_masked(seed):
    inp = make_inputs(seed, N=24, V=130)
    inp["mask"] = torch.zeros(24, dtype=torch.bool)
    for gradients in ("forward", "recompute"):
        out, g = run_lpe_loss(fused_linear_logprob_entropy, inp, *lpe_loss_weights(seed, 24), backend="triton",
                              gradients=gradients)
        assert out.loss.item() == 0.0, f"{gradients} (seed={seed})"
        for t in (out.logprobs, out.entropy, *g):
            assert torch.isfinite(t).all() and t.abs().max() == 0, f"{gradients} (seed={seed})"


@inproc
def test_lpe_loss_launches_three_matmuls_per_chunk_and_the_backward_none(seed, monkeypatch):
    spy = _Launches(monkeypatch)
    inp = make_inputs(seed, N=40, V=150)
    w = lpe_loss_weights(seed, 40)

    def call(**kw):
        return fused_linear_logprob_entropy(inp["hs"], inp["ws"], inp["y"], logprob_weight=w[0],
                                            entropy_weight=w[1], bias=inp["bs"], mask=inp["mask"],
                                            backend="triton", **kw)

    out = call(token_chunk_size=16)  # gradients=None: in the forward; ceil(40 / 16) = 3 chunks
    assert spy.take() == ["distill_rows.launch_scaled_logits", "lm_head_tiles.launch_dh",
                          "lm_head_tiles.launch_dw"] * 3
    out.loss.backward()
    assert spy.take() == [], "the backward launched kernels: it should only scale"
    assert inp["hs"].grad is not None and inp["ws"].grad is not None and inp["bs"].grad is not None
    out = call(gradients="recompute")  # for contrast: a forward, then a backward that recomputes the logits
    assert spy.take() == ["fused_distill.distill_forward"]
    out.loss.backward()
    assert spy.take() == ["fused_distill.distill_backward", "fused_distill.launch_dh", "fused_distill.launch_dw"]


# ----------------------------------------------------------------------------------
# gradients in the forward (memopd.kernels.distill_rows): logits scratch, row kernel,
# dH / dW GEMMs in the forward; the backward only scales
# ----------------------------------------------------------------------------------
REDUCTIONS = ["mean", "sum"]


@inproc
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("divergence", DIVS)
def test_forward_grads_vs_float64_and_recompute(seed, divergence, reduction):
    # vocab_size = 203 (not a multiple of 16 or 64: padded scratch rows), padded student and
    # teacher lm_head rows with huge logits, teacher bias, Hs != Ht, temperature, masked
    # rows, ragged N = 37 over token chunks of 16 (the last chunk 5 rows)
    inp = make_inputs(seed, N=37, Hs=24, Ht=20, V=210, Vt=215, teacher_bias=True)
    inp["y"] = inp["y"] % 203
    with torch.no_grad():
        inp["ws"][203:] = 30.0
        inp["wt"][203:] = 40.0
    kw = dict(divergence=divergence, temperature=1.3, vocab_size=203, beta=0.35, reduction=reduction)
    loss_only = {"loss": 0.8}
    fwd, gf = check(seed, inp, loss_only, kw, gradients="forward", token_chunk_size=16)
    rec, gr = run(fused_linear_distill, inp, loss_only, backend="triton", gradients="recompute", **kw)
    for name in ("loss", "kl", "logprobs", "entropy"):
        assert_close(getattr(fwd, name), getattr(rec, name), 2e-6, 2e-5, name + " vs recompute", seed)
    for name, a, b in zip(("d_hidden", "d_weight", "d_bias"), gf, gr):
        assert_close(a, b, 2e-6 * b.abs().max().item(), 1e-4, name + " vs recompute", seed)
    assert gf[1][203:].abs().max() == 0 and gf[2][203:].abs().max() == 0, f"padded rows got gradient (seed={seed})"
    assert (gf[0][~inp["mask"]] == 0).all(), f"masked rows got gradient (seed={seed})"


@inproc
def test_forward_grads_with_per_token_gradients_too(seed):
    # loss and per-token outputs both get gradients: the held loss gradient plus the
    # recomputing backward for the rest (Triton on both sides), against float64
    inp = make_inputs(seed, N=30, V=150, bias=False)
    check(seed, inp, weights_for(seed, 30), dict(divergence="jsd", beta=0.6), gradients="forward")


@inproc
@pytest.mark.parametrize("divergence", DIVS)
def test_forward_grads_close_distributions(seed, divergence):
    # p ≈ q: the precise lse_s - lse_t keeps the divergence (and its gradient) accurate
    inp = make_inputs(seed, N=40, Hs=32, V=250, bias=False, close=True, scale=0.6)
    out, g = run(fused_linear_distill, inp, {"loss": 1.0}, backend="triton", divergence=divergence,
                 gradients="forward")
    ref, gr = run(reference_linear_distill, as64(inp), {"loss": 1.0}, divergence=divergence)
    err = (out.kl.double() - ref.kl).abs()
    kept = inp["mask"]
    assert (out.kl >= 0).all(), f"negative divergence (seed={seed})"
    assert err.max() <= 1e-6, f"abs err {err.max().item():.2e} (seed={seed})"
    excess = (err - (1e-2 * ref.kl.abs() + 2e-9))[kept]
    assert not kept.any() or excess.max() <= 0, f"excess {excess.max().item():.2e} (seed={seed})"
    # the gradient of a tiny divergence: relative to its own size, not to a unit scale
    for name, a, b in zip(("d_hidden", "d_weight"), g, gr):
        assert_close(a, b, 1e-2 * b.abs().max().item(), 1e-2, name, seed)


@inproc
def test_forward_grads_all_masked(seed):
    inp = make_inputs(seed, N=24, V=130)
    inp["mask"] = torch.zeros(24, dtype=torch.bool)
    for div in DIVS:
        for reduction in REDUCTIONS:
            out, g = run(fused_linear_distill, inp, {"loss": 1.0}, backend="triton", divergence=div,
                         reduction=reduction, gradients="forward")
            assert out.loss.item() == 0.0, f"{div} {reduction} (seed={seed})"
            for t in (out.kl, out.logprobs, out.entropy, *g):
                assert torch.isfinite(t).all() and t.abs().max() == 0, f"{div} {reduction} (seed={seed})"


@inproc
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_grads_dtypes(seed, dtype):
    # kept rows behind masked ones, no student bias in fp32, a bias in bf16
    inp = make_inputs(seed, N=32, Hs=32, Ht=32, V=170, dtype=dtype, bias=dtype != torch.float32)
    inp["mask"][:9] = False
    half = dtype != torch.float32
    _, g = check(seed, inp, {"loss": 0.9}, dict(divergence="reverse_kl", temperature=0.9),
                 grad_tol=(1.5e-2, 1.5e-2) if half else (3e-5, 2e-4), gradients="forward", token_chunk_size=8)
    assert g[1].dtype == dtype


def _direct_inputs(seed, teacher=True, dtype=torch.float32, N=29, V=133):
    from memopd.kernels.contract import LinearHead

    inp = make_inputs(seed, N=N, Hs=24, Ht=20, V=V, dtype=dtype, teacher_bias=True)
    inp["mask"][3] = False
    student = LinearHead(inp["hs"].detach(), inp["ws"].detach(), inp["bs"].detach())
    tea = LinearHead(inp["ht"], inp["wt"], inp["bt"]) if teacher else None
    g = torch.Generator().manual_seed(seed + 3)
    grads = tuple(torch.randn(N, generator=g) for _ in range(3))
    if not teacher:
        grads = (None,) + grads[1:]
    return inp, student, tea, grads


@inproc
@pytest.mark.parametrize("divergence", DIVS + [None], ids=DIVS + ["no-teacher"])
def test_forward_with_grads_matches_the_torch_contract(seed, divergence):
    """`distill_forward_with_grads` against `torch_forward_with_grads`, output by output
    (divergence, log-probs, entropy, every DistillStat row, dh, dw, db), for a loss with
    all three per-token terms; teacher-less: log-prob and entropy terms only."""
    from memopd.kernels.contract import DistillParams, Divergence
    from memopd.kernels.distill_rows import distill_forward_with_grads
    from memopd.ops.distill_torch import torch_forward_with_grads

    inp, student, teacher, grads = _direct_inputs(seed, teacher=divergence is not None)
    div_code = Divergence.from_name(divergence or "reverse_kl", 0.3)
    params = DistillParams(1.2, 133, div_code, 0.3, 0, 8)
    need = (True, True, True)
    got = distill_forward_with_grads(grads, student, teacher, inp["y"], inp["mask"], params, need)
    want = torch_forward_with_grads(student, teacher, inp["y"], inp["mask"], DistillParams(1.2, 133, div_code, 0.3),
                                    lambda rows, *_: tuple(None if x is None else x.index_select(0, rows) for x in grads),
                                    need)
    names = ("divergence", "logprobs", "entropy", "stats", "dh", "dw", "db")
    for name, a, b in zip(names, got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        if name == "stats":
            for r in range(b.shape[0]):
                assert_close(a[r], b[r], 2e-6, 2e-5, f"stats row {r}", seed)
        else:
            scale = b.abs().max().item() if name in ("dh", "dw", "db") else 1.0
            assert_close(a, b, 2e-6 * scale, 1e-4, name, seed)
    m = inp["mask"]
    assert all((t[..., ~m] == 0).all() for t in got[:4]), f"masked tokens not zero (seed={seed})"


class _Launches:
    """Names of the lm-head launches (logits, dH, dW) of the forward-grads path and the
    recomputing path's entry points, in call order."""

    def __init__(self, monkeypatch):
        import memopd.kernels.distill_rows as dr
        import memopd.kernels.fused_distill as kfd
        import memopd.kernels.lm_head_tiles as tiles

        self.calls = []
        # the forward-grads path's GEMMs are launched by lm_head_tiles.ChunkGradients; the
        # recomputing backward launches its own
        for mod, names in ((dr, ("launch_scaled_logits",)), (tiles, ("launch_dh", "launch_dw")),
                           (kfd, ("distill_forward", "jsd_second_pass", "distill_backward", "launch_dh", "launch_dw"))):
            for name in names:
                monkeypatch.setattr(mod, name, self._spy(f"{mod.__name__.rsplit('.', 1)[1]}.{name}", getattr(mod, name)))

    def _spy(self, label, fn):
        def wrapped(*args, **kwargs):
            self.calls.append(label)
            return fn(*args, **kwargs)
        return wrapped

    def take(self):
        out, self.calls = self.calls, []
        return out


@inproc
@pytest.mark.parametrize("divergence", DIVS)
def test_forward_grads_launch_four_matmuls_per_chunk_and_the_backward_none(seed, divergence, monkeypatch):
    spy = _Launches(monkeypatch)
    inp = make_inputs(seed, N=40, V=150)
    out = fused_linear_distill(inp["hs"], inp["ws"], inp["ht"], inp["wt"], inp["y"], mask=inp["mask"],
                               student_bias=inp["bs"], divergence=divergence, backend="triton", token_chunk_size=16)
    per_chunk = ["distill_rows.launch_scaled_logits"] * 2 + ["lm_head_tiles.launch_dh", "lm_head_tiles.launch_dw"]
    # gradients=None on Triton: the forward-grads path; ceil(40 / 16) = 3 chunks
    assert spy.take() == per_chunk * 3
    out.loss.backward()
    assert spy.take() == [], "the backward launched kernels: it should only scale"
    assert inp["hs"].grad is not None and inp["ws"].grad is not None and inp["bs"].grad is not None
    # the recomputing path, for contrast: forward kernels, then a backward that recomputes
    out = fused_linear_distill(inp["hs"], inp["ws"], inp["ht"], inp["wt"], inp["y"], mask=inp["mask"],
                               divergence=divergence, backend="triton", gradients="recompute")
    assert "fused_distill.distill_forward" in spy.take()
    out.loss.backward()
    assert spy.take() == ["fused_distill.distill_backward"] + ["fused_distill.launch_dh", "fused_distill.launch_dw"]


@inproc
def test_teacher_less_forward_grads_launch_three_matmuls_per_chunk(seed, monkeypatch):
    from memopd.kernels.contract import DistillParams, Divergence
    from memopd.kernels.distill_rows import distill_forward_with_grads

    spy = _Launches(monkeypatch)
    inp, student, _, grads = _direct_inputs(seed, teacher=False, N=20)
    distill_forward_with_grads(grads, student, None, inp["y"], inp["mask"],
                               DistillParams(1.0, 133, Divergence.REVERSE_KL, 0.5, 0, 8), (True, True, False))
    assert spy.take() == ["distill_rows.launch_scaled_logits", "lm_head_tiles.launch_dh", "lm_head_tiles.launch_dw"] * 3


@inproc
@pytest.mark.parametrize("divergence", DIVS)
def test_forward_grads_bf16_scratch_and_dh_split(seed, divergence, monkeypatch):
    # the production case (bf16 head, no bias): dL/dlogits goes to a bf16 scratch, and dH is
    # split over the vocabulary with a fixed-order sum (what a GPU gets where a chunk's grid
    # would leave SMs idle; one SM here never splits): against the recomputing path, the
    # unsplit GEMM up to fp32 summation order, and the same bits on a second call
    import memopd.kernels.lm_head_tiles as tiles

    inp = make_inputs(seed, N=40, Hs=32, Ht=32, V=150, dtype=torch.bfloat16, bias=False)
    kw = dict(divergence=divergence, backend="triton", token_chunk_size=16)
    dtypes = []
    real_dh = tiles.launch_dh
    monkeypatch.setattr(tiles, "launch_dh", lambda g, *a, **k: dtypes.append(g.dtype) or real_dh(g, *a, **k))
    _, unsplit = run(fused_linear_distill, inp, {"loss": 1.0}, gradients="forward", **kw)
    assert dtypes and set(dtypes) == {torch.bfloat16}, f"gradient scratch dtypes {set(dtypes)}"
    _, rec = run(fused_linear_distill, inp, {"loss": 1.0}, gradients="recompute", **kw)
    for name, a, b in zip(("d_hidden", "d_weight"), unsplit, rec):
        assert_close(a, b, 1.5e-2 * b.float().abs().max().item(), 1.5e-2, name + " vs recompute", seed)
    plans = []
    monkeypatch.setattr(tiles, "dh_split_plan", lambda n, H, V, meta, dev: plans.append(n) or 3)
    _, split = run(fused_linear_distill, inp, {"loss": 1.0}, gradients="forward", **kw)
    _, again = run(fused_linear_distill, inp, {"loss": 1.0}, gradients="forward", **kw)
    assert sorted(set(plans)) == [8, 16]  # full chunks of 16 rows and the last one of 8
    assert torch.equal(split[0], again[0])
    err = (split[0].float() - unsplit[0].float()).abs().max().item()
    assert err <= 1e-2 * unsplit[0].float().abs().max().item(), f"split dH vs unsplit: {err:.2e} (seed={seed})"
    assert torch.equal(split[1], unsplit[1])  # dW does not depend on the dH plan
