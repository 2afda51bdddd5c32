"""The fused PPO actor loss (`memopd.ops.fused_linear_actor_loss`), PyTorch path.

Checked against the float64 materialising reference and against the composition it
replaces (`fused_linear_reverse_kl` + the PPO surrogate + the entropy bonus, as the
trainer composed them), on the hard cases: p ~ q, fully masked rows and batches, ratios
at and beyond both clip edges, dual clip, padded vocabularies, ragged token blocks,
micro-batches that must sum to one batch; plus the matmul count (4, or 3 without a
teacher), the "no [N, V] tensor" probe, no-grad, torch.compile and bad inputs.
"""
from __future__ import annotations

import math

import pytest
import torch
from _fused_cases import CountMatmuls, LargestTensor, as64, make_inputs

from memopd.ops import fused_linear_actor_loss, fused_linear_reverse_kl, reference_actor_loss
from memopd.ops.dispatch import BackendError
from memopd.trainer.ppo import policy_loss

FIELDS = ("logprobs", "entropy", "kl", "ratio")


def ppo_inputs(seed, N, clip_edges=False, eps=0.2):
    g = torch.Generator().manual_seed(seed + 7)
    adv = torch.randn(N, generator=g)
    old = -torch.rand(N, generator=g) * 4 - 0.5
    return adv, old


def call(fn, inp, adv, old, teacher=True, **kw):
    if teacher and "kl_coef" not in kw:  # the ops require a weight with a teacher; 0 measures the KL only
        kw.setdefault("teacher_kl_coef", 0.0)
    return fn(inp["hs"], inp["ws"], inp["y"], adv, old, student_bias=inp["bs"], mask=inp["mask"],
              teacher_hidden=inp["ht"] if teacher else None, teacher_weight=inp["wt"] if teacher else None,
              teacher_bias=inp["bt"] if teacher else None, **kw)


def grads(out, inp):
    params = [p for p in (inp["hs"], inp["ws"], inp["bs"]) if p is not None]
    return torch.autograd.grad(out.loss, params)


def compare(seed, inp, adv, old, teacher=True, val_tol=2e-5, grad_tol=2e-5, fused_kw=None, **kw):
    """Fused (fp32 or its own dtype) vs float64 reference: values and all gradients."""
    out = call(fused_linear_actor_loss, inp, adv, old, teacher, **kw, **(fused_kw or {}))
    g = grads(out, inp)
    i64 = as64(inp)
    ref = call(reference_actor_loss, i64, adv.double(), old.double(), teacher, **kw)
    gr = grads(ref, i64)
    assert math.isclose(float(out.loss), float(ref.loss), rel_tol=val_tol, abs_tol=val_tol), (seed, out.loss, ref.loss)
    for name in FIELDS:
        a, b = getattr(out, name).double(), getattr(ref, name)
        assert (a - b).abs().max() <= val_tol * (1 + b.abs().max()), (name, seed, (a - b).abs().max())
    assert torch.equal(out.clipped, ref.clipped), seed
    for name, a, b in zip(("dh", "dw", "db"), g, gr):
        scale = b.abs().max().item() + 1e-12
        assert (a.double() - b).abs().max() <= grad_tol * scale, (name, seed, (a.double() - b).abs().max(), scale)
    return out, g


@pytest.mark.parametrize("teacher", [True, False])
def test_values_and_grads_vs_float64(seed, teacher):
    inp = make_inputs(seed, N=48, Hs=24, Ht=20, V=301, teacher_bias=True)
    adv, old = ppo_inputs(seed, 48)
    compare(seed, inp, adv, old, teacher, entropy_coef=0.03, teacher_kl_coef=0.7, temperature=1.3, clip_eps=0.2,
            clip_eps_high=0.28, fused_kw=dict(token_chunk_size=7))


def test_float64_inputs_are_exact(seed):
    inp = as64(make_inputs(seed, N=30, V=211, teacher_bias=True))
    adv, old = ppo_inputs(seed, 30)
    compare(seed, inp, adv.double(), old.double(), val_tol=1e-12, grad_tol=1e-12, entropy_coef=0.05,
            teacher_kl_coef=0.4, dual_clip=3.0)


def test_ratio_at_and_beyond_both_clip_edges(seed):
    """Old log-probs placed so that ratios sit exactly on, inside and beyond 1 +- eps."""
    inp = make_inputs(seed, N=40, V=150, mask_p=0.0)
    eps = 0.2
    with torch.no_grad():
        lp = call(reference_actor_loss, as64(inp), torch.zeros(40, dtype=torch.float64),
                  torch.zeros(40, dtype=torch.float64)).logprobs.float()
    factors = torch.tensor([1 - eps, 1 + eps, 0.5, 1.7, 1.0, 0.95, 1.05, 0.79, 1.21, 3.0] * 4)
    old = lp - torch.log(factors)  # ratio = factors
    adv = torch.tensor([1.0, -1.0] * 20)
    out, _ = compare(seed, inp, adv, old, teacher=False, clip_eps=eps)
    assert out.clipped.any() and (~out.clipped).any()
    torch.testing.assert_close(out.ratio, factors, rtol=1e-5, atol=1e-6)
    # dual clip caps the loss of negative advantages whose ratio is far above 1
    out, _ = compare(seed, inp, adv, old, teacher=False, clip_eps=eps, dual_clip=1.5)
    assert out.clipped[(adv < 0) & (factors > 1.5 + 1e-3)].all()


def test_close_distributions(seed):
    """Teacher = student + 1e-3 noise: KL ~1e-6, still accurate in fp32."""
    inp = make_inputs(seed, N=48, Hs=32, Ht=32, V=300, bias=False, teacher="close", scale=0.6)
    adv, old = ppo_inputs(seed, 48)
    out, _ = compare(seed, inp, adv, old, teacher_kl_coef=1.0, val_tol=2e-5, grad_tol=5e-5)
    ref = call(reference_actor_loss, as64(inp), adv.double(), old.double(), teacher_kl_coef=1.0)
    kept = inp["mask"]
    rel = ((out.kl.double() - ref.kl).abs() / ref.kl.abs().clamp_min(1e-12))[kept]
    assert ref.kl[kept].max() < 1e-4 and rel.max() < 1e-2, (rel.max(), ref.kl[kept].max())
    assert (out.kl >= 0).all()


def test_identical_teacher_gives_zero_kl(seed):
    inp = make_inputs(seed, N=20, Hs=16, Ht=16, V=100)
    inp["ht"], inp["wt"], inp["bt"] = inp["hs"].detach(), inp["ws"].detach(), inp["bs"].detach()
    adv, old = ppo_inputs(seed, 20)
    out = call(fused_linear_actor_loss, inp, adv, old, teacher_kl_coef=1.0)
    assert out.kl.abs().max() < 1e-6


@pytest.mark.parametrize("pad", ["student", "teacher"])
def test_padded_vocab(seed, pad):
    V = 200
    inp = make_inputs(seed, N=32, V=V + 13 if pad == "student" else V, Vt=V + 13 if pad == "teacher" else V)
    with torch.no_grad():
        if pad == "student":
            inp["ws"][V:] = 30.0
        else:
            inp["wt"][V:] = 30.0
    adv, old = ppo_inputs(seed, 32)
    _, g = compare(seed, inp, adv, old, vocab_size=V, teacher_kl_coef=0.5, entropy_coef=0.01)
    if pad == "student":
        assert g[1][V:].abs().max() == 0 and g[2][V:].abs().max() == 0


def test_all_masked_and_masked_rows(seed):
    inp = make_inputs(seed, N=24, V=90)
    adv, old = ppo_inputs(seed, 24)
    inp["mask"] = torch.zeros(24, dtype=torch.bool)
    out = call(fused_linear_actor_loss, inp, adv, old, teacher_kl_coef=1.0, entropy_coef=0.1)
    g = grads(out, inp)
    assert float(out.loss) == 0.0 and all(x.abs().max() == 0 for x in g)
    assert (out.ratio == 1).all() and not out.clipped.any()
    inp = make_inputs(seed, N=24, V=90, mask_p=0.5)
    out, g = compare(seed, inp, adv, old, teacher_kl_coef=1.0, entropy_coef=0.1)
    dead = ~inp["mask"]
    assert g[0][dead].abs().max() == 0 and out.logprobs[dead].abs().max() == 0


def test_kl_mask_and_normalizers(seed):
    inp = make_inputs(seed, N=40, V=120)
    adv, old = ppo_inputs(seed, 40)
    g = torch.Generator().manual_seed(seed)
    klm = torch.rand(40, generator=g) > 0.4
    compare(seed, inp, adv, old, kl_mask=klm, teacher_kl_coef=0.9, entropy_coef=0.02, normalizer=77.0, kl_normalizer=31.0)


def test_micro_batches_sum_to_one_batch(seed):
    """Two calls with the global normalisers give the gradient of one call on the batch."""
    inp = make_inputs(seed, N=50, V=160, mask_p=0.2)
    adv, old = ppo_inputs(seed, 50)
    kw = dict(teacher_kl_coef=0.6, entropy_coef=0.02)
    full = call(fused_linear_actor_loss, inp, adv, old, **kw)
    g_full = grads(full, inp)
    n = float(inp["mask"].sum())
    total = 0.0
    acc = [torch.zeros_like(x) for x in g_full]
    for sl in (slice(0, 19), slice(19, 50)):
        part = {k: (v[sl] if k in ("hs", "ht", "y", "mask") else v) for k, v in inp.items()}
        out = fused_linear_actor_loss(part["hs"], inp["ws"], part["y"], adv[sl], old[sl], student_bias=inp["bs"],
                                      mask=part["mask"], teacher_hidden=part["ht"], teacher_weight=inp["wt"],
                                      normalizer=n, kl_normalizer=n, **kw)
        gh, gw, gb = torch.autograd.grad(out.loss, (inp["hs"], inp["ws"], inp["bs"]))
        acc = [acc[0] + gh, acc[1] + gw, acc[2] + gb]
        total += float(out.loss)
    assert math.isclose(total, float(full.loss), rel_tol=1e-5, abs_tol=1e-6)
    for a, b in zip(acc, g_full):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_equals_the_composition_it_replaces(seed):
    """fused_linear_reverse_kl + PPO surrogate + entropy bonus, as the trainer composed them."""
    inp = make_inputs(seed, N=40, V=250, teacher_bias=True, mask_p=0.0)
    adv, old = ppo_inputs(seed, 40)
    T, alpha, lam, eps = 0.9, 0.01, 0.5, 0.2
    out = call(fused_linear_actor_loss, inp, adv, old, temperature=T, entropy_coef=alpha, teacher_kl_coef=lam, clip_eps=eps)
    g1 = grads(out, inp)
    d = fused_linear_reverse_kl(inp["hs"], inp["ws"], inp["ht"], inp["wt"], inp["y"], student_bias=inp["bs"],
                                teacher_bias=inp["bt"], temperature=T, reduction="none")
    pg, st = policy_loss(d.logprobs, old, adv, eps)
    n = 40
    loss = (pg.sum() - alpha * d.entropy.sum()) / n + lam * d.kl.sum() / n
    g2 = grads(type(out)(loss, *out[1:]), inp)
    assert math.isclose(float(out.loss), float(loss), rel_tol=1e-5)
    assert math.isclose(float(out.clipped.float().mean()), float(st.clip_frac), abs_tol=1e-7)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_four_matmuls_three_without_teacher(seed):
    inp = make_inputs(seed, N=40, V=300, Hs=24, Ht=24)
    adv, old = ppo_inputs(seed, 40)
    with CountMatmuls() as m:  # one token block: the count is per block
        out = call(fused_linear_actor_loss, inp, adv, old, teacher_kl_coef=1.0, token_chunk_size=64)
        grads(out, inp)
    assert m.n == 4, m.n
    with CountMatmuls() as m:
        out = call(fused_linear_actor_loss, inp, adv, old, teacher=False, token_chunk_size=64)
        grads(out, inp)
    assert m.n == 3, m.n
    with torch.no_grad(), CountMatmuls() as m:  # scoring only: the logits matmuls
        call(fused_linear_actor_loss, inp, adv, old, teacher_kl_coef=1.0, token_chunk_size=64)
    assert m.n == 2, m.n


def test_never_materialises_tokens_by_vocab(seed):
    N, H, V = 256, 16, 4096
    inp = make_inputs(seed, N=N, Hs=H, Ht=H, V=V, mask_p=0.1)
    adv, old = ppo_inputs(seed, N)
    with LargestTensor() as mode:
        out = call(fused_linear_actor_loss, inp, adv, old, teacher_kl_coef=1.0, entropy_coef=0.1, token_chunk_size=32)
        grads(out, inp)
    assert mode.inner_ops > 50
    assert mode.largest <= max(V * H, 32 * V), (mode.largest, mode.op)
    with LargestTensor() as ref_mode:
        call(reference_actor_loss, inp, adv, old, teacher_kl_coef=1.0)
    assert ref_mode.largest >= N * V


def test_no_grad_matches_and_keeps_nothing(seed):
    inp = make_inputs(seed, N=30, V=120)
    adv, old = ppo_inputs(seed, 30)
    out = call(fused_linear_actor_loss, inp, adv, old, teacher_kl_coef=0.3)
    with torch.no_grad():
        ng = call(fused_linear_actor_loss, inp, adv, old, teacher_kl_coef=0.3)
    assert ng.loss.grad_fn is None
    for name in FIELDS:
        assert torch.equal(getattr(ng, name), getattr(out, name))


def test_torch_compile_matches_eager(seed):
    torch._dynamo.reset()
    inp = make_inputs(seed, N=24, V=96)
    adv, old = ppo_inputs(seed, 24)

    def f(hs, ws, bs):
        o = fused_linear_actor_loss(hs, ws, inp["y"], adv, old, student_bias=bs, mask=inp["mask"],
                                    teacher_hidden=inp["ht"], teacher_weight=inp["wt"], teacher_kl_coef=0.5,
                                    normalizer=24.0, kl_normalizer=24.0)
        return o.loss

    eager = f(inp["hs"], inp["ws"], inp["bs"])
    ge = torch.autograd.grad(eager, (inp["hs"], inp["ws"], inp["bs"]))
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(inp["hs"], inp["ws"], inp["bs"])
    gc_ = torch.autograd.grad(compiled, (inp["hs"], inp["ws"], inp["bs"]))
    torch.testing.assert_close(compiled, eager)
    for a, b in zip(gc_, ge):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("case", ["targets_float", "adv_len", "teacher_grad", "vocab", "clip", "dual", "half_teacher",
                                  "target_range"])
def test_bad_inputs_raise(case):
    inp = make_inputs(0, N=8, V=40)
    adv, old = ppo_inputs(0, 8)
    kw = dict(teacher_hidden=inp["ht"], teacher_weight=inp["wt"], teacher_kl_coef=0.0)
    y = inp["y"]
    msg = {"targets_float": "targets must be an int64", "adv_len": "advantages must be a 1-D tensor of N=8",
           "teacher_grad": "teacher is frozen", "vocab": "vocab_size=99", "clip": "clip range",
           "dual": "dual_clip must be > 1", "half_teacher": "pass teacher_hidden and teacher_weight together",
           "target_range": "targets out of range"}[case]
    if case == "targets_float":
        y = y.float()
    elif case == "adv_len":
        adv = adv[:5]
    elif case == "teacher_grad":
        kw["teacher_weight"] = inp["wt"].clone().requires_grad_()
    elif case == "vocab":
        kw["vocab_size"] = 99
    elif case == "clip":
        kw["clip_eps"] = 1.5
    elif case == "dual":
        kw["dual_clip"] = 0.5
    elif case == "half_teacher":
        kw.pop("teacher_weight")
    elif case == "target_range":
        y = y.clone()
        y[0] = 40
    with pytest.raises((ValueError, TypeError), match=msg):
        fused_linear_actor_loss(inp["hs"], inp["ws"], y, adv, old, **kw)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU for the compiled Triton kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_triton_on_cuda(seed, dtype):
    """The compiled kernels (benchmarks/gpu_check.sh runs this file on the GPU)."""
    inp = make_inputs(seed, N=300, Hs=256, Ht=192, V=5003, Vt=5011, teacher_bias=True, dtype=dtype)
    inp = {k: (v.detach().cuda().requires_grad_(v.requires_grad) if isinstance(v, torch.Tensor) else v)
           for k, v in inp.items()}
    adv, old = (x.cuda() for x in ppo_inputs(seed, 300))
    kw = dict(teacher_kl_coef=0.7, entropy_coef=0.02, temperature=1.1, vocab_size=5003, dual_clip=3.0)
    out = call(fused_linear_actor_loss, inp, adv, old, backend="triton", token_chunk_size=128, **kw)
    g = grads(out, inp)
    i64 = as64(inp)
    ref = call(reference_actor_loss, i64, adv.double(), old.double(), **kw)
    gr = grads(ref, i64)
    tol = 2e-4 if dtype == torch.float32 else 3e-2
    assert math.isclose(float(out.loss), float(ref.loss), rel_tol=tol, abs_tol=tol)
    for name in FIELDS:
        a, b = getattr(out, name).double(), getattr(ref, name)
        assert (a - b).abs().max() <= tol * (1 + b.abs().max()), name
    for name, a, b in zip(("dh", "dw", "db"), g, gr):
        assert (a.double() - b).abs().max() <= tol * (b.abs().max() + 1e-12) * 10, name


def test_weight_gradient_is_allocated_once(seed):
    """The [V, H] gradient computed in the forward is the one the parameter gets: the
    backward neither copies it nor allocates another (peak memory of big heads)."""
    from _fused_cases import SeesInsideOurOps

    class WeightSized(SeesInsideOurOps):
        def __init__(self, weight):
            super().__init__()
            self.numel, self.skip, self.storages = weight.numel(), weight.untyped_storage().data_ptr(), set()

        def record(self, func, out):  # distinct new storages of the weight's size (views share one)
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor) and t.numel() == self.numel:
                    ptr = t.untyped_storage().data_ptr()
                    if ptr != self.skip:
                        self.storages.add(ptr)

    inp = make_inputs(seed, N=64, Hs=32, Ht=24, V=500, bias=False)  # teacher weight of another size
    adv, old = ppo_inputs(seed, 64)
    with WeightSized(inp["ws"]) as mode:
        out = call(fused_linear_actor_loss, inp, adv, old, teacher_kl_coef=0.5)
        out.loss.backward()
    assert len(mode.storages) == 1, len(mode.storages)
    assert inp["ws"].grad.untyped_storage().data_ptr() in mode.storages


def test_backend_rule(seed, monkeypatch):
    """memopd.ops.dispatch's rule (docs/design.md §6.3): MEMOPD_BACKEND replaces "auto", an
    explicit backend wins over it, float64 is refused by "triton" and unknown names raise."""
    import memopd.ops.actor_loss as al
    import memopd.ops.dispatch as dispatch

    monkeypatch.setattr(dispatch, "triton_available", lambda: True)
    monkeypatch.setattr(dispatch, "interpreter_active", lambda: True)
    chosen = []
    choose = al.choose_op_backend
    monkeypatch.setattr(al, "choose_op_backend", lambda *a: chosen.append(choose(*a)) or "torch")
    inp = make_inputs(seed, N=12, V=40)
    adv, old = ppo_inputs(seed, 12)
    monkeypatch.setenv("MEMOPD_BACKEND", "triton")
    call(fused_linear_actor_loss, inp, adv, old)
    call(fused_linear_actor_loss, inp, adv, old, backend="torch")
    monkeypatch.setenv("MEMOPD_BACKEND", "torch")
    call(fused_linear_actor_loss, inp, adv, old, backend="auto")
    monkeypatch.delenv("MEMOPD_BACKEND")
    call(fused_linear_actor_loss, inp, adv, old)  # auto on CPU tensors
    assert chosen == ["triton", "torch", "torch", "torch"]
    with pytest.raises(BackendError, match="float64"):
        call(fused_linear_actor_loss, as64(inp), adv.double(), old.double(), backend="triton")
    monkeypatch.setenv("MEMOPD_BACKEND", "bogus")
    with pytest.raises(BackendError, match="bogus"):
        call(fused_linear_actor_loss, inp, adv, old)


def test_kl_coef_is_a_deprecated_alias_of_teacher_kl_coef(seed):
    """`kl_coef=` (the old name of the teacher-KL weight) still works in the ops and in the
    verl hook: it warns, naming the new name, and gives the loss of `teacher_kl_coef=`;
    passing both is refused. The one test of the alias: every other test uses the new name."""
    from memopd.integrations.verl import policy_loss as verl_policy_loss

    inp = make_inputs(seed, N=16, V=60)
    adv, old = ppo_inputs(seed, 16)
    for fn in (fused_linear_actor_loss, reference_actor_loss):
        new = call(fn, inp, adv, old, teacher_kl_coef=0.7, entropy_coef=0.02)
        with pytest.warns(DeprecationWarning, match="teacher_kl_coef"):
            old_name = call(fn, inp, adv, old, kl_coef=0.7, entropy_coef=0.02)
        assert torch.equal(new.loss, old_name.loss)
        none = call(fn, inp, adv, old, entropy_coef=0.02)
        assert not torch.equal(new.loss, none.loss)  # the weight reached the loss
        with pytest.raises(TypeError, match="both"):
            call(fn, inp, adv, old, teacher_kl_coef=0.7, kl_coef=0.7)

    g = torch.Generator().manual_seed(seed)
    B, L, R, H, V = 2, 7, 4, 8, 30
    hidden = torch.randn(B, L, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    t_hidden = torch.randn(B, L, H, generator=g, dtype=torch.float64)
    t_weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    responses = torch.randint(0, V, (B, R), generator=g)
    mask = torch.ones(B, R, dtype=torch.bool)
    old = -torch.rand(B, R, generator=g, dtype=torch.float64)
    adv = torch.randn(B, R, generator=g, dtype=torch.float64)
    args = (hidden, weight, responses, mask, old, adv)
    kw = dict(teacher_hidden_states=t_hidden, teacher_weight=t_weight)
    new, _ = verl_policy_loss(*args, teacher_kl_coef=0.5, **kw)
    with pytest.warns(DeprecationWarning, match="teacher_kl_coef"):
        old_name, _ = verl_policy_loss(*args, kl_coef=0.5, **kw)
    assert torch.equal(new, old_name)
    with pytest.raises(TypeError, match="both"):
        verl_policy_loss(*args, teacher_kl_coef=0.5, kl_coef=0.5, **kw)


def test_backend_error_is_bad_input():
    """A backend that cannot run is bad input the user fixes (exit code 2, one line from the
    command line), and stays a ValueError for callers that catch that."""
    from memopd.cli import _user_facing
    from memopd.errors import EXIT_BAD_INPUT, UserError

    err = BackendError("fused_linear_actor_loss: unknown backend 'bogus'")
    assert isinstance(err, UserError) and isinstance(err, ValueError)
    assert _user_facing(err) == (EXIT_BAD_INPUT, "fused_linear_actor_loss: unknown backend 'bogus'")
