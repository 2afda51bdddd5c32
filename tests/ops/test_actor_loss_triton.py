"""The fused PPO actor loss on its Triton path, run by the Triton interpreter on CPU.

Same in-process / subprocess arrangement as test_fused_distill_triton.py (the
interpreter must be chosen before Triton is imported). Sizes stay tiny.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
from _fused_cases import as64, make_inputs

_CHILD = os.environ.get("MEMOPD_TRITON_INTERP_CHILD") == "1"
_TRITON_COMPILED_LOADED = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
IN_PROCESS = _CHILD or (not _TRITON_COMPILED_LOADED and not torch.cuda.is_available())
if IN_PROCESS:
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import memopd.kernels.actor_loss  # noqa: F401
    except ImportError:  # pragma: no cover - triton is a test dependency on Linux
        IN_PROCESS = False

from memopd.ops import fused_linear_actor_loss, reference_actor_loss  # noqa: E402

inproc = pytest.mark.skipif(not IN_PROCESS, reason="interpreted Triton runs in a subprocess here")


@pytest.mark.skipif(IN_PROCESS, reason="the interpreter tests run in this process")
def test_interpreter_suite_in_subprocess():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", MEMOPD_TRITON_INTERP_CHILD="1", CUDA_VISIBLE_DEVICES="")
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__], env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, f"interpreted Triton tests failed:\n{res.stdout[-5000:]}"


def _run(fn, inp, adv, old, teacher=True, **kw):
    if teacher:  # the ops require a weight with a teacher; 0 measures the KL only
        kw.setdefault("teacher_kl_coef", 0.0)
    out = fn(inp["hs"], inp["ws"], inp["y"], adv, old, student_bias=inp["bs"], mask=inp["mask"],
             teacher_hidden=inp["ht"] if teacher else None, teacher_weight=inp["wt"] if teacher else None,
             teacher_bias=inp["bt"] if teacher else None, **kw)
    params = [p for p in (inp["hs"], inp["ws"], inp["bs"]) if p is not None]
    return out, torch.autograd.grad(out.loss, params)


def _check(seed, inp, teacher=True, tol=3e-5, gtol=2e-4, **kw):
    g = torch.Generator().manual_seed(seed)
    N = inp["hs"].shape[0]
    adv, old = torch.randn(N, generator=g), -torch.rand(N, generator=g) * 4 - 0.5
    out, gr = _run(fused_linear_actor_loss, inp, adv, old, teacher, backend="triton", **kw)
    kw.pop("token_chunk_size", None)
    ref, grr = _run(reference_actor_loss, as64(inp), adv.double(), old.double(), teacher, **kw)
    assert math.isclose(float(out.loss), float(ref.loss), rel_tol=tol, abs_tol=tol), (seed, out.loss, ref.loss)
    for name in ("logprobs", "entropy", "kl", "ratio"):
        a, b = getattr(out, name).double(), getattr(ref, name)
        assert (a - b).abs().max() <= tol * (1 + b.abs().max()), (name, seed)
    assert torch.equal(out.clipped, ref.clipped)
    for name, a, b in zip(("dh", "dw", "db"), gr, grr):
        assert (a.double() - b).abs().max() <= gtol * (b.abs().max() + 1e-12), (name, seed)
    return out, gr


@inproc
@pytest.mark.parametrize("teacher", [True, False])
def test_values_and_grads_vs_float64(seed, teacher):
    inp = make_inputs(seed, N=40, Hs=24, Ht=20, V=150, Vt=157, teacher_bias=True)
    with torch.no_grad():
        inp["wt"][150:] = 40.0  # padded teacher rows never enter
    _check(seed, inp, teacher, vocab_size=150, temperature=1.3, entropy_coef=0.05, teacher_kl_coef=0.8, clip_eps=0.2,
           clip_eps_high=0.3, dual_clip=2.0, token_chunk_size=16)


@inproc
def test_close_distributions(seed):
    inp = make_inputs(seed, N=32, Hs=32, Ht=32, V=130, bias=False, teacher="close", scale=0.6)
    out, _ = _check(seed, inp, teacher_kl_coef=1.0)
    assert (out.kl >= 0).all() and out.kl.max() < 1e-4


@inproc
def test_bf16_inputs(seed):
    inp = make_inputs(seed, N=24, Hs=32, Ht=32, V=100, dtype=torch.bfloat16)
    _check(seed, inp, tol=2e-2, gtol=3e-2, teacher_kl_coef=0.5, entropy_coef=0.01)


@inproc
def test_all_masked(seed):
    inp = make_inputs(seed, N=20, V=70)
    inp["mask"] = torch.zeros(20, dtype=torch.bool)
    adv, old = torch.randn(20), -torch.rand(20)
    out, g = _run(fused_linear_actor_loss, inp, adv, old, backend="triton", teacher_kl_coef=1.0)
    assert float(out.loss) == 0.0 and all(x.abs().max() == 0 for x in g) and (out.ratio == 1).all()


@inproc
def test_matches_torch_path(seed):
    inp = make_inputs(seed, N=30, V=120, teacher_bias=True)
    adv, old = torch.randn(30), -torch.rand(30) * 3
    a, ga = _run(fused_linear_actor_loss, inp, adv, old, backend="triton", teacher_kl_coef=0.4, entropy_coef=0.02)
    b, gb = _run(fused_linear_actor_loss, inp, adv, old, backend="torch", teacher_kl_coef=0.4, entropy_coef=0.02)
    for name in ("loss", "logprobs", "entropy", "kl", "ratio"):
        torch.testing.assert_close(getattr(a, name), getattr(b, name), rtol=1e-5, atol=1e-6)
    for x, y_ in zip(ga, gb):
        torch.testing.assert_close(x, y_, rtol=1e-4, atol=1e-6)


@inproc
@pytest.mark.parametrize("teacher", [True, False])
def test_bf16_without_bias_rounds_the_grad_scratch(seed, teacher):
    # the production case (16-bit head, no bias): dL/dlogits is stored in bf16, rounded as
    # the GEMMs rounded their fp32 operand; with a bias it stays fp32 (summed unrounded)
    import memopd.kernels.lm_head_tiles as tiles

    assert tiles.grad_scratch_dtype(torch.bfloat16, need_db=False) == torch.bfloat16
    assert tiles.grad_scratch_dtype(torch.bfloat16, need_db=True) == torch.float32
    assert tiles.grad_scratch_dtype(torch.float32, need_db=False) == torch.float32
    inp = make_inputs(seed, N=24, Hs=32, Ht=32, V=100, dtype=torch.bfloat16, bias=False)
    _check(seed, inp, teacher, tol=2e-2, gtol=3e-2, teacher_kl_coef=0.5 if teacher else 0.0, entropy_coef=0.01)


@inproc
@pytest.mark.parametrize("bias", [True, False])
def test_dh_split_over_the_vocabulary(seed, bias, monkeypatch):
    # the dH GEMM in vocabulary shares with a fixed-order sum (what a GPU gets when a chunk's
    # grid would leave SMs idle; one SM here never splits): against float64, against the
    # unsplit GEMM up to fp32 summation order, and the same bits on a second call
    import memopd.kernels.lm_head_tiles as tiles

    inp = make_inputs(seed, N=40, Hs=24, Ht=20, V=150, bias=bias, teacher_bias=True)
    kw = dict(vocab_size=150, teacher_kl_coef=0.8, entropy_coef=0.05, token_chunk_size=16)
    _, unsplit = _check(seed, inp, **kw)
    plans = []
    monkeypatch.setattr(tiles, "dh_split_plan", lambda n, H, V, meta, dev: plans.append(n) or 3)
    _, split = _check(seed, inp, **kw)
    _, again = _check(seed, inp, **kw)
    assert sorted(set(plans)) == [8, 16]  # full chunks of 16 rows and the last one of 8
    assert torch.equal(split[0], again[0])
    assert (split[0] - unsplit[0]).abs().max() <= 1e-6 * unsplit[0].abs().max()
    for a, b in zip(split[1:], unsplit[1:]):  # dW, db do not depend on the dH plan
        assert torch.equal(a, b)


@inproc
@pytest.mark.parametrize("case", ["close", "shifted"])
def test_online_maxima_rising_along_the_row(seed, case):
    # logits that rise along the vocabulary, so the running maxima of the one-sweep sums
    # are raised in every tile: "close", p ~ q (the precise log-normaliser path, KL tiny);
    # "shifted", the teacher's ramp steeper than the student's, so that the two maxima rise
    # by different amounts and every earlier a' is shifted (a' stays below the plain limit)
    V, H = 300, 16
    inp = make_inputs(seed, N=24, Hs=H, Ht=H, V=V, bias=False, teacher="close", scale=0.3)
    ramp = torch.linspace(-6.0, 6.0, V)
    with torch.no_grad():
        for h in (inp["hs"], inp["ht"]):
            h[:, 0] = 1.0
        inp["ws"][:, 0] = ramp
        inp["wt"][:, 0] = ramp if case == "close" else 1.5 * ramp
    out, _ = _check(seed, inp, teacher_kl_coef=1.0, entropy_coef=0.02)
    keep = inp["mask"]
    if case == "close":
        # relative precision of a KL of 1e-9..1e-5 (the three-sweep kernel reached 2.2e-3
        # on such rows; the limit is the fp32 logits themselves)
        g = torch.Generator().manual_seed(seed)
        adv, old = torch.randn(24, generator=g), -torch.rand(24, generator=g) * 4 - 0.5
        (ref, _) = _run(reference_actor_loss, as64(inp), adv.double(), old.double(), teacher_kl_coef=1.0, entropy_coef=0.02)
        assert (out.kl >= 0).all() and out.kl.max() < 1e-3
        assert ((out.kl.double() - ref.kl)[keep].abs() / ref.kl[keep]).max() < 1e-2
    else:
        assert out.kl[keep].min() > 1e-2
