"""Compiled Triton kernels at production shapes on a GPU, against references: packed
attention (forward, dq/dk/dv, deterministic and atomic backward) against the torch path,
and the fused lm-head ops (reverse KL, forward KL, JSD with the gradients taken in the
forward and by the recomputing backward, the teacher-less log-prob + entropy, the PPO
actor loss) against their float64 references.

CUDA only: every test here is skipped without a GPU, except the harness check at the end,
which runs the same comparison code on CPU with the torch path at small sizes (so a broken
harness is found before a GPU is borrowed). Autotuning is off (the first candidate the
pruner keeps is used, as with MEMOPD_TRITON_AUTOTUNE=0): the benchmarks tune, these check
values. Shapes are the ones the benchmarks run: bf16, D=128, Hq/Hkv 16/2 (Qwen2.5-3B) and
32/8, T=4096 with prefixes shared by several calls; N=1024 tokens (2048 for the
distillation's two gradient paths), H=2048, V=151,936 (the padded Qwen2.5 lm-head) and
151,665 (its tokenizer), bf16 and fp32.

Memory: inputs are drawn on the device; the float64 references run REF_BLOCK tokens at a
time (`blocked_reference`), and the lm-head tests hand the allocator's blocks back after
each test, so no test needs more than ~10 GiB and pytest-xdist workers fit one GPU
(tests/kernels/_cuda_budget.py models every test's peak; test_cuda_budget.py checks it on
CPU). Bars: the fp32 tests also check each gradient term alone (a dropped term then
leaves a zero gradient instead of hiding under bf16's tolerance), and the actor loss's
old log-probs put its ratios on both sides of the clip window and past the dual clip.
"""
from __future__ import annotations

import random

import _attention_cases as attn_cases
import _fused_cases as fused_cases
import pytest
import torch

CUDA = torch.cuda.is_available()
cuda_only = pytest.mark.skipif(not CUDA, reason="compiled Triton kernels need a GPU")


# --------------------------------------------------------------------------------------
# packed attention
# --------------------------------------------------------------------------------------
def shared_prefix_meta(T: int, seed: int):
    """A packed stream of exactly T tokens as the packer lays out restored-state batches:
    at T=4096, prefixes of 300-1100 tokens each read by 2-6 calls of 60-400 tokens, some
    lone calls, padding at the end (lengths scale with T)."""
    from memopd.layout import AttentionMeta, SegmentKind

    rng = random.Random(seed)
    cu, links, kinds = [0], [], []
    scale = T / 4096
    sizes = lambda *xs: [max(1, int(x * scale)) for x in xs]  # noqa: E731
    pad = max(2, T // 128)

    def add(kind, n, link=-1):
        cu.append(cu[-1] + n)
        kinds.append(kind)
        links.append(link)

    while T - pad - cu[-1] > 2 * pad:
        if rng.random() < 0.15:
            add(SegmentKind.CALL, min(T - pad - cu[-1], rng.choice(sizes(60, 150, 260))))
            continue
        p = len(kinds)
        # a prefix leaves room for at least one call of its own
        add(SegmentKind.PREFIX, min((T - pad - cu[-1]) // 2, rng.choice(sizes(300, 700, 1100))))
        for _ in range(rng.randint(2, 6)):
            room = T - pad - cu[-1]
            if room <= 0:
                break
            add(SegmentKind.CALL, min(room, rng.choice(sizes(60, 150, 260, 400))), p)
    add(SegmentKind.PAD, T - cu[-1])
    return AttentionMeta.from_segments(cu, links, kinds)


def check_attention(T, Hq, Hkv, D, dtype, deterministic, device, backend, seed=0):
    """`backend` against the torch path in fp32 (out, dq, dk, dv, within the dtype's
    tolerance of _attention_cases); returns the max |diff| per tensor."""
    from memopd.ops.attention import packed_attention

    meta = shared_prefix_meta(T, seed)
    assert meta.num_tokens == T and int((meta.prefix_end > meta.prefix_start).sum()) > T // 4
    q, k, v, do = attn_cases.make_inputs(T, Hq, Hkv, D, dtype, seed, device=device)
    dmeta = meta.to(device)

    def run(xs, be, **kw):
        leaves = [x.clone().requires_grad_() for x in xs[:3]]
        out = packed_attention(*leaves, dmeta, backend=be, **kw)
        out.backward(xs[3])
        return [out.detach()] + [x.grad for x in leaves]

    got = run((q, k, v, do), backend, deterministic=deterministic)
    want = run([x.float() for x in (q, k, v, do)], "torch")
    diffs = {}
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert a.dtype == dtype and a.shape == b.shape
        attn_cases.assert_close(f"{name} (Hq/Hkv {Hq}/{Hkv})", a, b.double().cpu(), dtype)
        diffs[name] = (a.double() - b.double()).abs().max().item()
    return diffs


@pytest.fixture
def fixed_tiles(monkeypatch):
    import memopd.kernels.packed_attention as kern

    monkeypatch.setattr(kern, "AUTOTUNE", False)
    return kern


@cuda_only
@pytest.mark.parametrize("Hq,Hkv", [(16, 2), (32, 8)])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_attention_production_shape(Hq, Hkv, deterministic, fixed_tiles):
    check_attention(4096, Hq, Hkv, 128, torch.bfloat16, deterministic, "cuda", "triton")


def bf16_ulps(a, b):
    """|a - b| in units of the bf16 spacing at max(|a|, |b|) (elementwise, float64)."""
    a, b = a.double(), b.double()
    _, e = torch.frexp(torch.maximum(a.abs(), b.abs()))
    return (a - b).abs() / torch.ldexp(torch.ones_like(a), (e - 8).clamp_min(-133))


@cuda_only
def test_attention_atomic_and_deterministic_agree_on_gpu(fixed_tiles):
    """Relaxed fp32 atomics in any order and the query-major dQ: the same sum (rounding
    apart). dK/dV: bitwise reproducible within each mode; across the modes (two binaries:
    ATOMIC_DQ is a compile-time constant, so register allocation and fp32 contraction may
    differ) within one bf16 rounding."""
    from memopd.ops.attention import packed_attention

    meta = shared_prefix_meta(4096, 3).to("cuda")
    q, k, v, do = attn_cases.make_inputs(4096, 16, 2, 128, torch.bfloat16, 3, device="cuda")
    grads = {}
    for det in (False, True, False, True):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        packed_attention(*leaves, meta, backend="triton", deterministic=det).backward(do)
        grads.setdefault(det, []).append([x.grad for x in leaves])
    for det, (first, second) in grads.items():
        mode = "deterministic" if det else "atomic"
        assert torch.equal(first[1], second[1]) and torch.equal(first[2], second[2]), f"{mode}: dK/dV not reproducible"
    (dq_a, dk_a, dv_a), (dq_d, dk_d, dv_d) = grads[False][0], grads[True][0]
    for name, a, b in (("dk", dk_a, dk_d), ("dv", dv_a, dv_d)):
        worst = bf16_ulps(a, b).max().item()
        assert worst <= 1.0, f"{name}: atomic vs deterministic differ by {worst:.1f} bf16 ulps"
    attn_cases.assert_close("dq atomic vs deterministic", dq_a, dq_d.double().cpu(), torch.bfloat16)


def _one_prefix_meta(T, prefix, calls):
    """One row of T tokens: a prefix read by `calls` calls sharing the rest."""
    from memopd.layout import AttentionMeta, SegmentKind

    cu = [0, prefix] + [prefix + (T - prefix) * (i + 1) // calls for i in range(calls)]
    return AttentionMeta.from_segments(cu, [-1] + [0] * calls, [SegmentKind.PREFIX] + [SegmentKind.CALL] * calls)


@cuda_only
@pytest.mark.parametrize("Hq,Hkv", [(16, 2), (32, 8)])
def test_attention_split_backward_at_production_shape(Hq, Hkv, fixed_tiles, monkeypatch):
    """16 calls sharing a 2k prefix, 8k tokens, D=128 bf16: the dK/dV split (default) splits
    the prefix's key blocks; its dK/dV equal the unsplit kernel's within one bf16 rounding,
    its deterministic backward is bitwise reproducible, and both match the torch path."""
    import memopd.kernels.attention_plan as plan_mod
    from memopd.ops.attention import packed_attention

    T = 8192
    meta = _one_prefix_meta(T, 2048, 16).to("cuda")
    q, k, v, do = attn_cases.make_inputs(T, Hq, Hkv, 128, torch.bfloat16, 5, device="cuda")

    def run(split, det, xs=(q, k, v, do), backend="triton"):
        monkeypatch.setattr(plan_mod, "SPLIT_ROWS", split)
        leaves = [x.clone().requires_grad_() for x in xs[:3]]
        packed_attention(*leaves, meta, backend=backend, deterministic=det).backward(xs[3])
        return [x.grad for x in leaves]

    spec = plan_mod.dkdv_plan_spec(Hkv, plan_mod.sm_count("cuda"))
    plan = plan_mod.dkdv_split_plan(plan_mod.key_query_ranges(meta.seg_start, meta.prefix_start, meta.prefix_end),
                                    *spec[:2], None, spec[3])
    assert int((plan.reduce[1] > 1).sum()) >= 8
    base, split, again = run(0, True), run(None, True), run(None, True)
    atomic = run(None, False)
    want = run(None, False, [x.float() for x in (q, k, v, do)], backend="torch")
    for i, name in enumerate(("dq", "dk", "dv")):
        assert torch.equal(split[i], again[i]), f"{name}: split deterministic backward not reproducible"
        torch.testing.assert_close(split[i], base[i], atol=1.6e-2, rtol=1.6e-2)
        for label, got in (("split", split[i]), ("split, atomic dq", atomic[i])):
            attn_cases.assert_close(f"{name} ({label}, Hq/Hkv {Hq}/{Hkv})", got, want[i].double().cpu(),
                                    torch.bfloat16)


def _candidates():
    import memopd.kernels.attention_tuning as tuning

    q = torch.empty(1, 1, 128, dtype=torch.bfloat16)
    return {name: prune(configs, {"HEAD_DIM": 128, "Q": q, "GROUP_P2": gp2})
            for name, configs, prune, gp2 in (("fwd", tuning.FWD_CONFIGS, tuning.FWD_PRUNE, 1),
                                              ("dkdv", tuning.BWD_KV_CONFIGS, tuning.BWD_KV_PRUNE, 8),
                                              ("dq", tuning.BWD_DQ_CONFIGS, tuning.BWD_DQ_PRUNE, 1))}


@cuda_only
@pytest.mark.parametrize("index", range(1, 4))  # 0: the fixed choice, run above
def test_attention_every_candidate(index, fixed_tiles, monkeypatch):
    """Candidate `index` of each kernel's pruned list (the last one where a list is
    shorter; at D=128 the lists hold 2-4), GQA group 8, deterministic backward (all three
    kernels run): any candidate the autotuner may pick gives right results."""
    import memopd.kernels.attention_kernels as ak

    kern = fixed_tiles
    cands = _candidates()
    picked = {name: c[min(index, len(c) - 1)] for name, c in cands.items()}

    def pick(raw, tuned, configs, prune, q, group_p2=1):
        name = {ak.fwd_kernel: "fwd", ak.bwd_dkdv_kernel: "dkdv", ak.bwd_dq_kernel: "dq"}[raw]
        c = picked[name]
        return raw, {"BLOCK_M": c.kwargs["BLOCK_M"], "BLOCK_N": c.kwargs["BLOCK_N"],
                     "num_warps": c.num_warps, "num_stages": c.num_stages}

    monkeypatch.setattr(kern, "_pick", pick)
    check_attention(4096, 16, 2, 128, torch.bfloat16, True, "cuda", "triton", seed=index)


# --------------------------------------------------------------------------------------
# fused lm-head ops
# --------------------------------------------------------------------------------------
LM_SHAPES = [pytest.param(151936, None, id="V151936"), pytest.param(151936, 151665, id="V151665")]
LM_DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float32, id="fp32")]
# tokens per block of the float64 references: [64, V] float64 temporaries (~78 MB each at
# V=151,936); tests/kernels/_cuda_budget.py sizes every test's peak from it
REF_BLOCK = 64


def lm_inputs(N, H, V_rows, dtype, device, seed=0, bias=True):
    """Student and teacher heads drawn on `device` (no host randn, no copy): logits of a
    few units (weights ~ 2/sqrt(H)), a fifth of the rows masked."""
    g = torch.Generator(device=device).manual_seed(seed)

    def draw(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)

    w_scale = 2.0 / H ** 0.5
    inp = dict(hs=draw(N, H), ws=draw(V_rows, H, scale=w_scale), bs=draw(V_rows, scale=0.5) if bias else None,
               ht=draw(N, H), wt=draw(V_rows, H, scale=w_scale), bt=None)
    inp["y"] = torch.randint(0, V_rows, (N,), generator=g, device=device)
    inp["mask"] = torch.rand(N, generator=g, device=device) > 0.2
    for key in ("hs", "ws", "bs"):
        if inp[key] is not None:
            inp[key].requires_grad_()
    return inp


def token_weights(N, device, seed=5):
    g = torch.Generator(device=device).manual_seed(seed)
    return {k: torch.randn(N, generator=g, device=device) for k in ("kl", "logprobs", "entropy")}


def blocked_reference(fn, inp, weights, *, block=REF_BLOCK, loss_divisor=1.0):
    """The float64 reference of a per-token lm-head op, `block` tokens at a time.

    `fn(x)` runs the reference on `x`: `inp` with the student's hidden rows of one block
    (float64), its weight and bias as float64 leaves shared by every block, the teacher's
    hidden rows of the block and its weight as given (the reference converts them to
    float64 per call, so no float64 copy of the teacher's head stays alive). Gradients of
    sum_k weights[k] * out.k (per-token weights sliced per block; `loss`: the block's loss
    / `loss_divisor`) go to the hidden rows (float64), the weight (summed over blocks in
    float32: 1e-7 relative, far below every bar here) and the bias (float64).
    Returns (per-token outputs {name: [N] float64}, the summed loss or None, grads)."""
    hs = inp["hs"].detach()
    N = hs.shape[0]
    ws64 = inp["ws"].detach().double().requires_grad_()
    bs64 = None if inp["bs"] is None else inp["bs"].detach().double().requires_grad_()
    d_h = torch.zeros(hs.shape, dtype=torch.float64, device=hs.device)
    d_w = torch.zeros(ws64.shape, dtype=torch.float32, device=hs.device)
    d_b = None if bs64 is None else torch.zeros_like(bs64, requires_grad=False)
    fields: dict[str, list] = {}
    loss = None
    for s in range(0, N, block):
        e = min(N, s + block)
        hb = hs[s:e].double().requires_grad_()
        x = dict(inp, hs=hb, ws=ws64, bs=bs64, y=inp["y"][s:e], mask=None if inp["mask"] is None else inp["mask"][s:e],
                 ht=None if inp.get("ht") is None else inp["ht"][s:e].detach())
        out = fn(x, s, e)
        total = 0.0
        for name, w in weights.items():
            val = getattr(out, name)
            if name == "loss":
                total = total + w * val / loss_divisor
            else:
                total = total + (val * (w[s:e].to(val.dtype) if isinstance(w, torch.Tensor) else w)).sum()
        if weights:
            params = [hb, ws64] + ([bs64] if bs64 is not None else [])
            grads = torch.autograd.grad(total, params, allow_unused=True)
            if grads[0] is not None:
                d_h[s:e] = grads[0]
            if grads[1] is not None:
                d_w.add_(grads[1])
            if bs64 is not None and grads[2] is not None:
                d_b.add_(grads[2])
            del grads
        for name, val in zip(out._fields, out):
            if name == "loss":
                loss = val.detach() / loss_divisor + (0.0 if loss is None else loss)
            elif isinstance(val, torch.Tensor) and val.shape == (e - s,):
                fields.setdefault(name, []).append(val.detach())
        del out, total, x, hb
    return {k: torch.cat(v) for k, v in fields.items()}, loss, [d_h, d_w, d_b]


def _tols(dtype):
    # values: fp32 statistics in both cases; gradients: rounded to the input dtype
    return ((1e-4, 1e-4), (1.5e-2, 1.5e-2)) if dtype != torch.float32 else ((1e-4, 1e-4), (1e-4, 1e-3))


def _assert_grad_close(name, got, want, atol_of_max, rtol, rows=8192):
    """|got - want| <= atol_of_max * max|want| + rtol * |want| everywhere; compared in
    float64 over `rows` rows at a time (no float64 copy of a whole head)."""
    top = want.abs().max().item()
    assert top > 0, f"{name}: the reference gradient is zero: the check would be empty"
    worst = 0.0
    for s in range(0, got.shape[0], rows):
        a, b = got[s:s + rows].double(), want[s:s + rows].double()
        err = (a - b).abs()
        assert torch.isfinite(a).all(), f"{name}: non-finite values"
        bad = err > atol_of_max * top + rtol * b.abs()
        assert not bad.any(), f"{name}: max |diff| {err.max().item():.3e} (max |ref| {top:.3e})"
        worst = max(worst, err.max().item())
    return worst


def _assert_values_close(name, got, want, atol, rtol):
    a, b = got.detach().double(), want.detach().double()
    err = (a - b).abs()
    assert torch.isfinite(a).all(), name
    assert (err <= atol + rtol * b.abs()).all(), f"{name}: max |diff| {err.max().item():.3e}"
    return err.max().item()


def distill_weights(N, device, term=None, loss_only=False):
    """The weights of the checked gradient: every term at once (default), only `loss`
    (`loss_only`), or one term (`term`): then a dropped term leaves zero gradients."""
    weights = dict(token_weights(N, device), loss=0.8)
    if loss_only:
        return {"loss": 0.8}
    if term is not None:
        return {term: weights[term]}
    return weights


def check_distill(divergence, N, H, V_rows, vocab, dtype, device, backend, gradients=None, loss_only=False,
                  term=None, block=REF_BLOCK, op=None):
    """fused_linear_distill (or, divergence=None, fused_linear_logprob_entropy) on
    `backend` against the blocked float64 reference: values and the student's gradients.
    `gradients` is the op's argument; `loss_only`: only `loss` gets a gradient (with
    gradients "forward" or None, nothing is then recomputed in the backward); `term`:
    only that output gets a gradient. `op` replaces the op under test (harness checks)."""
    from memopd.ops import fused_linear_distill, fused_linear_logprob_entropy, reference_linear_distill, reference_linear_logprob_entropy

    inp = lm_inputs(N, H, V_rows, dtype, device)
    if vocab is not None:
        inp["y"] = inp["y"] % vocab
    weights = distill_weights(N, device, term=term, loss_only=loss_only)
    if divergence is None:
        weights = {k: w for k, w in weights.items() if k in ("logprobs", "entropy")}
        names = ("logprobs", "entropy")

        def ref_fn(x, s, e):
            return reference_linear_logprob_entropy(x["hs"], x["ws"], x["y"], bias=x["bs"], mask=x["mask"],
                                                    vocab_size=vocab)
        ref, ref_loss, gr = blocked_reference(ref_fn, inp, weights, block=block)
        out, g = fused_cases.run_lpe(op or fused_linear_logprob_entropy, inp, weights, backend=backend,
                                     vocab_size=vocab)
    else:
        names = ("loss", "kl", "logprobs", "entropy")
        keep = int(inp["mask"].sum().clamp_min(1))

        def ref_fn(x, s, e):
            return reference_linear_distill(x["hs"], x["ws"], x["ht"], x["wt"], x["y"], mask=x["mask"],
                                            student_bias=x["bs"], teacher_bias=x["bt"], divergence=divergence,
                                            vocab_size=vocab, beta=0.4, reduction="sum")
        ref, ref_loss, gr = blocked_reference(ref_fn, inp, weights, block=block, loss_divisor=keep)
        ref["loss"] = ref_loss
        x = inp
        out = (op or fused_linear_distill)(x["hs"], x["ws"], x["ht"], x["wt"], x["y"], mask=x["mask"],
                                           student_bias=x["bs"], teacher_bias=x["bt"], divergence=divergence,
                                           vocab_size=vocab, beta=0.4, backend=backend, gradients=gradients)
        g = fused_cases.weighted_grads(out, inp, weights)
    (vt, vr), (gt, grt) = _tols(dtype)
    diffs = {name: _assert_values_close(name, getattr(out, name), ref[name], vt, vr) for name in names}
    for name, a, b in zip(("d_hidden", "d_weight", "d_bias"), g, gr):
        if b is not None:
            diffs[name] = _assert_grad_close(name, a, b, gt, grt)
    return diffs


# ratio = exp(u) of each token: most inside and around the clip window [0.8, 1.2], a tenth
# beyond the dual clip (3.0); none within 0.01 in log space of a branch point, where the
# fp32 op and the float64 reference could take different branches of the max
ACTOR_CLIP, ACTOR_DUAL = 0.2, 3.0


def straddling_log_ratios(N, device, seed=11):
    import math

    g = torch.Generator(device=device).manual_seed(seed)
    u = (torch.rand(N, generator=g, device=device, dtype=torch.float64) - 0.5) * 0.9
    far = torch.rand(N, generator=g, device=device) < 0.1
    u = torch.where(far, 1.2 + 0.2 * torch.rand(N, generator=g, device=device, dtype=torch.float64), u)
    for b in (math.log(1 - ACTOR_CLIP), math.log(1 + ACTOR_CLIP), math.log(ACTOR_DUAL)):
        near = (u - b).abs() < 0.01
        u = torch.where(near, b + 0.01 * torch.where(u >= b, 1.0, -1.0), u)
    return u


ACTOR_TERMS = {  # (advantage scale, entropy_coef, teacher kl_coef): all terms, or one alone
    "all": (1.0, 0.01, 0.1), "pg": (1.0, 0.0, 0.0), "entropy": (0.0, 1.0, 0.0), "kl": (0.0, 0.0, 1.0)}


def check_actor_loss(N, H, V_rows, vocab, dtype, device, backend, bias=True, terms="all", block=REF_BLOCK, op=None):
    """fused_linear_actor_loss on `backend` against the blocked float64 reference. The
    old log-probs are the reference's own log-probs shifted so that the ratios straddle
    the clip window (`straddling_log_ratios`); `terms` picks the loss terms that carry a
    gradient (ACTOR_TERMS: "pg", "entropy" or "kl" alone make a dropped term fail)."""
    from memopd.ops import fused_linear_actor_loss, reference_actor_loss, reference_linear_logprob_entropy

    inp = lm_inputs(N, H, V_rows, dtype, device, bias=bias)
    if vocab is not None:
        inp["y"] = inp["y"] % vocab
    adv_scale, ent_coef, kl_coef = ACTOR_TERMS[terms]
    gen = torch.Generator(device=device).manual_seed(7)
    adv = torch.randn(N, generator=gen, device=device) * adv_scale

    def lp_fn(x, s, e):
        return reference_linear_logprob_entropy(x["hs"], x["ws"], x["y"], bias=x["bs"], mask=x["mask"],
                                                vocab_size=vocab)
    with torch.no_grad():
        lp = blocked_reference(lp_fn, inp, {}, block=block)[0]["logprobs"]
    u = straddling_log_ratios(N, device)
    old = (lp - u).float()
    keep = inp["mask"]
    norm = float(keep.sum().clamp_min(1))
    kw = dict(vocab_size=vocab, clip_eps=ACTOR_CLIP, dual_clip=ACTOR_DUAL, entropy_coef=ent_coef, teacher_kl_coef=kl_coef)

    def ref_fn(x, s, e):
        return reference_actor_loss(x["hs"], x["ws"], x["y"], adv[s:e].double(), old[s:e].double(),
                                    student_bias=x["bs"], mask=x["mask"], teacher_hidden=x["ht"],
                                    teacher_weight=x["wt"], teacher_bias=x["bt"], normalizer=norm,
                                    kl_normalizer=norm, **kw)
    ref, ref_loss, gr = blocked_reference(ref_fn, inp, {"loss": 1.0}, block=block)
    ref["loss"] = ref_loss
    r = ref["ratio"][keep]
    below, above = (r < 1 - ACTOR_CLIP).double().mean().item(), (r > 1 + ACTOR_CLIP).double().mean().item()
    frac = below + above
    assert below > 0.1 and above > 0.1 and frac < 0.75, f"ratios below / above the clip window: {below:.2f} / {above:.2f}"
    x = inp
    out = (op or fused_linear_actor_loss)(x["hs"], x["ws"], x["y"], adv, old, student_bias=x["bs"], mask=x["mask"],
                                          teacher_hidden=x["ht"], teacher_weight=x["wt"], teacher_bias=x["bt"],
                                          backend=backend, **kw)
    params = [p for p in (x["hs"], x["ws"], x["bs"]) if p is not None]
    g = torch.autograd.grad(out.loss, params)
    (vt, vr), (gt, grt) = _tols(dtype)
    diffs = {name: _assert_values_close(name, getattr(out, name), ref[name], vt, vr)
             for name in ("loss", "logprobs", "entropy", "kl", "ratio")}
    for name, a, b in zip(("d_hidden", "d_weight", "d_bias"), g, gr):
        diffs[name] = _assert_grad_close(name, a, b, gt, grt)
    diffs["grads"] = g
    diffs["clipped_fraction"] = frac
    return diffs


@pytest.fixture
def lm_fixed_tiles(monkeypatch):
    """Fixed tiles; after the test, the caching allocator's blocks go back to the device,
    so each pytest worker holds only what its running test needs (the budget of
    tests/kernels/_cuda_budget.py)."""
    import gc

    import memopd.kernels.fused_distill as fd

    monkeypatch.setattr(fd, "USE_AUTOTUNE", False)
    yield
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()


@cuda_only
@pytest.mark.parametrize("V_rows,vocab", LM_SHAPES)
@pytest.mark.parametrize("dtype", LM_DTYPES)
@pytest.mark.parametrize("divergence", ["reverse_kl", "forward_kl", "jsd", None],
                         ids=["reverse_kl", "forward_kl", "jsd", "no-teacher"])
def test_fused_distill_production_shape(divergence, dtype, V_rows, vocab, lm_fixed_tiles):
    check_distill(divergence, 1024, 2048, V_rows, vocab, dtype, "cuda", "triton")


@cuda_only
@pytest.mark.parametrize("V_rows,vocab", LM_SHAPES)
@pytest.mark.parametrize("dtype", LM_DTYPES)
@pytest.mark.parametrize("divergence", ["reverse_kl", "forward_kl", "jsd"])
@pytest.mark.parametrize("gradients", ["forward", "recompute"])
def test_fused_distill_gradient_paths_production_shape(gradients, divergence, dtype, V_rows, vocab, lm_fixed_tiles):
    """The loss's gradients taken in the forward (logits scratch, row kernel, dH / dW in
    the forward: `memopd.kernels.distill_rows`) and by the recomputing backward, at
    N=2048 (three token chunks of the forward's fp32 scratch), against float64."""
    check_distill(divergence, 2048, 2048, V_rows, vocab, dtype, "cuda", "triton", gradients=gradients, loss_only=True)


@cuda_only
@pytest.mark.parametrize("V_rows,vocab", LM_SHAPES)
@pytest.mark.parametrize("dtype", LM_DTYPES)
def test_actor_loss_production_shape(dtype, V_rows, vocab, lm_fixed_tiles):
    check_actor_loss(1024, 2048, V_rows, vocab, dtype, "cuda", "triton")


@cuda_only
@pytest.mark.parametrize("term,divergence", [
    pytest.param(t, d, id=f"{t}-{d or 'no-teacher'}") for d in ("reverse_kl", "forward_kl", "jsd", None)
    for t in ("loss", "kl", "logprobs", "entropy") if d is not None or t in ("logprobs", "entropy")])
def test_fused_distill_each_gradient_term_fp32(term, divergence, lm_fixed_tiles):
    """One output's gradient at a time, fp32 bars: at bf16's tolerance a dropped term can
    hide under the others (the loss term is 0.05-0.23% of the largest gradient); alone it
    leaves a zero gradient where the reference has one (the teacher-less op has no loss
    or KL output)."""
    check_distill(divergence, 1024, 2048, 151936, 151665, torch.float32, "cuda", "triton", term=term)


@cuda_only
@pytest.mark.parametrize("terms", ["pg", "entropy", "kl"])
def test_actor_loss_each_term_fp32(terms, lm_fixed_tiles):
    """The PPO surrogate (ratios on both sides of the clip window and past the dual clip),
    the entropy bonus and the teacher KL, each alone, fp32 bars."""
    check_actor_loss(1024, 2048, 151936, 151665, torch.float32, "cuda", "triton", terms=terms)


@cuda_only
def test_actor_loss_bf16_grad_scratch_without_bias(lm_fixed_tiles, monkeypatch):
    # Qwen2.5's case: a bf16 head without a bias, V=151,665. dL/dlogits is stored in bf16
    # (rounded to nearest even, as the GEMMs rounded the fp32 scratch) and dH is split over
    # the vocabulary (1024 tokens: chunks of 768 and 256 rows, 6 x 16 and 2 x 16 programs).
    # Against float64, and against the fp32 scratch: the same GEMM operands, so dH / dW
    # agree far below bf16 resolution (a truncating conversion would not: ~1e-3)
    import memopd.kernels.lm_head_tiles as tiles

    bf16 = check_actor_loss(1024, 2048, 151936, 151665, torch.bfloat16, "cuda", "triton", bias=False)["grads"]
    monkeypatch.setattr(tiles, "grad_scratch_dtype", lambda dtype, need_db: torch.float32)
    fp32 = check_actor_loss(1024, 2048, 151936, 151665, torch.bfloat16, "cuda", "triton", bias=False)["grads"]
    for name, a, b in zip(("d_hidden", "d_weight"), bf16, fp32):
        err = (a.float() - b.float()).abs().max().item()
        assert err <= 1e-5 * b.float().abs().max().item(), f"{name}: bf16 vs fp32 scratch, max |diff| {err:.3e}"


@cuda_only
def test_dh_split_matches_unsplit_on_gpu():
    # the vocabulary-split dH with its fixed-order reduction: the same bits on every call,
    # and the unsplit GEMM's result up to fp32 summation order
    from memopd.kernels.lm_head_tiles import compaction, gemm_meta, launch_dh, new_scratch

    gen = torch.Generator(device="cuda").manual_seed(5)
    n, H, V = 768, 2048, 151665
    g = new_scratch(n, V, torch.bfloat16, "cuda")
    g[:, :V] = (torch.randn(n, V, device="cuda", generator=gen) * 1e-3).to(torch.bfloat16)
    w = torch.randn(151936, H, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
    keep = torch.rand(n, device="cuda", generator=gen) > 0.2
    order, count = compaction(keep)
    meta = gemm_meta(False)
    out = {}
    for splits in (1, 4, 4):
        dh = torch.full((n, H), float("nan"), device="cuda", dtype=torch.float32)
        launch_dh(g, w, order, count, dh, V, 0, n, False, "tf32", meta, splits=splits)
        out.setdefault(splits, []).append(dh)
    ref = (g[:, :V].float() @ w[:V].float())
    assert torch.equal(out[4][0], out[4][1])
    for dh in (out[1][0], out[4][0]):
        rows = order[: int(count)].long()
        assert torch.isfinite(dh).all()
        assert (dh[rows] - ref[: rows.numel()]).abs().max() <= 1e-3 * ref.abs().max()
    assert (out[4][0] - out[1][0]).abs().max() <= 1e-5 * out[1][0].abs().max()


# --------------------------------------------------------------------------------------
# the harness itself, on CPU (torch path, small sizes)
# --------------------------------------------------------------------------------------
def test_harness_on_cpu_with_the_torch_path():
    """The comparison code above, run where CI runs: the torch path against the same
    references at small sizes, fp32, the references in blocks of 7 tokens. Also checks
    the layout builder's invariants."""
    meta = shared_prefix_meta(4096, 0)
    assert meta.num_tokens == 4096
    d = check_attention(256, 4, 2, 16, torch.float32, False, "cpu", "torch")
    assert set(d) == {"out", "dq", "dk", "dv"}
    for div in ("reverse_kl", "jsd", None):
        check_distill(div, 48, 32, 300, 290, torch.float32, "cpu", "torch", block=7)
    for gradients in ("forward", "recompute"):
        check_distill("forward_kl", 48, 32, 300, 290, torch.float32, "cpu", "torch", gradients=gradients,
                      loss_only=True, block=7)
    for term in ("loss", "kl", "logprobs", "entropy"):
        check_distill("jsd", 48, 32, 300, 290, torch.float32, "cpu", "torch", term=term, block=7)
    for terms in ACTOR_TERMS:
        d = check_actor_loss(64, 32, 300, 290, torch.float32, "cpu", "torch", terms=terms, block=7)
        assert 0.2 < d["clipped_fraction"] < 0.75


def test_blocked_reference_on_cpu_equals_the_whole_batch_reference():
    """Blocks change nothing but the summation order: outputs, loss and gradients of the
    blocked reference equal the one-block reference to float64 rounding (d_weight: its
    float32 accumulator)."""
    from memopd.ops import reference_linear_distill

    inp = lm_inputs(50, 24, 200, torch.float32, "cpu")
    weights = dict(token_weights(50, "cpu"), loss=0.8)

    def fn(x, s, e):
        return reference_linear_distill(x["hs"], x["ws"], x["ht"], x["wt"], x["y"], mask=x["mask"],
                                        student_bias=x["bs"], divergence="jsd", beta=0.4, reduction="sum")
    keep = int(inp["mask"].sum())
    whole = blocked_reference(fn, inp, weights, block=50, loss_divisor=keep)
    parts = blocked_reference(fn, inp, weights, block=7, loss_divisor=keep)
    for name in ("kl", "logprobs", "entropy"):
        torch.testing.assert_close(parts[0][name], whole[0][name], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(parts[1], whole[1], rtol=1e-12, atol=1e-12)
    for a, b in zip(parts[2], whole[2]):
        assert b.abs().max() > 0
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6 * b.abs().max().item())  # d_weight: float32 sums


def test_a_dropped_gradient_term_fails_the_check_on_cpu():
    """What the per-term tests guard against: an op that loses one term's gradient (the
    distillation loss, the actor's entropy bonus) is caught."""
    from memopd.ops import fused_linear_actor_loss, fused_linear_distill

    def no_loss_grad(*a, **kw):
        out = fused_linear_distill(*a, **kw)
        return out._replace(loss=out.loss.detach().requires_grad_())

    def no_entropy_bonus(*a, entropy_coef, **kw):
        return fused_linear_actor_loss(*a, entropy_coef=0.0, **kw)

    check_distill("reverse_kl", 48, 32, 300, 290, torch.float32, "cpu", "torch", term="loss", block=7)
    with pytest.raises(AssertionError, match="d_hidden"):
        check_distill("reverse_kl", 48, 32, 300, 290, torch.float32, "cpu", "torch", term="loss", block=7,
                      op=no_loss_grad)
    with pytest.raises(AssertionError, match="loss|d_hidden"):
        check_actor_loss(64, 32, 300, 290, torch.float32, "cpu", "torch", terms="entropy", block=7,
                         op=no_entropy_bonus)


def test_bf16_ulps_on_cpu():
    """The across-mode dK/dV bar: neighbouring bf16 values are one ulp apart at every scale."""
    x = torch.tensor([1.0, 0.75, -3.0e-3, 96.0, 0.0], dtype=torch.bfloat16)
    nxt = torch.nextafter(x, torch.full_like(x, float("inf")))
    assert bf16_ulps(x, nxt).tolist() == [1.0, 1.0, 1.0, 1.0, 1.0]
    assert bf16_ulps(x, x).max().item() == 0.0
    assert bf16_ulps(x[:4], x[:4] * 1.02).min().item() > 1.0  # 2% apart: more than one rounding
