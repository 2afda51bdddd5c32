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


@cuda_only
def test_attention_atomic_and_deterministic_agree_on_gpu(fixed_tiles):
    """Relaxed fp32 atomics in any order and the query-major dQ: the same sum (rounding
    apart); dK/dV come from the same kernel in both modes: bitwise equal."""
    from memopd.ops.attention import packed_attention

    meta = shared_prefix_meta(4096, 3).to("cuda")
    q, k, v, do = attn_cases.make_inputs(4096, 16, 2, 128, torch.bfloat16, 3, device="cuda")
    grads = []
    for det in (False, True):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        packed_attention(*leaves, meta, backend="triton", deterministic=det).backward(do)
        grads.append([x.grad for x in leaves])
    (dq_a, dk_a, dv_a), (dq_d, dk_d, dv_d) = grads
    assert torch.equal(dk_a, dk_d) and torch.equal(dv_a, dv_d)
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
    from memopd.ops.attention import packed_attention

    kern = fixed_tiles
    T = 8192
    meta = _one_prefix_meta(T, 2048, 16).to("cuda")
    q, k, v, do = attn_cases.make_inputs(T, Hq, Hkv, 128, torch.bfloat16, 5, device="cuda")

    def run(split, det, xs=(q, k, v, do), backend="triton"):
        monkeypatch.setattr(kern, "SPLIT_ROWS", split)
        leaves = [x.clone().requires_grad_() for x in xs[:3]]
        packed_attention(*leaves, meta, backend=backend, deterministic=det).backward(xs[3])
        return [x.grad for x in leaves]

    plan = kern.dkdv_split_plan(kern.key_query_ranges(meta.seg_start, meta.prefix_start, meta.prefix_end),
                                *kern.dkdv_plan_spec(Hkv, kern.sm_count("cuda"))[:2], None,
                                kern.dkdv_plan_spec(Hkv, kern.sm_count("cuda"))[3])
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


def _candidates(kern):
    q = torch.empty(1, 1, 128, dtype=torch.bfloat16)
    return {name: prune(configs, {"HEAD_DIM": 128, "Q": q, "GROUP_P2": gp2})
            for name, configs, prune, gp2 in (("fwd", kern._FWD_CONFIGS, kern._FWD_PRUNE, 1),
                                              ("dkdv", kern._BWD_KV_CONFIGS, kern._BWD_KV_PRUNE, 8),
                                              ("dq", kern._BWD_DQ_CONFIGS, kern._BWD_DQ_PRUNE, 1))}


@cuda_only
@pytest.mark.parametrize("index", range(1, 4))  # 0: the fixed choice, run above
def test_attention_every_candidate(index, fixed_tiles, monkeypatch):
    """Candidate `index` of each kernel's pruned list (the last one where a list is
    shorter; at D=128 the lists hold 2-4), GQA group 8, deterministic backward (all three
    kernels run): any candidate the autotuner may pick gives right results."""
    kern = fixed_tiles
    cands = _candidates(kern)
    picked = {name: c[min(index, len(c) - 1)] for name, c in cands.items()}

    def pick(raw, tuned, configs, prune, q, group_p2=1):
        name = {kern._fwd_kernel: "fwd", kern._bwd_dkdv_kernel: "dkdv", kern._bwd_dq_kernel: "dq"}[raw]
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


def lm_inputs(N, H, V_rows, dtype, device, seed=0, bias=True):
    # logits of a few units (weights ~ 1/sqrt(H)), a fifth of the rows masked
    inp = fused_cases.make_inputs(seed, N=N, Hs=H, Ht=H, V=V_rows, dtype=dtype, scale=2.0 / H ** 0.5,
                                  mask_p=0.2, bias=bias)
    out = {}
    for key, x in inp.items():
        if isinstance(x, torch.Tensor):
            x = x.detach().to(device)
            if key in ("hs", "ws", "bs"):
                x.requires_grad_()
        out[key] = x
    return out


def _tols(dtype):
    # values: fp32 statistics in both cases; gradients: rounded to the input dtype
    return ((1e-4, 1e-4), (1.5e-2, 1.5e-2)) if dtype != torch.float32 else ((1e-4, 1e-4), (1e-4, 1e-3))


def _max_diff(a, b):
    return (a.detach().double() - b.detach().double()).abs().max().item()


def check_distill(divergence, N, H, V_rows, vocab, dtype, device, backend, gradients=None, loss_only=False):
    """fused_linear_distill (or, divergence=None, fused_linear_logprob_entropy) on
    `backend` against the float64 reference: values and the student's gradients.
    `gradients` is the op's argument; `loss_only`: only `loss` gets a gradient (with
    gradients "forward" or None, nothing is then recomputed in the backward)."""
    from memopd.ops import fused_linear_distill, fused_linear_logprob_entropy, reference_linear_distill, reference_linear_logprob_entropy

    inp = lm_inputs(N, H, V_rows, dtype, device)
    if vocab is not None:
        inp["y"] = inp["y"] % vocab
    weights = {k: torch.randn(N, generator=torch.Generator().manual_seed(5)).to(device)
               for k in ("kl", "logprobs", "entropy")}
    weights["loss"] = 0.8
    if loss_only:
        weights = {"loss": 0.8}
    if divergence is None:
        weights = {k: weights[k] for k in ("logprobs", "entropy")}
        names = ("logprobs", "entropy")
        out, g = fused_cases.run_lpe(fused_linear_logprob_entropy, inp, weights, backend=backend, vocab_size=vocab)
        ref, gr = fused_cases.run_lpe(reference_linear_logprob_entropy, fused_cases.as64(inp), weights,
                                      vocab_size=vocab)
    else:
        names = ("loss", "kl", "logprobs", "entropy")

        def run(fn, x, **kw):
            o = fn(x["hs"], x["ws"], x["ht"], x["wt"], x["y"], mask=x["mask"], student_bias=x["bs"],
                   teacher_bias=x["bt"], divergence=divergence, vocab_size=vocab, beta=0.4, **kw)
            return o, fused_cases.weighted_grads(o, x, weights)

        out, g = run(fused_linear_distill, inp, backend=backend, gradients=gradients)
        ref, gr = run(reference_linear_distill, fused_cases.as64(inp))
    (vt, vr), (gt, grt) = _tols(dtype)
    diffs = {}
    for name in names:
        a, b = getattr(out, name), getattr(ref, name)
        err = (a.detach().double() - b.detach()).abs()
        assert torch.isfinite(a).all(), name
        assert (err <= vt + vr * b.detach().abs()).all(), f"{name}: max |diff| {err.max().item():.3e}"
        diffs[name] = err.max().item()
    for name, a, b in zip(("d_hidden", "d_weight", "d_bias"), g, gr):
        bound = gt * b.abs().max().item() + grt * b.abs()
        err = (a.double() - b).abs()
        assert (err <= bound).all(), f"{name}: max |diff| {err.max().item():.3e}"
        diffs[name] = err.max().item()
    return diffs


def check_actor_loss(N, H, V_rows, vocab, dtype, device, backend, bias=True):
    from memopd.ops import fused_linear_actor_loss, reference_actor_loss

    inp = lm_inputs(N, H, V_rows, dtype, device, bias=bias)
    if vocab is not None:
        inp["y"] = inp["y"] % vocab
    gen = torch.Generator().manual_seed(7)
    adv = torch.randn(N, generator=gen).to(device)
    old = (-torch.rand(N, generator=gen) * 4 - 8).to(device)  # near log(1/V): ratios around 1

    def run(fn, x, a, o, **kw):
        out = fn(x["hs"], x["ws"], x["y"], a, o, student_bias=x["bs"], mask=x["mask"], teacher_hidden=x["ht"],
                 teacher_weight=x["wt"], teacher_bias=x["bt"], vocab_size=vocab, clip_eps=0.2, dual_clip=3.0,
                 entropy_coef=0.01, kl_coef=0.1, **kw)
        params = [p for p in (x["hs"], x["ws"], x["bs"]) if p is not None]
        return out, torch.autograd.grad(out.loss, params)

    out, g = run(fused_linear_actor_loss, inp, adv, old, backend=backend)
    ref, gr = run(reference_actor_loss, fused_cases.as64(inp), adv.double(), old.double())
    (vt, vr), (gt, grt) = _tols(dtype)
    diffs = {}
    for name in ("loss", "logprobs", "entropy", "kl", "ratio"):
        a, b = getattr(out, name).detach().double(), getattr(ref, name).detach()
        err = (a - b).abs()
        assert (err <= vt + vr * b.abs()).all(), f"{name}: max |diff| {err.max().item():.3e}"
        diffs[name] = err.max().item()
    for name, a, b in zip(("d_hidden", "d_weight", "d_bias"), g, gr):
        err = (a.double() - b).abs()
        assert (err <= gt * b.abs().max().item() + grt * b.abs()).all(), f"{name}: max |diff| {err.max().item():.3e}"
        diffs[name] = err.max().item()
    diffs["grads"] = g
    return diffs


@pytest.fixture
def lm_fixed_tiles(monkeypatch):
    import memopd.kernels.fused_distill as fd

    monkeypatch.setattr(fd, "USE_AUTOTUNE", False)


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
    references at small sizes, fp32. Also checks the layout builder's invariants."""
    meta = shared_prefix_meta(4096, 0)
    assert meta.num_tokens == 4096
    d = check_attention(256, 4, 2, 16, torch.float32, False, "cpu", "torch")
    assert set(d) == {"out", "dq", "dk", "dv"}
    for div in ("reverse_kl", "jsd", None):
        check_distill(div, 48, 32, 300, 290, torch.float32, "cpu", "torch")
    for gradients in ("forward", "recompute"):
        check_distill("forward_kl", 48, 32, 300, 290, torch.float32, "cpu", "torch", gradients=gradients, loss_only=True)
    check_actor_loss(48, 32, 300, 290, torch.float32, "cpu", "torch")
