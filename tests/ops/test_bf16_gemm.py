"""The C++ core's bf16 GEMM with fp32 output (`memopd.ops._native_chunks.bf16_matmul`) and
the fused ops' CPU route through it for bfloat16 heads.

The GEMM is compared with the float64 product of the same bf16 values (its products are
exact in fp32, so only fp32 accumulation separates them) over every stride layout the
fused ops use, odd sizes and float32 operands rounded on packing. The fused ops with
bf16 heads are compared with the float64 references (values to 1e-5: fp32 precision),
with the fp32 path on the same inputs (MEMOPD_NATIVE_CHUNKS=0), and are checked to have
taken the bf16 GEMM. Skipped only where the CPU lacks AVX512-BF16, and that is checked
against /proc/cpuinfo so a detection fault fails instead of skipping.
"""
from __future__ import annotations

import math

import pytest
import torch
from _fused_cases import as64, make_inputs, weighted_grads

from memopd.ops import _native_chunks as nc
from memopd.ops import (
    fused_linear_actor_loss,
    fused_linear_distill,
    fused_linear_logprob_entropy,
    reference_actor_loss,
    reference_linear_distill,
    reference_linear_logprob_entropy,
)


def _cpu_flags() -> set:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def test_detection_matches_the_cpu():
    flags = _cpu_flags()
    if not flags:
        pytest.skip("no /proc/cpuinfo flags to compare with")
    want = {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} <= flags
    assert nc.has_bf16_gemm() == want, (nc.has_bf16_gemm(), sorted(f for f in flags if "avx512" in f))


needs_bf16 = pytest.mark.skipif(not nc.has_bf16_gemm(), reason="this CPU has no AVX512-BF16")


def _rel(c: torch.Tensor, ref: torch.Tensor) -> float:
    return ((c.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-300)).item()


def _layouts(g, M, N, K, a_f32, b_f32):
    """(a, b) of a[M, K] @ b[K, N] in the four stride layouts (row- or column-major each)."""
    def mat(r, c, f32, colmajor):
        x = torch.randn(c, r, generator=g).t() if colmajor else torch.randn(r, c, generator=g)
        return x if f32 else x.bfloat16()
    for a_cm in (False, True):
        for b_cm in (False, True):
            yield f"a{'T' if a_cm else 'N'}b{'T' if b_cm else 'N'}", mat(M, K, a_f32, a_cm), mat(K, N, b_f32, b_cm)


@needs_bf16
@pytest.mark.parametrize("M,N,K", [(1, 1, 1), (5, 7, 3), (13, 33, 17), (12, 32, 2), (37, 95, 1025), (100, 61, 600)])
@pytest.mark.parametrize("f32", [(False, False), (True, False), (False, True), (True, True)])
def test_gemm_matches_float64(seed, M, N, K, f32):
    g = torch.Generator().manual_seed(seed)
    for name, a, b in _layouts(g, M, N, K, *f32):
        ref = a.bfloat16().double() @ b.bfloat16().double()  # fp32 operands: torch's nearest-even rounding
        c = torch.full((M, N), float("nan"))
        nc.bf16_matmul(a, b, c)
        # fp32 accumulation of K exact products: |err| <= K·2^-24·Σ|a||b| (a loose bound)
        bound = (K * 2.0 ** -24) * (a.bfloat16().double().abs() @ b.bfloat16().double().abs())
        assert ((c.double() - ref).abs() <= bound + 1e-30).all(), (seed, name, M, N, K, f32, _rel(c, ref))
        assert _rel(c, ref) < 1e-6, (seed, name, _rel(c, ref))
        c0 = torch.randn(M, N, generator=g)
        c1 = c0.clone()
        nc.bf16_matmul(a, b, c1, alpha=-0.75, accumulate=True)
        ref1 = c0.double() - 0.75 * ref
        assert _rel(c1, ref1) < 2e-6, (seed, name, "accumulate", _rel(c1, ref1))


@needs_bf16
def test_gemm_writes_only_its_block_of_a_wider_output(seed):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(20, 9, generator=g).bfloat16()
    b = torch.randn(9, 45, generator=g).bfloat16()
    wide = torch.full((20, 70), 7.0)
    nc.bf16_matmul(a, b, wide[:, 10:55])
    assert _rel(wide[:, 10:55], a.double() @ b.double()) < 1e-6
    assert (wide[:, :10] == 7.0).all() and (wide[:, 55:] == 7.0).all()


@needs_bf16
@pytest.mark.parametrize("N,M,K", [(1, 1, 2), (5, 7, 6), (13, 33, 18), (32, 12, 2), (37, 95, 1026), (100, 61, 600)])
def test_weight_in_place_gemm_is_bf16_matmul_bit_for_bit(seed, N, M, K):
    # the logits' GEMM: w [M, K] read in place (a chunk of a wider weight, so its row stride
    # is not K), x's rows packed once; the same sums in the same order as bf16_matmul, and
    # it writes only its [N, M] block of a wider output, adding with accumulate
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, K, generator=g).bfloat16()
    w = torch.randn(M + 9, K + 4, generator=g).bfloat16()[3:3 + M, 2:2 + K]
    assert nc.bf16_in_place_usable(w)
    xp = nc.bf16_pack_rhs(x.t())
    want = torch.empty(N, M)
    nc.bf16_matmul(x, w.t(), want)
    assert _rel(want, x.double() @ w.double().t()) < 1e-6
    wide = torch.full((N, M + 11), 7.0)
    nc.bf16_matmul_nt_packed(w, xp, N, wide[:, 5:5 + M])
    assert torch.equal(wide[:, 5:5 + M], want), (seed, N, M, K)
    assert (wide[:, :5] == 7.0).all() and (wide[:, 5 + M:] == 7.0).all()
    c0 = torch.randn(N, M, generator=g)
    c1, c2 = c0.clone(), c0.clone()
    nc.bf16_matmul(x, w.t(), c1, alpha=-0.75, accumulate=True)
    nc.bf16_matmul_nt_packed(w, xp, N, c2, alpha=-0.75, accumulate=True)
    assert torch.equal(c1, c2), (seed, N, M, K, "accumulate")
    assert torch.equal(nc.bf16_pack_rhs(x.float().t()), xp)  # fp32 rows round to the same bf16


@needs_bf16
def test_weight_in_place_gemm_refuses_what_it_cannot_read_in_place():
    w = torch.zeros(8, 10, dtype=torch.bfloat16)
    xp = nc.bf16_pack_rhs(torch.zeros(4, 10, dtype=torch.bfloat16).t())
    for bad in (w.t().contiguous().t(), w[:, 1:9], torch.zeros(8, 9, dtype=torch.bfloat16), w.float()):
        assert not nc.bf16_in_place_usable(bad)
    with pytest.raises(ValueError, match="bf16_matmul_nt_packed"):
        nc.bf16_matmul_nt_packed(w[:, 1:9], xp, 4, torch.zeros(4, 8))
    with pytest.raises(ValueError, match="bf16_matmul_nt_packed"):
        nc.bf16_matmul_nt_packed(w, xp, 40, torch.zeros(40, 8))  # packed for 4 rows (one 32-row panel)
    with pytest.raises(ValueError, match="bf16_pack_rhs"):
        nc.bf16_pack_rhs(torch.zeros(4, 10, dtype=torch.float16))


@needs_bf16
def test_gemm_rejects_mismatched_shapes_in_one_line():
    a = torch.zeros(4, 3, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="do not make out"):
        nc.bf16_matmul(a, torch.zeros(4, 5, dtype=torch.bfloat16), torch.zeros(4, 5))
    with pytest.raises(ValueError, match="do not make out"):
        nc.bf16_matmul(a, torch.zeros(3, 5, dtype=torch.bfloat16), torch.zeros(4, 5, dtype=torch.float64))


@needs_bf16
def test_gemm_zero_k_clears_or_keeps():
    c = torch.ones(3, 4)
    nc.bf16_matmul(torch.zeros(3, 0, dtype=torch.bfloat16), torch.zeros(0, 4, dtype=torch.bfloat16), c)
    assert (c == 0).all()
    c = torch.ones(3, 4)
    nc.bf16_matmul(torch.zeros(3, 0, dtype=torch.bfloat16), torch.zeros(0, 4, dtype=torch.bfloat16), c,
                   accumulate=True)
    assert (c == 1).all()


class _CountBf16:
    """Counts the calls that reach the core's bf16 GEMMs (the real ones run): `bf16_matmul`
    and the logits' weight-in-place `bf16_matmul_nt_packed`."""

    def __init__(self, monkeypatch):
        self.calls = 0
        self.by_name = {"bf16_matmul": 0, "bf16_matmul_nt_packed": 0}
        for name in self.by_name:
            monkeypatch.setattr(nc, name, self._counted(name, getattr(nc, name)))

    def _counted(self, name, real):
        def counted(*a, **k):
            self.calls += 1
            self.by_name[name] += 1
            return real(*a, **k)
        return counted


def _distill_case(seed):
    # several token blocks and vocabulary chunks, a teacher close to the student (the precise
    # dlse path) and a bias on both heads
    return make_inputs(seed, N=70, Hs=48, Ht=48, V=517, dtype=torch.bfloat16, teacher="close", teacher_bias=True,
                       scale=0.3)


@needs_bf16
@pytest.mark.parametrize("divergence", ["reverse_kl", "forward_kl", "jsd"])
@pytest.mark.parametrize("gradients", ["forward", "recompute"])
@pytest.mark.parametrize("chunks", [dict(chunk_size=128, token_chunk_size=32), {}])
def test_fused_distill_bf16_route(seed, monkeypatch, divergence, gradients, chunks):
    inp = _distill_case(seed)
    kw = dict(temperature=1.3, divergence=divergence, **chunks)

    def call(fn, x, **extra):
        out = fn(x["hs"], x["ws"], x["ht"], x["wt"], x["y"], mask=x["mask"], student_bias=x["bs"],
                 teacher_bias=x["bt"], **kw, **extra)
        return out, weighted_grads(out, x, {"loss": 1.0})

    count = _CountBf16(monkeypatch)
    out, g = call(fused_linear_distill, inp, gradients=gradients)
    assert count.calls > 0, "the bf16 heads did not take the core's bf16 GEMM"
    ref, gr = call(reference_linear_distill, as64(inp))
    # values: the logits are the exact products up to fp32 accumulation, so fp32 precision
    rel = abs(out.loss.item() - ref.loss.item()) / abs(ref.loss.item())
    assert rel <= 1e-5, (seed, divergence, rel)
    for name in ("kl", "logprobs", "entropy"):
        a, b = getattr(out, name).double(), getattr(ref, name).detach()
        assert (a - b).abs().max().item() <= 2e-5 * (1 + b.abs().max().item()), (seed, name)
    # the fp32 path on the same bf16 inputs: the same values to fp32 roundoff
    monkeypatch.setenv("MEMOPD_NATIVE_CHUNKS", "0")
    before = count.calls
    out32, g32 = call(fused_linear_distill, inp, gradients=gradients)
    assert count.calls == before, "MEMOPD_NATIVE_CHUNKS=0 must keep the fp32 path"
    assert math.isclose(out.loss.item(), out32.loss.item(), rel_tol=5e-6, abs_tol=1e-7)
    # gradients: dL/ds rounded to bf16 for dH / dW (relative 2^-9 per entry), returned in bf16;
    # the bias gradient is summed from the fp32 values
    for name, a, b, a32 in zip(("dH", "dW", "db"), g, gr, g32):
        scale = b.abs().max().item()
        err = (a.double() - b.detach()).abs().max().item() / scale
        err32 = (a32.double() - b.detach()).abs().max().item() / scale
        assert err <= 1.5e-2, (seed, name, err)
        assert err <= 2 * err32 + 4e-3, (seed, name, err, err32)


@needs_bf16
@pytest.mark.parametrize("H", [40, 39])
def test_logprob_entropy_bf16_route(seed, monkeypatch, H):
    # an even H: the logits read the weight in place; an odd one: its pairs straddle rows,
    # so the logits take the packing GEMM (bf16_matmul), with the same precision
    inp = make_inputs(seed, N=50, Hs=H, V=333, dtype=torch.bfloat16)
    count = _CountBf16(monkeypatch)
    args = (inp["hs"], inp["ws"], inp["y"])
    out = fused_linear_logprob_entropy(*args, bias=inp["bs"], mask=inp["mask"], chunk_size=64)
    in_place = count.by_name["bf16_matmul_nt_packed"]
    assert (in_place > 0 and count.by_name["bf16_matmul"] == 0) if H % 2 == 0 else \
        (in_place == 0 and count.by_name["bf16_matmul"] > 0), (H, count.by_name)
    x = as64(inp)
    ref = reference_linear_logprob_entropy(x["hs"], x["ws"], x["y"], bias=x["bs"], mask=x["mask"])
    for name in ("logprobs", "entropy"):
        a, b = getattr(out, name).double(), getattr(ref, name).detach()
        assert (a - b).abs().max().item() <= 2e-5 * (1 + b.abs().max().item()), (seed, name)


@needs_bf16
@pytest.mark.parametrize("with_teacher", [False, True])
def test_actor_loss_bf16_route(seed, monkeypatch, with_teacher):
    inp = make_inputs(seed, N=64, Hs=40, Ht=40, V=389, dtype=torch.bfloat16, teacher="close")
    g = torch.Generator().manual_seed(seed + 3)
    adv = torch.randn(64, generator=g)
    old = -torch.rand(64, generator=g) * 6
    teacher = dict(teacher_hidden=inp["ht"], teacher_weight=inp["wt"], teacher_kl_coef=0.2) if with_teacher else {}
    count = _CountBf16(monkeypatch)

    def call(fn, x, **extra):
        t = dict(teacher, teacher_hidden=x["ht"], teacher_weight=x["wt"]) if with_teacher else {}
        out = fn(x["hs"], x["ws"], x["y"], adv, old, student_bias=x["bs"], mask=x["mask"], entropy_coef=0.01,
                 temperature=0.9, **t, **extra)
        return out, torch.autograd.grad(out.loss, [x["hs"], x["ws"], x["bs"]])

    out, g16 = call(fused_linear_actor_loss, inp, token_chunk_size=24)
    assert count.calls > 0
    ref, gr = call(reference_actor_loss, as64(inp))
    rel = abs(out.loss.item() - ref.loss.item()) / abs(ref.loss.item())
    assert rel <= 1e-5, (seed, rel)
    for name, a, b in zip(("dH", "dW", "db"), g16, gr):
        err = (a.double() - b).abs().max().item() / b.abs().max().item()
        assert err <= 1.5e-2, (seed, name, err)


@needs_bf16
def test_gemm_threads_split_rows_with_the_same_bits(seed):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(300, 200, generator=g)  # fp32, rounded on packing
    b = torch.randn(200, 90, generator=g).bfloat16()
    one, two = torch.empty(300, 90), torch.empty(300, 90)
    prev = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        nc.bf16_matmul(a, b, one)
        torch.set_num_threads(2)
        nc.bf16_matmul(a, b, two)
    finally:
        torch.set_num_threads(prev)
    assert torch.equal(one, two)
    assert _rel(one, a.bfloat16().double() @ b.double()) < 1e-6


@needs_bf16
@pytest.mark.parametrize("divergence", ["reverse_kl", "jsd"])
def test_bf16_route_dw_written_by_its_first_block_and_kept_in_the_resident_buffer(seed, monkeypatch, divergence):
    # H=64 and 16-row blocks: the resident student logits (16 x V fp32) are no bigger than the
    # bf16 dW, so the gradient-in-forward sweep returns dW in that buffer; 40-row blocks do not
    # (a fresh dW). Both write dW in the first token block instead of zeroing it, and agree
    # with the float64 reference and with each other to bf16 output rounding.
    inp = make_inputs(seed, N=90, Hs=64, Ht=64, V=301, dtype=torch.bfloat16, teacher="close", bias=False)
    x64 = as64(inp)
    kw = dict(divergence=divergence, temperature=1.1)
    grads = {}
    for rows in (16, 40):
        out = fused_linear_distill(inp["hs"], inp["ws"], inp["ht"], inp["wt"], inp["y"], mask=inp["mask"],
                                   token_chunk_size=rows, **kw)
        grads[rows] = torch.autograd.grad(out.loss, [inp["ws"]])[0]
        assert grads[rows].dtype == torch.bfloat16 and grads[rows].shape == inp["ws"].shape
    ref = reference_linear_distill(x64["hs"], x64["ws"], x64["ht"], x64["wt"], x64["y"], mask=x64["mask"], **kw)
    gref = torch.autograd.grad(ref.loss, [x64["ws"]])[0]
    scale = gref.abs().max().item()
    for rows, g in grads.items():
        assert (g.double() - gref).abs().max().item() / scale <= 1.5e-2, (seed, rows)
    # the two partitions differ only in fp32 accumulation order and dL/ds rounding: within a few bf16 steps
    assert (grads[16].double() - grads[40].double()).abs().max().item() / scale <= 2e-2
    # the resident-buffer dW is a tensor of its own: changing it leaves the other untouched
    before = grads[40].clone()
    grads[16].zero_()
    assert torch.equal(grads[40], before)


@needs_bf16
def test_bf16_route_with_no_kept_token_returns_zero_dw(seed):
    inp = make_inputs(seed, N=20, Hs=64, Ht=64, V=211, dtype=torch.bfloat16, bias=False)
    mask = torch.zeros(20, dtype=torch.bool)
    ws = inp["ws"].detach().clone().requires_grad_()
    out = fused_linear_distill(inp["hs"], ws, inp["ht"], inp["wt"], inp["y"], mask=mask)
    (g,) = torch.autograd.grad(out.loss + 0.0 * ws.sum(), [ws])
    assert out.loss.item() == 0.0
    assert torch.equal(g, torch.zeros_like(g))
