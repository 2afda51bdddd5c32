"""The C++ core's CPU kernels for one [rows, chunk] block of float32 logits
(csrc/logit_chunks.cpp), as the PyTorch path of the fused losses calls them: the forward's
softmax sums in one pass and dL/ds in one more (and the JSD's weight pass in one), in place of about ten elementwise PyTorch
passes and their temporaries (docs/design.md §6.2).

It also holds the core's bfloat16 GEMM with float32 accumulation and output
(csrc/bf16_gemm.cpp): `bf16_gemm_usable(...)` says whether it may run (a CPU with
AVX512-BF16, the same switch), `bf16_matmul` calls it.

`usable(...)` says whether a call may take them: CPU float32 contiguous tensors, a built
`memopd._C` that has them, and `MEMOPD_NATIVE_CHUNKS` not set to 0 (the switch the tests
and benchmarks use to compare both). Anything else keeps the PyTorch ops, which compute
the same sums.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
from torch import Tensor

__all__ = ["usable", "softmax_sums", "dlogits", "MODE_NONE", "MODE_DIFF", "MODE_GIVEN", "MODE_FORWARD_KL",
           "has_forward_kl", "has_jsd_weights", "jsd_weights", "has_bf16_gemm", "bf16_gemm_usable", "bf16_matmul",
           "bf16_pack_rhs", "bf16_in_place_usable", "bf16_matmul_nt_packed"]

MODE_NONE, MODE_DIFF, MODE_GIVEN, MODE_FORWARD_KL = 0, 1, 2, 3  # X of dlogits: none, s - t, t, (q - p)/p

try:
    from memopd import _C

    _HAVE = hasattr(_C, "softmax_sums") and hasattr(_C, "dlogits")
    _HAVE_FKL = _HAVE and "lse_t" in (_C.dlogits.__doc__ or "")  # a core built before MODE_FORWARD_KL lacks it
    _HAVE_JSD = _HAVE and hasattr(_C, "jsd_weights")
    _HAVE_BF16 = hasattr(_C, "bf16_gemm") and bool(_C.bf16_gemm_available())
except ImportError:  # a source tree whose core is not built: the PyTorch ops do the work
    _C = None
    _HAVE = _HAVE_FKL = _HAVE_JSD = _HAVE_BF16 = False


def usable(*tensors: Optional[Tensor]) -> bool:
    if not _HAVE or os.environ.get("MEMOPD_NATIVE_CHUNKS", "1") == "0":
        return False
    return all(t is None or (t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous())
               for t in tensors)


def has_forward_kl() -> bool:
    """Whether the built core's `dlogits` takes MODE_FORWARD_KL (else the PyTorch ops do that mode)."""
    return _HAVE_FKL


def _ptr(t: Optional[Tensor], n: int) -> int:
    """A row vector's data pointer after checking it holds n float32 values (0 for None)."""
    if t is None:
        return 0
    if t.numel() != n or t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(f"native chunk kernel: a per-row vector must be {n} contiguous CPU float32 values, "
                         f"got {tuple(t.shape)} {t.dtype} on {t.device}")
    return t.data_ptr()


def _block(s: Tensor, t: Optional[Tensor]) -> tuple[int, int]:
    if s.dim() != 2 or not usable(s, t) or (t is not None and t.shape != s.shape):
        raise ValueError("native chunk kernel: s (and t) must be one contiguous CPU float32 [rows, chunk] block, "
                         f"got {tuple(s.shape)}" + ("" if t is None else f" and {tuple(t.shape)}"))
    return s.shape[0], s.shape[1]


def softmax_sums(s: Tensor, t: Optional[Tensor], m_s: Tensor, m_t: Optional[Tensor], z_s: Tensor, a_s: Tensor,
                 z_t: Optional[Tensor], e_d: Optional[Tensor], *, weight_teacher: bool) -> None:
    """Adds to the [n] sums, for the [n, c] block s (and t): z_s Σ e^{s - m_s}, a_s Σ
    log2(e)(s - m_s) e^{s - m_s}; with t, z_t Σ e^{t - m_t} and e_d Σ w (s - t), w =
    e^{t - m_t} if `weight_teacher` else e^{s - m_s}."""
    n, c = _block(s, t)
    _C.softmax_sums(s.data_ptr(), 0 if t is None else t.data_ptr(), n, c, _ptr(m_s, n), _ptr(m_t, n),
                    _ptr(z_s, n), _ptr(a_s, n), _ptr(z_t, n), _ptr(e_d, n), bool(weight_teacher),
                    torch.get_num_threads())


def dlogits(s: Tensor, t: Optional[Tensor], lse_s: Tensor, a: Tensor, b: Optional[Tensor], d: Optional[Tensor],
            mode: int, lse_t: Optional[Tensor] = None, dlse: Optional[Tensor] = None) -> Tensor:
    """In place over the [n, c] block s, returned: p (a + b log2 p + d X) with p = e^{s -
    lse_s} and X none (MODE_NONE), s - t (MODE_DIFF), t (MODE_GIVEN) or, for the forward KL
    (MODE_FORWARD_KL), (q - p)/p with q = e^{t - lse_t} and -δ = dlse - (s - t): p X is
    p expm1(-δ) where -δ <= 1/2 and q - p beyond; a, b, d (and lse_t, dlse) per row."""
    n, c = _block(s, t)
    if (mode == MODE_NONE) != (t is None and d is None):
        raise ValueError("native chunk kernel: t and d go with a mode that has X, and only with one")
    if (mode == MODE_FORWARD_KL) != (lse_t is not None and dlse is not None):
        raise ValueError("native chunk kernel: lse_t and dlse go with MODE_FORWARD_KL, and only with it")
    _C.dlogits(s.data_ptr(), 0 if t is None else t.data_ptr(), n, c, _ptr(lse_s, n), _ptr(a, n), _ptr(b, n),
               _ptr(d, n), int(mode), torch.get_num_threads(), _ptr(lse_t, n), _ptr(dlse, n))
    return s


def has_jsd_weights() -> bool:
    """Whether the built core has `jsd_weights` (else the PyTorch ops compute the JSD weight)."""
    return _HAVE_JSD


def jsd_weights(s: Tensor, t: Tensor, lse_s: Tensor, lse_t: Tensor, dlse: Tensor, beta: float, sp: Tensor,
                sq: Tensor) -> Tensor:
    """In place over the [n, c] teacher block t, returned: the JSD weight -(δ - u) = log(β q/p
    + 1 - β) of each entry in nats, δ = (s - t) - dlse, p = e^{s - lse_s}, q = e^{t - lse_t};
    adds Σ p w to sp and Σ q w to sq ([n] each). Absolute precision ~1e-7 (fp32 roundoff of a
    weight that is not small: the caller takes it where p and q are not close), no overflow
    however far q is above p; beta in (0, 1]."""
    n, c = _block(s, t)
    if not 0.0 < beta <= 1.0:
        raise ValueError(f"native chunk kernel: the JSD weight needs beta in (0, 1], got {beta}")
    _C.jsd_weights(s.data_ptr(), t.data_ptr(), n, c, _ptr(lse_s, n), _ptr(lse_t, n), _ptr(dlse, n), float(beta),
                   _ptr(sp, n), _ptr(sq, n), torch.get_num_threads())
    return t


def has_bf16_gemm() -> bool:
    """Whether the core's bf16 GEMM runs here (built, and a CPU with AVX512-BF16)."""
    return _HAVE_BF16


def bf16_gemm_usable(*tensors: Optional[Tensor]) -> bool:
    """Whether `bf16_matmul` may take these operands: the GEMM runs here, MEMOPD_NATIVE_CHUNKS
    is not 0, and every tensor is a CPU bfloat16 one (None allowed)."""
    if not _HAVE_BF16 or os.environ.get("MEMOPD_NATIVE_CHUNKS", "1") == "0":
        return False
    return all(t is None or (t.device.type == "cpu" and t.dtype == torch.bfloat16) for t in tensors)


def bf16_matmul(a: Tensor, b: Tensor, out: Tensor, *, alpha: float = 1.0, accumulate: bool = False) -> Tensor:
    """out = alpha·(a @ b) (+ out with `accumulate`), returned: a [M, K], b [K, N] CPU
    tensors of any strides, bfloat16, or float32 rounded to bfloat16 (nearest even) as the
    core packs them; out a float32 [M, N] block with unit column stride. The products of
    bf16 values are exact in fp32, so the result is the exact product of the bf16 operands
    up to fp32 accumulation (and denormals flushed to zero)."""
    if not _HAVE_BF16:
        raise RuntimeError("bf16_matmul: the C++ core's bf16 GEMM does not run here (has_bf16_gemm() is False)")
    M, K = a.shape
    N = b.shape[1]
    ok = (b.shape[0] == K and tuple(out.shape) == (M, N) and out.dtype == torch.float32 and out.stride(1) == 1
          and all(t.device.type == "cpu" and t.dtype in (torch.bfloat16, torch.float32) for t in (a, b)))
    if not ok:
        raise ValueError(f"bf16_matmul: a {tuple(a.shape)} {a.dtype}, b {tuple(b.shape)} {b.dtype} and out "
                         f"{tuple(out.shape)} {out.dtype} do not make out[M, N] = a[M, K] @ b[K, N] on CPU")
    _C.bf16_gemm(a.data_ptr(), a.stride(0), a.stride(1), a.dtype == torch.float32, b.data_ptr(), b.stride(0),
                 b.stride(1), b.dtype == torch.float32, out.data_ptr(), max(out.stride(0), N), M, N, K,
                 float(alpha), bool(accumulate), torch.get_num_threads())
    return out


def bf16_pack_rhs(b: Tensor) -> Tensor:
    """b [K, N] (CPU, bfloat16, or float32 rounded to bfloat16, any strides) packed once as
    the right-hand operand of `bf16_matmul_nt_packed` (an int32 tensor in the core's panel
    layout): a token block's hidden rows (b = hᵀ), reused against every weight chunk."""
    if not _HAVE_BF16:
        raise RuntimeError("bf16_pack_rhs: the C++ core's bf16 GEMM does not run here (has_bf16_gemm() is False)")
    if b.dim() != 2 or b.device.type != "cpu" or b.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"bf16_pack_rhs: b must be a 2-D CPU bfloat16 or float32 tensor, got "
                         f"{tuple(b.shape)} {b.dtype} on {b.device}")
    K, N = b.shape
    out = torch.empty(_C.bf16_packed_words(N, K), dtype=torch.int32)
    _C.bf16_pack_b(b.data_ptr(), b.stride(0), b.stride(1), b.dtype == torch.float32, K, N, out.data_ptr(),
                   torch.get_num_threads())
    return out


def bf16_in_place_usable(w: Tensor) -> bool:
    """Whether `bf16_matmul_nt_packed` can read w [M, K] in place: a CPU bfloat16 matrix with
    unit stride along K, K and its row stride even, 4-byte aligned (its bf16 pairs are then
    32-bit words)."""
    return (_HAVE_BF16 and w.dim() == 2 and w.dtype == torch.bfloat16 and w.device.type == "cpu"
            and w.stride(1) == 1 and w.shape[1] % 2 == 0 and w.stride(0) % 2 == 0 and w.data_ptr() % 4 == 0)


def bf16_matmul_nt_packed(w: Tensor, x_packed: Tensor, n_rows: int, out: Tensor, *, alpha: float = 1.0,
                          accumulate: bool = False) -> Tensor:
    """out = alpha·(x @ wᵀ) (+ out with `accumulate`), returned, where `x_packed` is
    `bf16_pack_rhs(x.t())` of x [n_rows, K] and w [M, K] a bfloat16 matrix read in place (unit
    stride along K, K and its row stride even, 4-byte aligned: a row-major weight chunk);
    out a float32 [n_rows, M] block with unit column stride. The same sums as `bf16_matmul(x,
    w.t(), out)`, bit for bit, without rearranging w."""
    M, K = w.shape
    ok = (bf16_in_place_usable(w) and x_packed.numel() == _C.bf16_packed_words(n_rows, K) and tuple(out.shape) == (n_rows, M)
          and out.dtype == torch.float32 and out.stride(1) == 1)
    if not ok:
        raise ValueError(f"bf16_matmul_nt_packed: w {tuple(w.shape)} {w.dtype} (strides {w.stride()}), "
                         f"{x_packed.numel()} packed words for {n_rows} rows and out {tuple(out.shape)} "
                         f"{out.dtype} do not make out[n_rows, M] = x @ w^T with w's pairs in place")
    _C.bf16_gemm_at(w.data_ptr(), max(w.stride(0), K), x_packed.data_ptr(), out.data_ptr(),
                    max(out.stride(0), M), M, n_rows, K, float(alpha), bool(accumulate), torch.get_num_threads())
    return out
