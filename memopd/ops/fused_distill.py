"""Fused linear distillation: reverse KL (or forward KL / JSD) + log-prob + entropy,
and its teacher-less mode: log-prob + entropy of the student alone.

From the last hidden states and lm_head weights of a student and a frozen teacher,
for every kept token i:

    s = (h_s[i] @ W_s^T + b_s) / T,   t = (h_t[i] @ W_t^T + b_t) / T     (first V columns)
    p = softmax(s), q = softmax(t)
    kl[i]       = Σ_v p_v (log p_v - log q_v)          (divergence="reverse_kl", default)
                  Σ_v q_v (log q_v - log p_v)          (divergence="forward_kl")
                  β KL(q‖M) + (1-β) KL(p‖M)            (divergence="jsd", M = β q + (1-β) p)
    logprobs[i] = log p_{targets[i]}
    entropy[i]  = -Σ_v p_v log p_v

and the reduced `loss` (mean of `kl` over kept tokens by default). Gradients flow to
the student hidden states, weight and bias from **all** of `loss`, `kl`, `logprobs` and
`entropy`, so an actor loss `L_PPO(logprobs) - α·entropy + λ·kl` backpropagates through
one op. Nothing of size [N, V] is ever materialised.

Public API (re-exported by `memopd.ops`)
---------------------------------------
- `fused_linear_reverse_kl(student_hidden, student_weight, teacher_hidden, teacher_weight,
  targets, *, mask=None, temperature=1.0, student_bias=None, teacher_bias=None,
  vocab_size=None, chunk_size=None, reduction="mean", ...) -> DistillOutput`
- `fused_linear_distill(..., divergence="reverse_kl"|"forward_kl"|"jsd", beta=0.5)`
- `reference_linear_reverse_kl`, `reference_linear_distill`: naive, materialising,
  float64-capable references with the same signature (tests, benchmarks).
- `DistillOutput(loss, kl, logprobs, entropy)`: a NamedTuple. `kl` holds the selected
  divergence per token. Per-token fields are fp32 (float64 for float64 inputs on the
  PyTorch path), zero at masked-out tokens.
- `fused_linear_logprob_entropy(hidden, weight, targets, *, bias=None, mask=None,
  temperature=1.0, vocab_size=None, chunk_size=None, ignore_index=-100, backend=None,
  token_chunk_size=None, check_targets=None) -> LogProbEntropy`: the teacher-less mode
  (PPO/GRPO actor losses, rollout scoring; cf. verl's fused linear-for-PPO): the same
  forward/backward with every teacher matmul and statistic removed (a `None` teacher
  on the PyTorch path, the HAS_TEACHER=False constexpr in the Triton forward). Under
  `torch.no_grad()` it saves nothing and peaks at O(rows × chunk), not [N, V].
- `reference_linear_logprob_entropy`: its naive, float64-capable reference.
- `LogProbEntropy(logprobs, entropy)`: a NamedTuple of per-token fp32 tensors (float64
  for float64 inputs on the PyTorch path), zero at masked-out tokens; gradients reach
  hidden, weight and bias from both.

Conventions
-----------
- Shapes: student hidden [N, Hs], weight [V, Hs]; teacher hidden [N, Ht], weight
  [Vt, Ht] (Ht may differ from Hs). `vocab_size` is the true vocabulary when one
  lm_head is padded (e.g. Qwen2.5's 151936 rows for 151665 tokens): columns at or
  beyond it are excluded from both distributions (never treated as logit 0) and get
  zero gradient. If V != Vt, `vocab_size` must be given.
- Temperature divides both student and teacher logits, for every output (log-probs
  and entropy are those of the temperature-T student, as the sampler used them).
- Masking: `mask` [N] (bool); tokens whose target equals `ignore_index` (default
  -100, the Hugging Face label convention) are masked too. Masked tokens give 0 in
  every per-token output and receive zero gradient; `reduction="mean"` divides by
  the number of kept tokens (an all-masked batch gives loss 0, zero gradients).
- JSD follows TRL's `GKDTrainer.generalized_jsd_loss` (GKD paper, eq. 1):
  M = β·p_teacher + (1-β)·p_student, JSD_β = β·KL(p_t‖M) + (1-β)·KL(p_s‖M); like TRL,
  β = 0 is computed as forward KL(p_t‖p_s) and β = 1 as reverse KL(p_s‖p_t) (the
  mixture formula itself tends to 0 at both ends). Liger's `LigerFusedLinearJSD`
  uses the same β convention (β = 1: reverse KL).
- The teacher is frozen: teacher tensors that require grad raise `ValueError`
  (pass `.detach()`ed tensors, or compute the teacher under `torch.no_grad()`).

Algorithm (shared by both back ends)
------------------------------------
Forward: one pass over vocabulary tiles. Both logits tiles are computed in fp32 (bf16
inputs are multiplied with fp32 accumulation) and folded into per-token online
statistics: running max and sum-exp of s and of t, Σ e^{s-m}(s-m) for the entropy,
the target logit, Σ e^{s-m}(s-t) (E_p[d], or E_q[d] for forward KL), and a joint-max
sum Σ (e^{s-M} - e^{t-M}) evaluated as e^{t-M}·expm1(s-t). The last one gives
lse_s - lse_t = log1p(ΔZ/Z_t) with *relative* precision, so that

    KL(p‖q) = E_p[s - t] - (lse_s - lse_t)

stays accurate (and ≥ 0) when the teacher is the student plus noise: the usual
"E_p[s] - lse_s - E_p[t] + lse_t" subtracts O(10) numbers to get O(1e-6). The JSD
needs log(β q_v + (1-β) p_v) per entry, i.e. normalised distributions, which fixed
online sums cannot give: it makes a second pass over the vocabulary once both
log-sum-exps are known (log1p/expm1 forms again keep close distributions precise),
unless whole vocabulary rows are resident (the PyTorch path's default for the JSD,
below), where it is evaluated on the same logits.

Backward: the tiles are recomputed and, with δ_v = log p_v - log q_v,

    dL/ds_v = g_lp (1[v=y] - p_v) - g_H p_v (log p_v + H)
              + g_kl · { p_v (δ_v - KL)                       reverse KL
                         p_v - q_v                              forward KL
                         (1-β) p_v ((log p_v - log M_v) - KL(p‖M))   JSD }

and dL/dlogit = dL/ds / T. The teacher logits are recomputed only when the
divergence receives a gradient. The teacher-less op is the case g_kl = 0 with no
teacher at all: its forward keeps only the student sums (max, sum-exp, entropy sum,
target logit), so it costs one lm_head-sized matmul in the forward and three in the
backward (recompute, dH, dW). dH = dlogits @ W, dW = dlogits^T @ H, db = Σ dlogits,
all accumulated in fp32 (dW in an fp32 buffer when the weight is bf16/fp16).

Back ends
---------
- CUDA tensors: Triton kernels (`memopd.kernels.fused_distill`). Masked tokens are
  compacted on the device (stable argsort of ~mask plus a device-side count that the
  kernels read as their loop bound), so the CUDA path never synchronises with the
  host. The forward grid also splits the vocabulary (occupancy at small N) and merges
  the partial statistics on the device. Backward writes dlogits for a bounded chunk of
  tokens (≈512 MiB, `MEMOPD_DISTILL_SCRATCH_MB`, or `token_chunk_size` rows) and
  reduces it with two deterministic Triton GEMMs (no atomics).
- CPU tensors: the same algorithm in blocked PyTorch. Masked rows are dropped with
  `index_select` before any matmul. Tokens go in blocks of `token_chunk_size` kept
  rows (default: at most 1024, split evenly) and the vocabulary in chunks of
  `chunk_size` columns (default: about 2^20 elements per [rows, chunk] piece, at least
  128 columns): [~1024, ~1024] pieces keep every fp32 GEMM near single-core peak
  (~95-100 GFLOP/s here, against ~80 for [256, V] full-row blocks and ~57 for [64, V])
  and the elementwise passes largely in cache. The pieces live in four reused scratch buffers
  (a fresh multi-MiB tensor page-faults on every use, which cost as much as the
  arithmetic on it), exponentials are exp2 of logits centred and rescaled in one pass
  (~3x cheaper than exp), and each row sum is one product pass plus a reduction.
  Whenever one chunk covers the vocabulary (small V or few rows, an explicit
  `chunk_size >= V`, and the JSD forward by default, in whole-row blocks of about 2^23
  elements, at least 64 rows), the forward uses exact row maxima, evaluates the
  precise lse_s - lse_t only on rows whose plain KL estimate is below 1e-2, and the
  JSD needs no second matmul pass. So the largest tensors are the four [rows, chunk]
  scratch blocks ([rows, V] in the full-row JSD forward), the fp32 copies of a
  block's hidden rows and the fp32 dW accumulator; never [N, V]. The price is
  compute: the backward recomputes both logit chunks, so the op does 6 lm_head-sized
  matmuls where naive autograd does 4 (teacher-less: 4 vs 3), and the GEMMs are
  ~85-95% of its time. Measured (process CPU time, user+sys, one thread, fp32
  forward+backward of loss + 0.1 Σ logprobs - 0.01 Σ entropy (teacher-less: a PPO-style
  -Σ adv·logprobs - 0.01 Σ entropy), shared 2-core AVX-512 x86 box, medians of 2-3
  interleaved rounds, two sessions; /proc VmHWM peak above the inputs in fresh
  processes), fused vs `reference_linear_distill` / `reference_linear_logprob_entropy`
  in fp32:
  N=4096, H=512, V=32000: reverse KL 0.57-0.75x the time for 35x less peak memory,
  forward KL 0.84-0.88x / 29x, JSD 0.39x / 44x, teacher-less 0.56-0.80x / 27x;
  N=1024, H=1024, V=151936: reverse KL 0.83-0.88x / 6.7x, forward KL 0.90x / 5.7x,
  JSD 0.64x / 11x, teacher-less 0.83x / 4.8x (there the 594 MiB fp32 dW is most of
  the fused peak). A large and variable part of the naive op's time is the kernel
  zero-filling its fresh [N, V] tensors (system time); in user time alone the fused op
  takes 1.1-1.5x the naive time (teacher-less 1.2x; KLs 1.3-1.5x; JSD 1.1x at
  V=32000, 1.5x at V=151936): the price of the recomputing matmuls. See benchmarks/bench_fused_distill.py.
- `backend="auto"` (default; env `MEMOPD_DISTILL_BACKEND` overrides it) picks by
  device; `backend="triton"` forces the kernels, which on CPU tensors requires
  `TRITON_INTERPRET=1` set before the kernel module is imported (tests only);
  `backend="torch"` forces the PyTorch path on any device.
- Out-of-range targets are checked on CPU tensors only (the check would be a host
  sync on CUDA); pass `check_targets=True` or set `MEMOPD_DEBUG_CHECKS=1` to check
  CUDA targets too.

torch.compile
-------------
Forward and backward are registered as `torch.library.custom_op`s
(`memopd::fused_distill_fwd` / `memopd::fused_distill_bwd`; the teacher-less op calls
the same two with `None` teacher tensors) with fake (meta) implementations and
`register_autograd`, so `torch.compile` treats the op as one
opaque node: no graph break, no tracing into the data-dependent chunk loops. The
validation in the Python wrapper only reads metadata (shapes, dtypes, devices).

DeepSpeed ZeRO-3 / FSDP
-----------------------
The op needs the full lm_head weights in its forward and again in its backward; how to
call it under ZeRO-3 or FSDP is in docs/deepspeed.md §4.
"""
from __future__ import annotations

import importlib.util
import math
import os
import sys
from typing import NamedTuple, Optional

import torch
from torch import Tensor

__all__ = [
    "DistillOutput",
    "LogProbEntropy",
    "fused_linear_distill",
    "fused_linear_logprob_entropy",
    "fused_linear_reverse_kl",
    "reference_linear_distill",
    "reference_linear_logprob_entropy",
    "reference_linear_reverse_kl",
]

DIVERGENCES = {"reverse_kl": 0, "forward_kl": 1, "jsd": 2}
REDUCTIONS = ("mean", "sum", "none")
BACKENDS = ("auto", "torch", "triton")
NUM_STATS = 5  # lse_s, lse_t, lse_s - lse_t (precise), aux (KL or KL(p||M)), entropy

_TORCH_TOKEN_CHUNK = 1024  # rows of a token block (PyTorch path)
_TORCH_TILE_ELEMS = 1 << 20  # elements of one [rows, vocab chunk] piece (4 MiB fp32)
_TORCH_ROW_ELEMS = 1 << 23  # elements of one [rows, V] block in full-row mode (JSD forward)
_TORCH_MIN_ROWS = 64  # ... but at least this many rows (GEMM efficiency)
_TORCH_CONVERT_ROWS = 4096  # full-row mode: a bf16/fp16 weight is converted this many rows at a time
_NEG = -1.0e30


class DistillOutput(NamedTuple):
    """Result of the fused op: reduced loss and per-token fp32 tensors (0 where masked)."""

    loss: Tensor
    kl: Tensor
    logprobs: Tensor
    entropy: Tensor


class LogProbEntropy(NamedTuple):
    """Result of the teacher-less op: per-token fp32 tensors [N] (0 where masked)."""

    logprobs: Tensor
    entropy: Tensor


# ----------------------------------------------------------------------------------
# validation
# ----------------------------------------------------------------------------------
def _check_tensor(x, name, ndim):
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(x.shape)}")


def _validate_head(h, w, b, names):
    """One lm_head: hidden [N, H], weight [V, H], optional bias [V], one floating dtype."""
    hname, wname, bname = names
    _check_tensor(h, hname, 2)
    _check_tensor(w, wname, 2)
    if w.shape[1] != h.shape[1]:
        raise ValueError(f"{wname} must be [V, {h.shape[1]}] to match {hname} "
                         f"{tuple(h.shape)}, got {tuple(w.shape)}")
    for name, x in ((hname, h), (wname, w)):
        if not x.is_floating_point():
            raise TypeError(f"{name} must be a floating tensor, got {x.dtype}")
    if h.dtype != w.dtype:
        raise TypeError(f"dtype mismatch: {hname} is {h.dtype}, {wname} is {w.dtype}")
    if b is not None:
        _check_tensor(b, bname, 1)
        if b.shape[0] != w.shape[0]:
            raise ValueError(f"{bname} must have {w.shape[0]} entries, got {b.shape[0]}")
        if b.dtype != w.dtype:
            raise TypeError(f"dtype mismatch: {bname} is {b.dtype}, its weight is {w.dtype}")


def _validate_tokens(N, targets, mask):
    _check_tensor(targets, "targets", 1)
    if mask is not None:
        _check_tensor(mask, "mask", 1)
    if targets.shape[0] != N:
        raise ValueError(f"targets has {targets.shape[0]} entries, expected N={N}")
    if mask is not None and mask.shape[0] != N:
        raise ValueError(f"mask has {mask.shape[0]} entries, expected N={N}")
    if targets.dtype.is_floating_point or targets.dtype == torch.bool or targets.is_complex():
        raise TypeError(f"targets must be an integer tensor, got {targets.dtype}")
    if mask is not None and (mask.is_floating_point() or mask.is_complex()):
        raise TypeError(f"mask must be bool (or integer 0/1), got {mask.dtype}")


def _validate_one_device(tensors):
    devices = {x.device for x in tensors if x is not None}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")


def _validate_temperature(temperature) -> float:
    if isinstance(temperature, Tensor):
        raise TypeError("temperature must be a Python float, not a tensor")
    temperature = float(temperature)
    if not (temperature > 0.0) or not math.isfinite(temperature):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
    return temperature


_STUDENT_NAMES = ("student_hidden", "student_weight", "student_bias")
_TEACHER_NAMES = ("teacher_hidden", "teacher_weight", "teacher_bias")
_HEAD_NAMES = ("hidden", "weight", "bias")  # fused_linear_logprob_entropy's arguments


def _validate(hs, ws, ht, wt, targets, mask, bs, bt, temperature, vocab_size, reduction,
              divergence, beta):
    _check_tensor(hs, "student_hidden", 2)
    _check_tensor(ws, "student_weight", 2)
    _check_tensor(ht, "teacher_hidden", 2)
    _check_tensor(wt, "teacher_weight", 2)
    _validate_head(hs, ws, bs, _STUDENT_NAMES)
    _validate_head(ht, wt, bt, _TEACHER_NAMES)
    N = hs.shape[0]
    V = ws.shape[0]
    Vt = wt.shape[0]
    if ht.shape[0] != N:
        raise ValueError(f"teacher_hidden has {ht.shape[0]} tokens, student_hidden has {N}")
    _validate_tokens(N, targets, mask)
    _validate_one_device([hs, ws, ht, wt, targets, mask, bs, bt])
    for name, x in zip(_TEACHER_NAMES, (ht, wt, bt)):
        if x is not None and x.requires_grad:
            raise ValueError(f"the teacher is frozen but {name} requires grad: pass it "
                             f"detached (x.detach()) or compute it under torch.no_grad()")
    temperature = _validate_temperature(temperature)
    if vocab_size is None:
        if V != Vt:
            raise ValueError(f"student vocabulary ({V} rows) and teacher vocabulary ({Vt} rows) "
                             f"differ: pass vocab_size=<true vocabulary size> so padded rows "
                             f"are excluded")
        vocab_size = V
    vocab_size = int(vocab_size)
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    if vocab_size > V or vocab_size > Vt:
        raise ValueError(f"vocab_size={vocab_size} exceeds the lm_head rows (student V={V}, "
                         f"teacher Vt={Vt})")
    if reduction not in REDUCTIONS:
        raise ValueError(f"unknown reduction {reduction!r}; expected one of {REDUCTIONS}")
    if divergence not in DIVERGENCES:
        raise ValueError(f"unknown divergence {divergence!r}; expected one of {tuple(DIVERGENCES)}")
    beta = float(beta)
    if not (0.0 <= beta <= 1.0):
        raise ValueError(f"beta must lie in [0, 1], got {beta}")
    return temperature, vocab_size, beta


def _validate_student_only(h, w, b, targets, mask, temperature, vocab_size):
    """Validation of the teacher-less op (same rules and messages as `_validate`)."""
    _validate_head(h, w, b, _HEAD_NAMES)
    _validate_tokens(h.shape[0], targets, mask)
    _validate_one_device([h, w, targets, mask, b])
    temperature = _validate_temperature(temperature)
    V = w.shape[0]
    vocab_size = V if vocab_size is None else int(vocab_size)
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    if vocab_size > V:
        raise ValueError(f"vocab_size={vocab_size} exceeds the lm_head rows (V={V})")
    return temperature, vocab_size


def _resolve_divergence(divergence: str, beta: float) -> int:
    # TRL convention: the endpoints of the generalised JSD are the two KLs.
    if divergence == "jsd" and beta == 0.0:
        return DIVERGENCES["forward_kl"]
    if divergence == "jsd" and beta == 1.0:
        return DIVERGENCES["reverse_kl"]
    return DIVERGENCES[divergence]


def _resolve_backend(backend: Optional[str], device: torch.device) -> str:
    backend = backend or os.environ.get("MEMOPD_DISTILL_BACKEND", "auto")
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    if backend == "auto":
        # CUDA without Triton (or ROCm builds without it) still works, on the torch path
        has_triton = importlib.util.find_spec("triton") is not None
        return "triton" if device.type == "cuda" and has_triton else "torch"
    if backend == "triton" and device.type != "cuda" and not _interpreter_ready():
        raise RuntimeError("backend='triton' on CPU tensors needs TRITON_INTERPRET=1 set before "
                           "the kernel module is imported")
    return backend


def _interpreter_ready() -> bool:
    mod = sys.modules.get("memopd.kernels.fused_distill")
    if mod is not None:  # already imported: its mode was fixed at import time
        return bool(getattr(mod, "INTERPRET", False))
    return os.environ.get("TRITON_INTERPRET") == "1"


def _kernels():
    from memopd.kernels import fused_distill as k  # lazy: importing memopd.ops never imports Triton

    return k


def _check_target_range(targets: Tensor, keep: Tensor, vocab_size: int) -> None:
    kept = targets[keep]
    if kept.numel() and (bool((kept < 0).any()) or bool((kept >= vocab_size).any())):
        bad = kept[(kept < 0) | (kept >= vocab_size)][:5].tolist()
        raise ValueError(f"targets out of range [0, {vocab_size}) at kept tokens: {bad} ...")


# ----------------------------------------------------------------------------------
# chunked PyTorch implementation (CPU path, and any device with backend="torch")
# ----------------------------------------------------------------------------------
def _compute_dtype(*tensors: Tensor) -> torch.dtype:
    # fp32 statistics for fp32/bf16/fp16 inputs; float64 inputs keep float64 (PyTorch path).
    return (torch.float64 if any(x is not None and x.dtype == torch.float64 for x in tensors)
            else torch.float32)


class _Workspace:
    """Reusable scratch buffers of one call of the PyTorch path, viewed as [r, c] blocks.

    A fresh multi-MiB tensor is a fresh mapping whose pages the kernel zero-fills on
    first touch (~0.1 ms per 4 MiB on CPU: as much as the elementwise work on it), so
    each named buffer is allocated once, at the largest block shape, and every chunk
    uses a contiguous [r, c] prefix of it.
    """

    def __init__(self, rows: int, cols: int, device, dtype):
        self.numel = rows * cols
        self.f = dict(device=device, dtype=dtype)
        self.bufs: dict = {}

    def __call__(self, name: str, r: int, c: int) -> Tensor:
        buf = self.bufs.get(name)
        if buf is None:
            buf = self.bufs[name] = torch.empty(self.numel, **self.f)
        return buf[: r * c].view(r, c)


def _logits(h: Tensor, wc: Tensor, b: Optional[Tensor], v0: int, v1: int, inv_t: float,
            out: Tensor) -> Tensor:
    """Logits / T of one vocabulary chunk into `out`, in h's dtype (fp32 / fp64).

    `h` is already multiplied by 1/T (once per token block) and `wc` is the chunk's
    weight rows already in h's dtype, so only the bias is scaled here.
    """
    if b is None:
        return torch.mm(h, wc.t(), out=out)
    return torch.addmm(b[v0:v1].to(h.dtype) * inv_t, h, wc.t(), out=out)


def _weight_chunk(w: Tensor, v0: int, v1: int, dtype: torch.dtype) -> Tensor:
    wc = w[v0:v1]
    return wc if wc.dtype == dtype else wc.to(dtype)  # bf16 @ bf16 on CPU would round to bf16


def _centre2(x: Tensor, m: Tensor) -> Tensor:
    """In place: x <- (x - m)·log2(e), one pass; then exp2(x) = e^{x - m}.

    exp2 is ~3x cheaper than exp on CPU, and the centring pass is needed anyway.
    """
    return torch.add((-_LOG2E * m)[:, None], x, alpha=_LOG2E, out=x)


def _rowdot(a: Tensor, b: Tensor, tmp: Tensor) -> Tensor:
    """Σ_v a[i, v] b[i, v], through the scratch block `tmp` (vecdot/einsum would allocate
    a fresh [rows, chunk] product, or run as a slow batched matmul)."""
    return torch.mul(a, b, out=tmp).sum(1)


_SQRT_E = math.exp(0.5)
_LOG2E = 1.0 / math.log(2.0)
_LN2 = math.log(2.0)
_CLOSE_KL = 1e-2  # full-row mode: rows whose plain KL estimate is below this get the precise dlse
_JSD_CAP = 80.0  # -δ clamp of the JSD's expm1 (weights there are < e^-80: no effect, no overflow)


def _any(flags: Tensor) -> bool:
    """bool(flags.any()) on CPU; True elsewhere (a data-dependent skip would sync the device)."""
    return flags.device.type != "cpu" or bool(flags.any())


def _jsd_negw(neg_delta: Tensor, beta: float) -> Tensor:
    """In place: -δ -> -(δ - u(δ)) = log1p(β expm1(-δ)), u = log(β + (1-β) e^δ) = log M - log q.

    δ - u = -log(β e^{-δ} + 1 - β) exactly; the log1p/expm1 form keeps relative precision
    where δ is tiny (p ≈ q) and cannot overflow (-δ is capped at 80, where the entry's
    weight p = q e^{δ} < e^-80 q makes the cap invisible).
    """
    return neg_delta.clamp_max_(_JSD_CAP).expm1_().mul_(beta).log1p_()


def _precise_dlse(d: Tensor, es: Tensor, et: Tensor, m_s: Tensor, m_t: Tensor,
                  tmp: Optional[Tensor] = None):
    """The difference of the two normalisers at a joint max, with relative precision.

    With es = e^{s - m_s}, et = e^{t - m_t}, d = s - t, M = max(m_s, m_t),
    c_S = e^{m_s - M}, c_T = e^{m_t - M}, returns (small, big) such that

        Σ_v (e^{s_v - M} - e^{t_v - M}) = c_T·small + c_S·big,
        small = Σ_v et_v expm1(min(d_v, 1/2)),  big = Σ_v relu(es_v - e^{m_t - m_s} √e et_v)

    exactly (the relu is non-zero iff d_v > 1/2, where it restores the clamped part), with
    no overflow and full relative precision where d is small. `big` is None when no
    d_v exceeds 1/2 (then it is 0 and its three passes are skipped). Works in the scratch
    block `tmp`, or without one in place (consuming `d`, and `es` when `big` is computed).
    """
    big = None
    if _any(d.amax(1) > 0.5):
        k = (torch.exp(m_t - m_s) * _SQRT_E).clamp_max(1e30)[:, None]
        big = (es.addcmul_(k, et, value=-1.0) if tmp is None else
               torch.addcmul(es, k, et, value=-1.0, out=tmp)).relu_().sum(1)
    em1 = d.clamp_max_(0.5) if tmp is None else torch.clamp_max(d, 0.5, out=tmp)
    small = em1.expm1_().mul_(et).sum(1)
    return small, big


def _torch_forward_rows(hs_t, ws, bs, ht_t, wt, bt, y, inv_t, V, div_code, beta, vchunk, wk):
    """Per-token outputs and stats of one token block (hidden rows already times 1/T).

    One vocabulary chunk covering the row (`vchunk >= V`) takes the full-row route: exact
    row maxima, one exp2 pass per distribution, the precise normaliser difference only on
    rows whose plain KL estimate is small, and the JSD without a second matmul pass.
    Otherwise the vocabulary is walked in chunks with online statistics. `wk` holds the
    [rows, chunk] scratch blocks.

    `ht_t is None` is the teacher-less mode: only the student sums (max, sum-exp, entropy
    sum, target logit) are kept, no teacher logits are ever computed, and the divergence
    and the teacher rows of the stats are zero.
    """
    if vchunk >= V:
        return _forward_full_rows(hs_t, ws, bs, ht_t, wt, bt, y, inv_t, V, div_code, beta, wk)
    return _forward_chunked(hs_t, ws, bs, ht_t, wt, bt, y, inv_t, V, div_code, beta, vchunk, wk)


def _student_outputs(m_s, z_s, a_s, s_y):
    """log z_s, lse_s, entropy and log-prob from the student sums: max m_s, target logit
    s_y, z_s = Σ e^{s - m_s} and a_s = Σ e^{s - m_s} (s - m_s)·log2(e)."""
    log_zs = torch.log(z_s)
    lse_s = m_s + log_zs
    ent = log_zs - a_s * _LN2 / z_s
    lp = s_y - lse_s
    return log_zs, lse_s, ent, lp


def _log1p_ratio(d, es, et, m_s, m_t, z_t, plain, tmp=None):
    """lse_s - lse_t = log1p(Σ (e^{s-M} - e^{t-M}) / Σ e^{t-M}) per row (see
    `_precise_dlse`); `plain` where the ratio is not small (or not finite)."""
    small, big = _precise_dlse(d, es, et, m_s, m_t, tmp)
    m_j = torch.maximum(m_s, m_t)
    c_t = torch.exp(m_t - m_j)
    num = c_t * small
    if big is not None:
        num = num + torch.exp(m_s - m_j) * big
    ratio = num / (c_t * z_t)
    near = ratio.abs() < 0.5  # False for NaN/inf (teacher mass underflowed at the joint max)
    return torch.where(near, torch.log1p(torch.where(near, ratio, 0.0)), plain)


def _full_logits(h: Tensor, w: Tensor, b: Optional[Tensor], V: int, inv_t: float,
                 out: Tensor) -> Tensor:
    """Logits / T of whole vocabulary rows into `out` [rows, V]; a half-precision weight is
    converted (and multiplied) in slices of _TORCH_CONVERT_ROWS rows, never whole."""
    if w.dtype == h.dtype:
        return _logits(h, w[:V], b, 0, V, inv_t, out)
    for v0 in range(0, V, _TORCH_CONVERT_ROWS):
        v1 = min(V, v0 + _TORCH_CONVERT_ROWS)
        _logits(h, w[v0:v1].to(h.dtype), b, v0, v1, inv_t, out[:, v0:v1])
    return out


def _forward_full_rows(hs_t, ws, bs, ht_t, wt, bt, y, inv_t, V, div_code, beta, wk):
    n = hs_t.shape[0]
    f = dict(device=hs_t.device, dtype=hs_t.dtype)
    s = _full_logits(hs_t, ws, bs, V, inv_t, wk("s", n, V))
    s_y = s.gather(1, y[:, None])[:, 0]
    m_s = s.amax(1)
    if ht_t is not None:
        t = _full_logits(ht_t, wt, bt, V, inv_t, wk("t", n, V))
        m_t = t.amax(1)
        d = torch.sub(s, t, out=wk("d", n, V))  # before centring: exact where s ≈ t
    s2 = _centre2(s, m_s)
    es = torch.exp2(s2, out=wk("e", n, V))
    z_s = es.sum(1)
    log_zs, lse_s, ent, lp = _student_outputs(m_s, z_s, s2.mul_(es).sum(1), s_y)
    if ht_t is None:
        zero = torch.zeros(n, **f)
        return zero, lp, ent, torch.stack([lse_s, zero, zero, zero, ent])
    tmp = s  # free from here on
    et = _centre2(t, m_t).exp2_()
    z_t = et.sum(1)
    log_zt = torch.log(z_t)
    lse_t = m_t + log_zt
    plain = (m_s - m_t) + (log_zs - log_zt)  # lse_s - lse_t
    e_pd = _rowdot(es, d, tmp) / z_s if div_code == 0 else None  # E_p[s - t]
    e_qd = _rowdot(et, d, tmp) / z_t if div_code != 0 else None  # E_q[s - t]
    # the precise lse_s - lse_t (log1p of the relative normaliser difference) only on rows
    # where p ≈ q, i.e. whose plain KL estimate is small (elsewhere plain is exact enough)
    close = ((e_pd - plain) if div_code == 0 else (plain - e_qd)) < _CLOSE_KL
    n_close = int(close.sum()) if close.device.type == "cpu" else n
    dlse = plain
    if 2 * n_close > n:  # mostly close (typical of distillation): whole block, no gathering
        dlse = torch.where(close, _log1p_ratio(d, es, et, m_s, m_t, z_t, plain, tmp), plain)
    elif n_close:  # a few close rows: only those (copies, consumed in place)
        idx = close.nonzero().squeeze(1)
        sub = [x.index_select(0, idx) for x in (d, es, et, m_s, m_t, z_t, plain)]
        dlse = plain.index_copy(0, idx, _log1p_ratio(*sub))
    if div_code == 0:
        aux = e_pd - dlse
        div = aux.clamp_min(0.0)
    elif div_code == 1:
        aux = dlse - e_qd
        div = aux.clamp_min(0.0)
    else:
        # JSD on the resident block: -δ = dlse - (s - t), KL(p‖M) = Σ p w, KL(q‖M) = Σ q (w - δ)
        negw = _jsd_negw(torch.sub(dlse[:, None], d, out=d), beta)
        kl_pm = -_rowdot(es, negw, tmp) / z_s
        kl_qm = (dlse - e_qd) - et.mul_(negw).sum(1) / z_t
        aux = kl_pm
        div = (beta * kl_qm + (1.0 - beta) * kl_pm).clamp_min(0.0)
    return div, lp, ent, torch.stack([lse_s, lse_t, dlse, aux, ent])


def _forward_chunked(hs_t, ws, bs, ht_t, wt, bt, y, inv_t, V, div_code, beta, vchunk, wk):
    """Online statistics over vocabulary chunks (running maxima, rescaled sums)."""
    n = hs_t.shape[0]
    has_teacher = ht_t is not None
    cdt = hs_t.dtype
    f = dict(device=hs_t.device, dtype=cdt)
    m_s = torch.full((n,), _NEG, **f)
    z_s = torch.zeros(n, **f)
    a_s = torch.zeros(n, **f)
    s_y = torch.zeros(n, **f)
    if has_teacher:
        m_t = torch.full((n,), _NEG, **f)
        z_t = torch.zeros(n, **f)
        e_d = torch.zeros(n, **f)
        m_j = torch.full((n,), _NEG, **f)
        zt_j = torch.zeros(n, **f)
        dz_j = torch.zeros(n, **f)
    for v0 in range(0, V, vchunk):
        v1 = min(V, v0 + vchunk)
        c = v1 - v0
        s = _logits(hs_t, _weight_chunk(ws, v0, v1, cdt), bs, v0, v1, inv_t, wk("s", n, c))
        in_c = (y >= v0) & (y < v1)
        s_y += torch.where(in_c, s.gather(1, (y - v0).clamp(0, c - 1)[:, None])[:, 0], 0.0)
        m_s_new = torch.maximum(m_s, s.amax(1))
        alpha_s = torch.exp(m_s - m_s_new)
        if has_teacher:
            t = _logits(ht_t, _weight_chunk(wt, v0, v1, cdt), bt, v0, v1, inv_t, wk("t", n, c))
            m_t_new = torch.maximum(m_t, t.amax(1))
            alpha_t = torch.exp(m_t - m_t_new)
            d = torch.sub(s, t, out=wk("d", n, c))  # before centring: exact where s ≈ t
        s2 = _centre2(s, m_s_new)
        es = torch.exp2(s2, out=wk("e", n, c))
        es_sum = es.sum(1)
        a_s = alpha_s * (a_s + (m_s - m_s_new) * _LOG2E * z_s) + s2.mul_(es).sum(1)
        z_s = alpha_s * z_s + es_sum
        if not has_teacher:
            m_s = m_s_new
            continue
        tmp = s  # free from here on
        et = _centre2(t, m_t_new).exp2_()
        et_sum = et.sum(1)
        z_t = alpha_t * z_t + et_sum
        if div_code == 0:
            e_d = alpha_s * e_d + _rowdot(es, d, tmp)
        elif div_code == 1:
            e_d = alpha_t * e_d + _rowdot(et, d, tmp)
        m_j_new = torch.maximum(m_s_new, m_t_new)
        r_j = torch.exp(m_j - m_j_new)
        c_t = torch.exp(m_t_new - m_j_new)
        small, big = _precise_dlse(d, es, et, m_s_new, m_t_new)
        zt_j = r_j * zt_j + c_t * et_sum
        dz_j = r_j * dz_j + c_t * small
        if big is not None:
            dz_j += torch.exp(m_s_new - m_j_new) * big
        m_s, m_t, m_j = m_s_new, m_t_new, m_j_new
    log_zs, lse_s, ent, lp = _student_outputs(m_s, z_s, a_s, s_y)
    if not has_teacher:
        zero = torch.zeros(n, **f)
        return zero, lp, ent, torch.stack([lse_s, zero, zero, zero, ent])
    log_zt = torch.log(z_t)
    lse_t = m_t + log_zt
    plain = (m_s - m_t) + (log_zs - log_zt)
    ratio = dz_j / zt_j
    near = ratio.abs() < 0.5  # False for NaN/inf (teacher mass underflowed at the joint max)
    dlse = torch.where(near, torch.log1p(torch.where(near, ratio, 0.0)), plain)
    if div_code == 0:
        aux = e_d / z_s - dlse
        div = aux.clamp_min(0.0)
    elif div_code == 1:
        aux = dlse - e_d / z_t
        div = aux.clamp_min(0.0)
    else:
        # JSD: second pass with normalised log-probs, KL(p‖M) and KL(q‖M) per token
        kl_pm = torch.zeros(n, **f)
        kl_qm = torch.zeros(n, **f)
        for v0 in range(0, V, vchunk):
            v1 = min(V, v0 + vchunk)
            c = v1 - v0
            s = _logits(hs_t, _weight_chunk(ws, v0, v1, cdt), bs, v0, v1, inv_t, wk("s", n, c))
            t = _logits(ht_t, _weight_chunk(wt, v0, v1, cdt), bt, v0, v1, inv_t, wk("t", n, c))
            nd = torch.sub(s, t, out=wk("d", n, c))
            nd = torch.sub(dlse[:, None], nd, out=nd)  # -δ = log q - log p
            p = _centre2(s, lse_s).exp2_()
            q = _centre2(t, lse_t).exp2_()
            tmp = wk("e", n, c)
            kl_qm += _rowdot(q, nd, tmp)
            negw = _jsd_negw(nd, beta)
            kl_pm -= _rowdot(p, negw, tmp)
            kl_qm -= q.mul_(negw).sum(1)
        aux = kl_pm
        div = (beta * kl_qm + (1.0 - beta) * kl_pm).clamp_min(0.0)
    return div, lp, ent, torch.stack([lse_s, lse_t, dlse, aux, ent])


def _finalize_student(m_s, z_s, a_s, s_y):
    """Per-token lse_s, entropy and log-prob from the student's online sums."""
    lse_s = m_s + torch.log(z_s)
    ent = torch.log(z_s) - a_s / z_s
    lp = s_y - lse_s
    return lse_s, ent, lp


def _finalize(m_s, z_s, a_s, m_t, z_t, m_j, zt_j, dz_j, s_y):
    """Per-token lse_s, lse_t, precise lse_s - lse_t, entropy and log-prob from the sums."""
    lse_s, ent, lp = _finalize_student(m_s, z_s, a_s, s_y)
    lse_t = m_t + torch.log(z_t)
    ratio = dz_j / zt_j
    near = ratio.abs() < 0.5  # False for NaN/inf (teacher mass underflowed at the joint max)
    dlse = torch.where(near, torch.log1p(torch.where(near, ratio, 0.0)), lse_s - lse_t)
    return lse_s, lse_t, dlse, ent, lp


def _triton_forward(hs, ws, bs, ht, wt, bt, targets, keep, temperature, V, div_code, beta):
    """Triton kernels for the statistics, the same finalisation as the PyTorch path."""
    k = _kernels()
    st = k.distill_forward(hs, ws, bs, ht, wt, bt, targets, keep, temperature, V, div_code)
    m_s, z_s, a_s, m_t, z_t, e_d, m_j, zt_j, dz_j, s_y = st.unbind(0)
    zero = torch.zeros((), device=hs.device, dtype=torch.float32)
    if ht is None:
        # teacher-less kernel: the teacher rows of `st` were never written
        lse_s, ent, lp = _finalize_student(m_s, z_s, a_s, s_y)
        zeros = torch.zeros_like(lse_s)
        stats = torch.where(keep, torch.stack([lse_s, zeros, zeros, zeros, ent]), zero)
        return zeros, torch.where(keep, lp, zero), torch.where(keep, ent, zero), stats
    lse_s, lse_t, dlse, ent, lp = _finalize(m_s, z_s, a_s, m_t, z_t, m_j, zt_j, dz_j, s_y)
    if div_code == 0:
        aux = e_d / z_s - dlse
        div = aux.clamp_min(0.0)
    elif div_code == 1:
        aux = dlse - e_d / z_t
        div = aux.clamp_min(0.0)
    else:
        kl = k.jsd_second_pass(hs, ws, bs, ht, wt, bt, keep,
                               torch.stack([lse_s, lse_t, dlse]).contiguous(), temperature, V, beta)
        aux = kl[0]
        div = (beta * kl[1] + (1.0 - beta) * kl[0]).clamp_min(0.0)
    # masked rows hold untouched sums (log 0 = -inf there): zero them, outputs and stats alike
    stats = torch.where(keep, torch.stack([lse_s, lse_t, dlse, aux, ent]), zero)
    return (torch.where(keep, div, zero), torch.where(keep, lp, zero), torch.where(keep, ent, zero),
            stats)


def _block_plan(n_rows: int, V: int, chunk_size: int, token_chunk: int,
                full_rows: bool) -> tuple[int, int]:
    """(rows per token block, vocabulary columns per chunk) of the PyTorch path.

    Default: token blocks of at most _TORCH_TOKEN_CHUNK rows (split evenly) and chunks of
    about _TORCH_TILE_ELEMS elements per [rows, chunk] piece; explicit `token_chunk_size`
    / `chunk_size` take precedence. `full_rows` (the JSD forward with an automatic
    `chunk_size`): whole vocabulary rows, blocks of about _TORCH_ROW_ELEMS elements.
    """
    if full_rows:
        rows = token_chunk if token_chunk > 0 else max(_TORCH_MIN_ROWS, _TORCH_ROW_ELEMS // V)
        return max(1, min(rows, n_rows)), V
    if token_chunk > 0:
        rows = token_chunk
    else:
        n_blocks = -(-n_rows // _TORCH_TOKEN_CHUNK)
        rows = -(-n_rows // n_blocks)
    rows = max(1, min(rows, n_rows))
    if chunk_size > 0:
        return rows, chunk_size
    c = max(128, _TORCH_TILE_ELEMS // rows)
    return rows, min(V, (c // 64) * 64)


def _torch_forward(hs, ws, bs, ht, wt, bt, targets, keep, temperature, V, div_code, beta,
                   chunk_size, token_chunk):
    N = hs.shape[0]
    cdt = _compute_dtype(hs, ht)
    f = dict(device=hs.device, dtype=cdt)
    div = torch.zeros(N, **f)
    lp = torch.zeros(N, **f)
    ent = torch.zeros(N, **f)
    stats = torch.zeros(NUM_STATS, N, **f)
    kept = keep.nonzero().squeeze(1)  # the CPU path may sync: masked rows never reach a matmul
    n_kept = kept.numel()
    if n_kept == 0:
        return div, lp, ent, stats
    # the JSD needs normalised distributions: with whole rows resident it is one matmul pass
    full_rows = ht is not None and div_code == 2 and not (chunk_size and chunk_size > 0)
    rows_per_block, vchunk = _block_plan(n_kept, V, int(chunk_size or 0), int(token_chunk or 0),
                                         full_rows)
    inv_t = 1.0 / temperature
    wk = _Workspace(rows_per_block, vchunk, hs.device, cdt)
    for r0 in range(0, n_kept, rows_per_block):
        rows = kept[r0:r0 + rows_per_block]
        hs_t = hs.index_select(0, rows).to(cdt).mul_(inv_t)
        ht_t = None if ht is None else ht.index_select(0, rows).to(cdt).mul_(inv_t)
        y = targets.index_select(0, rows).long()
        d_, l_, e_, st_ = _torch_forward_rows(hs_t, ws, bs, ht_t, wt, bt, y, inv_t, V, div_code,
                                              beta, vchunk, wk)
        div.index_copy_(0, rows, d_)
        lp.index_copy_(0, rows, l_)
        ent.index_copy_(0, rows, e_)
        stats.index_copy_(1, rows, st_)
    return div, lp, ent, stats


def _torch_backward(g_div, g_lp, g_ent, hs, ws, bs, ht, wt, bt, targets, keep, stats,
                    temperature, V, div_code, beta, need_dh, need_dw, need_db, chunk_size,
                    token_chunk):
    """Recompute the chunks and reduce dL/ds (s = logits / T) into dH, dW, db.

    Each recomputed student chunk is centred on the saved log-sum-exp in base 2 in one
    pass, ls2 = log2 p = (s - lse_s)·log2(e), so p = exp2(ls2). Per token, with
    δ = log p - log q = (s - t) - dlse (s - t straight from the two logit chunks, exact
    where p ≈ q; dlse the forward's precise lse_s - lse_t):
      log-prob:  g_lp (1[v=y] - p)
      entropy:   -g_H p (ls + H)
      reverse:   g_kl p (δ - KL)
      forward:   g_kl (p - q) = -g_kl (p expm1(min(-δ, 1/2)) + relu(q - √e p))   (exact,
                 relative precision where q ≈ p, no overflow)
      JSD:       (1-β) g_kl p ((δ - u(δ)) - KL(p‖M)),  δ - u = -log1p(β expm1(-δ))
    so dL/ds = p ⊙ (A + B·ls2 + D·X) (+ the forward-KL relu term and the one-hot) with
    per-token A, B, D and one divergence tensor X per chunk (s - t, or a function of -δ):
    a handful of [rows, chunk] passes and one exp2 (two for the forward KL). Working with
    s - t and centred logits rather than raw logits keeps the O(|s|) parts from
    cancelling for the dominant tokens. Hidden rows are pre-multiplied by 1/T, so
    dW = (dL/ds)^T (h/T) needs no extra scaling and dH, db get one 1/T at the end.
    """
    N, Hs = hs.shape
    dev = hs.device
    cdt = _compute_dtype(hs, ht)
    f = dict(device=dev, dtype=cdt)
    dh = torch.zeros_like(hs) if need_dh else None
    dw32 = torch.zeros(ws.shape, **f) if need_dw else None
    db32 = torch.zeros(ws.shape[0], **f) if need_db else None
    kept = keep.nonzero().squeeze(1)
    n_kept = kept.numel()
    if n_kept > 0 and (g_div is not None or g_lp is not None or g_ent is not None):
        rows_per_block, vchunk = _block_plan(n_kept, V, int(chunk_size or 0),
                                             int(token_chunk or 0), False)
        inv_t = 1.0 / temperature
        wk = _Workspace(rows_per_block, vchunk, dev, cdt)
        for r0 in range(0, n_kept, rows_per_block):
            rows = kept[r0:r0 + rows_per_block]
            n = rows.numel()
            hs_t = hs.index_select(0, rows).to(cdt).mul_(inv_t)
            ht_t = ht.index_select(0, rows).to(cdt).mul_(inv_t) if g_div is not None else None
            y = targets.index_select(0, rows).long()
            st = stats.index_select(1, rows).to(cdt)
            lse_s, lse_t, dlse, aux, ent = st[0], st[1], st[2], st[3], st[4]
            # per-token coefficients of dL/ds = p ⊙ (A + B ls2 + D X) + g_lp 1[v=y] (+ relu)
            A = torch.zeros(n, **f)
            B = D = glp = None
            if g_lp is not None:
                glp = g_lp.index_select(0, rows).to(cdt)
                A -= glp
            if g_ent is not None:
                gh = g_ent.index_select(0, rows).to(cdt)
                A -= gh * ent
                B = (-_LN2 * gh)[:, None]  # -g_H ls = -g_H ln2 ls2
            if g_div is not None:
                gd = g_div.index_select(0, rows).to(cdt)
                if div_code == 0:  # X = s - t:  g_kl p (X - dlse - KL)
                    A -= gd * (dlse + aux)
                    D = gd[:, None]
                elif div_code == 1:  # X = expm1(min(-δ, 1/2))
                    D = (-gd)[:, None]
                else:  # X = -(δ - u)
                    A -= (1.0 - beta) * gd * aux
                    D = (-(1.0 - beta) * gd)[:, None]
            A = A[:, None]
            dh32 = torch.zeros(n, Hs, **f) if need_dh else None
            for v0 in range(0, V, vchunk):
                v1 = min(V, v0 + vchunk)
                c = v1 - v0
                wc = _weight_chunk(ws, v0, v1, cdt)
                s = _logits(hs_t, wc, bs, v0, v1, inv_t, wk("s", n, c))
                X = q = None
                if D is not None:
                    t = _logits(ht_t, _weight_chunk(wt, v0, v1, cdt), bt, v0, v1, inv_t,
                                wk("t", n, c))
                    X = torch.sub(s, t, out=wk("d", n, c))
                    if div_code != 0:
                        X = torch.sub(dlse[:, None], X, out=X)  # -δ
                    if div_code == 2:
                        X = _jsd_negw(X, beta)
                    elif div_code == 1:
                        if _any(X.amax(1) > 0.5):  # some q > √e p: the relu term is needed
                            q = _centre2(t, lse_t).exp2_()
                        X = X.clamp_max_(0.5).expm1_()
                ls2 = _centre2(s, lse_s)  # log2 p
                if X is not None:
                    ds = torch.addcmul(A, D, X, out=X)
                    if B is not None:
                        ds.addcmul_(B, ls2)
                elif B is not None:
                    ds = torch.addcmul(A, B, ls2, out=wk("d", n, c))
                else:
                    ds = None
                p = ls2.exp2_()
                if ds is None:
                    ds = p.mul_(A)  # log-prob gradient only: -g_lp p
                else:
                    ds.mul_(p)
                    if q is not None:
                        ds.addcmul_(D, q.add_(p, alpha=-_SQRT_E).relu_())
                del s, ls2, p, X, q
                if glp is not None:
                    in_c = (y >= v0) & (y < v1)
                    col = (y - v0).clamp(0, c - 1)[:, None]
                    ds.scatter_add_(1, col, torch.where(in_c, glp, 0.0)[:, None])
                if need_dh:
                    dh32.addmm_(ds, wc)
                if need_dw:
                    dw32[v0:v1].addmm_(ds.t(), hs_t)
                if need_db:
                    db32[v0:v1] += ds.sum(0)
                del ds, wc
            if need_dh:
                dh.index_copy_(0, rows, dh32.mul_(inv_t).to(dh.dtype))
        if need_db:
            db32.mul_(inv_t)
    dw = None if dw32 is None else (dw32 if ws.dtype == cdt else dw32.to(ws.dtype))
    db = None if db32 is None else (db32 if bs.dtype == cdt else db32.to(bs.dtype))
    return dh, dw, db


# ----------------------------------------------------------------------------------
# custom ops + autograd
# ----------------------------------------------------------------------------------
@torch.library.custom_op("memopd::fused_distill_fwd", mutates_args=())
def _fwd_op(hs: Tensor, ws: Tensor, bs: Optional[Tensor], ht: Optional[Tensor],
            wt: Optional[Tensor], bt: Optional[Tensor], targets: Tensor, keep: Tensor,
            temperature: float, vocab_size: int, divergence: int, beta: float,
            chunk_size: int, token_chunk: int, backend: str,
            check_targets: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    if check_targets:
        _check_target_range(targets, keep, vocab_size)
    if backend == "triton":
        return _triton_forward(hs, ws, bs, ht, wt, bt, targets, keep, temperature, vocab_size,
                               divergence, beta)
    return _torch_forward(hs, ws, bs, ht, wt, bt, targets, keep, temperature, vocab_size,
                          divergence, beta, chunk_size, token_chunk)


@_fwd_op.register_fake
def _fwd_fake(hs, ws, bs, ht, wt, bt, targets, keep, temperature, vocab_size, divergence, beta,
              chunk_size, token_chunk, backend, check_targets):
    N = hs.shape[0]
    cdt = _compute_dtype(hs, ht)
    vec = hs.new_empty((N,), dtype=cdt)
    return vec, torch.empty_like(vec), torch.empty_like(vec), hs.new_empty((NUM_STATS, N), dtype=cdt)


@torch.library.custom_op("memopd::fused_distill_bwd", mutates_args=())
def _bwd_op(g_div: Optional[Tensor], g_lp: Optional[Tensor], g_ent: Optional[Tensor],
            hs: Tensor, ws: Tensor, bs: Optional[Tensor], ht: Optional[Tensor],
            wt: Optional[Tensor], bt: Optional[Tensor], targets: Tensor, keep: Tensor,
            stats: Tensor, temperature: float, vocab_size: int, divergence: int, beta: float,
            need_dh: bool, need_dw: bool, need_db: bool, chunk_size: int, token_chunk: int,
            backend: str) -> tuple[Tensor, Tensor, Tensor]:
    cdt = stats.dtype
    if ht is None:
        # teacher-less: the wrapper drops the (zero) divergence output, but under
        # torch.compile its gradient may still arrive materialised as zeros: ignore it
        g_div = None
    g_div = None if g_div is None else g_div.to(cdt).contiguous()
    g_lp = None if g_lp is None else g_lp.to(cdt).contiguous()
    g_ent = None if g_ent is None else g_ent.to(cdt).contiguous()
    if backend == "triton":
        dh, dw, db = _kernels().distill_backward(
            g_div, g_lp, g_ent, hs, ws, bs, ht, wt, bt, targets, keep, stats, temperature,
            vocab_size, divergence, beta, need_dh, need_dw, need_db, token_chunk)
    else:
        dh, dw, db = _torch_backward(
            g_div, g_lp, g_ent, hs, ws, bs, ht, wt, bt, targets, keep, stats, temperature,
            vocab_size, divergence, beta, need_dh, need_dw, need_db, chunk_size, token_chunk)
    empty = hs.new_empty((0,))
    return (dh if dh is not None else empty, dw if dw is not None else empty,
            db if db is not None else empty)


@_bwd_op.register_fake
def _bwd_fake(g_div, g_lp, g_ent, hs, ws, bs, ht, wt, bt, targets, keep, stats, temperature,
              vocab_size, divergence, beta, need_dh, need_dw, need_db, chunk_size, token_chunk,
              backend):
    empty = hs.new_empty((0,))
    return (torch.empty_like(hs) if need_dh else empty,
            torch.empty_like(ws) if need_dw else empty,
            torch.empty_like(bs) if (need_db and bs is not None) else empty)


_SCALARS = ("temperature", "vocab_size", "divergence", "beta", "chunk_size", "token_chunk",
            "backend")


def _setup_context(ctx, inputs, output):
    (hs, ws, bs, ht, wt, bt, targets, keep, temperature, vocab_size, divergence, beta,
     chunk_size, token_chunk, backend, _check) = inputs
    # Unused outputs give None grads: a backward for log-probs / entropy alone then
    # skips every teacher matmul.
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(hs, ws, bs, ht, wt, bt, targets, keep, output[3])
    ctx.scalars = (temperature, vocab_size, divergence, beta, chunk_size, token_chunk, backend)


def _backward(ctx, g_div, g_lp, g_ent, _g_stats):
    hs, ws, bs, ht, wt, bt, targets, keep, stats = ctx.saved_tensors
    temperature, vocab_size, divergence, beta, chunk_size, token_chunk, backend = ctx.scalars
    for name, w, h in (("student", ws, hs), ("teacher", wt, ht)):
        if w is None:  # teacher-less op
            continue
        if w.dim() != 2 or w.shape[0] < vocab_size or w.shape[1] != h.shape[1]:
            raise RuntimeError(
                f"the {name} lm_head weight changed shape between forward and backward "
                f"(now {tuple(w.shape)}): a ZeRO-3/FSDP parameter was re-partitioned. Keep "
                f"it gathered until the backward has run (see docs/deepspeed.md §4)")
    need_dh, need_dw, need_db = ctx.needs_input_grad[:3]
    need_db = bool(need_db and bs is not None)
    if not (need_dh or need_dw or need_db):
        return (None,) * 16
    dh, dw, db = _bwd_op(g_div, g_lp, g_ent, hs, ws, bs, ht, wt, bt, targets, keep, stats,
                         temperature, vocab_size, divergence, beta, need_dh, need_dw, need_db,
                         chunk_size, token_chunk, backend)
    return (dh if need_dh else None, dw if need_dw else None, db if need_db else None) + (None,) * 13


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------------
def _reduce(div: Tensor, keep: Tensor, reduction: str) -> Tensor:
    if reduction == "mean":
        # device-side count: no host sync; an all-masked batch gives 0 / 1 = 0
        return div.sum() / keep.sum().clamp_min(1).to(div.dtype)
    if reduction == "sum":
        return div.sum()
    return div


def _keep_mask(targets: Tensor, mask: Optional[Tensor], ignore_index: Optional[int]) -> Tensor:
    keep = torch.ones_like(targets, dtype=torch.bool) if mask is None else mask.to(torch.bool)
    if ignore_index is not None:
        keep = keep & (targets != ignore_index)
    return keep


def _dispatch(backend: Optional[str], device: torch.device, check_targets: Optional[bool],
              *dtypes: torch.dtype) -> tuple[str, bool]:
    """Back end (validated) and whether to check the target range, for one call."""
    be = _resolve_backend(backend, device)
    if be == "triton" and torch.float64 in dtypes:
        raise TypeError("the Triton path supports float32/bfloat16/float16 inputs; use "
                        "backend='torch' for float64")
    if check_targets is None:
        check_targets = device.type == "cpu" or os.environ.get("MEMOPD_DEBUG_CHECKS") == "1"
    return be, bool(check_targets)


def fused_linear_distill(
    student_hidden: Tensor,
    student_weight: Tensor,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    targets: Tensor,
    *,
    mask: Optional[Tensor] = None,
    temperature: float = 1.0,
    student_bias: Optional[Tensor] = None,
    teacher_bias: Optional[Tensor] = None,
    vocab_size: Optional[int] = None,
    chunk_size: Optional[int] = None,
    token_chunk_size: Optional[int] = None,
    reduction: str = "mean",
    divergence: str = "reverse_kl",
    beta: float = 0.5,
    ignore_index: Optional[int] = -100,
    backend: Optional[str] = None,
    check_targets: Optional[bool] = None,
) -> DistillOutput:
    """Fused lm_head + divergence + student log-prob + entropy, without [N, V] logits.

    Args:
        student_hidden: [N, Hs] last hidden states of the student (requires grad as needed).
        student_weight: [V, Hs] student lm_head weight. student_bias: optional [V].
        teacher_hidden: [N, Ht], teacher_weight: [Vt, Ht], teacher_bias: optional [Vt];
            frozen (must not require grad).
        targets: [N] integer ids of the sampled tokens (ignored where masked).
        mask: optional [N] bool, True = token contributes. Targets equal to
            `ignore_index` are masked too (set ignore_index=None to disable).
        temperature: > 0, divides both student and teacher logits.
        vocab_size: true vocabulary (<= V and <= Vt); required when V != Vt.
        chunk_size: vocabulary columns per chunk of the PyTorch path (auto if None; an
            explicit value < vocab_size also makes the JSD forward walk chunks, in two
            matmul passes, instead of whole rows). The Triton kernels pick their own tiles.
        token_chunk_size: kept tokens per block (PyTorch path) / rows of the backward
            dlogits scratch (Triton path); auto if None.
        reduction: "mean" (over kept tokens), "sum" or "none" (loss = per-token kl).
        divergence: "reverse_kl" (KL(p_s‖p_t)), "forward_kl" (KL(p_t‖p_s)) or "jsd"
            (TRL/GKD generalised JSD with mixture β·p_t + (1-β)·p_s).
        beta: JSD β in [0, 1]; 0 → forward KL, 1 → reverse KL (as in TRL).
        backend: "auto" (by device), "torch" or "triton" (see module docstring).
        check_targets: check 0 <= target < vocab_size on kept tokens. Default: on for
            CPU tensors, on for CUDA only with MEMOPD_DEBUG_CHECKS=1 (it syncs).

    Returns:
        DistillOutput(loss, kl, logprobs, entropy); per-token tensors are fp32 [N].
    """
    temperature, vocab_size, beta = _validate(
        student_hidden, student_weight, teacher_hidden, teacher_weight, targets, mask,
        student_bias, teacher_bias, temperature, vocab_size, reduction, divergence, beta)
    div_code = _resolve_divergence(divergence, beta)
    be, check_targets = _dispatch(backend, student_hidden.device, check_targets,
                                  student_hidden.dtype, teacher_hidden.dtype)
    keep = _keep_mask(targets, mask, ignore_index)
    hs = student_hidden.contiguous()
    ws = student_weight.contiguous()
    ht = teacher_hidden.contiguous()
    wt = teacher_weight.contiguous()
    bs = None if student_bias is None else student_bias.contiguous()
    bt = None if teacher_bias is None else teacher_bias.contiguous()
    div, lp, ent, _stats = _fwd_op(
        hs, ws, bs, ht, wt, bt, targets.contiguous(), keep.contiguous(), temperature, vocab_size,
        div_code, beta, int(chunk_size or 0), int(token_chunk_size or 0), be, bool(check_targets))
    return DistillOutput(_reduce(div, keep, reduction), div, lp, ent)


def fused_linear_reverse_kl(
    student_hidden: Tensor,
    student_weight: Tensor,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    targets: Tensor,
    *,
    mask: Optional[Tensor] = None,
    temperature: float = 1.0,
    student_bias: Optional[Tensor] = None,
    teacher_bias: Optional[Tensor] = None,
    vocab_size: Optional[int] = None,
    chunk_size: Optional[int] = None,
    reduction: str = "mean",
    token_chunk_size: Optional[int] = None,
    ignore_index: Optional[int] = -100,
    backend: Optional[str] = None,
    check_targets: Optional[bool] = None,
) -> DistillOutput:
    """Per-token reverse KL(p_student ‖ p_teacher), student log-probs and entropy, fused.

    `fused_linear_distill` with divergence="reverse_kl"; see it for the arguments.
    """
    return fused_linear_distill(
        student_hidden, student_weight, teacher_hidden, teacher_weight, targets, mask=mask,
        temperature=temperature, student_bias=student_bias, teacher_bias=teacher_bias,
        vocab_size=vocab_size, chunk_size=chunk_size, token_chunk_size=token_chunk_size,
        reduction=reduction, divergence="reverse_kl", ignore_index=ignore_index,
        backend=backend, check_targets=check_targets)


def fused_linear_logprob_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Optional[Tensor] = None,
    mask: Optional[Tensor] = None,
    temperature: float = 1.0,
    vocab_size: Optional[int] = None,
    chunk_size: Optional[int] = None,
    ignore_index: Optional[int] = -100,
    backend: Optional[str] = None,
    token_chunk_size: Optional[int] = None,
    check_targets: Optional[bool] = None,
) -> LogProbEntropy:
    """Fused lm_head + log-prob of the target + entropy, no teacher, no [N, V] logits.

    The teacher-less mode of `fused_linear_distill` (the same forward / backward with
    every teacher matmul and statistic removed), for PPO/GRPO actor losses and for
    scoring rollouts: with s = (hidden @ weight[:vocab_size]^T + bias) / T and
    p = softmax(s), per kept token i

        logprobs[i] = log p_{targets[i]},   entropy[i] = -Σ_v p_v log p_v.

    Args:
        hidden: [N, H] last hidden states. weight: [V, H] lm_head weight, same dtype
            (fp32 / bf16 / fp16; float64 on the PyTorch path). bias: optional [V].
        targets: [N] integer ids of the sampled tokens (ignored where masked).
        mask: optional [N] bool, True = token is computed. Targets equal to
            `ignore_index` (default -100) are masked too; None disables that.
        temperature: > 0, divides the logits (the sampler's temperature).
        vocab_size: true vocabulary <= V (padded lm_head rows are excluded and get
            zero gradient); default V.
        chunk_size, token_chunk_size, backend, check_targets: as in `fused_linear_distill`.

    Returns:
        LogProbEntropy(logprobs, entropy): fp32 [N] (float64 for float64 inputs on the
        PyTorch path), 0 at masked tokens. Gradients reach hidden, weight and bias from
        both outputs (masked tokens get none). Under `torch.no_grad()` (or with no input
        requiring grad) nothing is saved for a backward: memory is the inputs plus
        O(rows × chunk) working tiles.
    """
    temperature, vocab_size = _validate_student_only(hidden, weight, bias, targets, mask,
                                                     temperature, vocab_size)
    be, check_targets = _dispatch(backend, hidden.device, check_targets, hidden.dtype)
    keep = _keep_mask(targets, mask, ignore_index)
    b = None if bias is None else bias.contiguous()
    _div, lp, ent, _stats = _fwd_op(
        hidden.contiguous(), weight.contiguous(), b, None, None, None, targets.contiguous(),
        keep.contiguous(), temperature, vocab_size, DIVERGENCES["reverse_kl"], 0.5,
        int(chunk_size or 0), int(token_chunk_size or 0), be, check_targets)
    return LogProbEntropy(lp, ent)


# ----------------------------------------------------------------------------------
# naive references (materialise [N, V]; tests and benchmarks only)
# ----------------------------------------------------------------------------------
def reference_linear_distill(
    student_hidden: Tensor,
    student_weight: Tensor,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    targets: Tensor,
    *,
    mask: Optional[Tensor] = None,
    temperature: float = 1.0,
    student_bias: Optional[Tensor] = None,
    teacher_bias: Optional[Tensor] = None,
    vocab_size: Optional[int] = None,
    chunk_size: Optional[int] = None,
    token_chunk_size: Optional[int] = None,
    reduction: str = "mean",
    divergence: str = "reverse_kl",
    beta: float = 0.5,
    ignore_index: Optional[int] = -100,
    compute_dtype: Optional[torch.dtype] = None,
    backend: Optional[str] = None,
    check_targets: Optional[bool] = None,
) -> DistillOutput:
    """Naive reference: full [N, V] logits in `compute_dtype`, plain autograd.

    `compute_dtype` defaults to float64 if any input is float64, else float32. Per-token
    outputs are returned in `compute_dtype`. The JSD is TRL's formula verbatim (β = 0 /
    1 special-cased to the KLs). `chunk_size`, `token_chunk_size`, `backend` and
    `check_targets` are accepted for signature compatibility and ignored.
    """
    temperature, vocab_size, beta = _validate(
        student_hidden, student_weight, teacher_hidden, teacher_weight, targets, mask,
        student_bias, teacher_bias, temperature, vocab_size, reduction, divergence, beta)
    if compute_dtype is None:
        any64 = any(x is not None and x.dtype == torch.float64 for x in
                    (student_hidden, student_weight, teacher_hidden, teacher_weight))
        compute_dtype = torch.float64 if any64 else torch.float32
    cd = compute_dtype
    V = vocab_size
    ls = _reference_log_softmax(student_hidden, student_weight, student_bias, V, temperature, cd)
    lt = _reference_log_softmax(teacher_hidden, teacher_weight, teacher_bias, V, temperature, cd)
    p = ls.exp()
    code = _resolve_divergence(divergence, beta)
    if code == 0:
        div = (p * (ls - lt)).sum(-1)
    elif code == 1:
        div = (lt.exp() * (lt - ls)).sum(-1)
    else:
        bt_ = torch.tensor(beta, dtype=cd, device=ls.device)
        lm = torch.logsumexp(torch.stack([ls + torch.log1p(-bt_), lt + torch.log(bt_)]), dim=0)
        kl_t = torch.nn.functional.kl_div(lm, lt, reduction="none", log_target=True).sum(-1)
        kl_s = torch.nn.functional.kl_div(lm, ls, reduction="none", log_target=True).sum(-1)
        div = beta * kl_t + (1.0 - beta) * kl_s
    keep = _keep_mask(targets, mask, ignore_index)
    lp, ent = _reference_lp_ent(ls, targets, keep)
    div = torch.where(keep, div, torch.zeros((), dtype=cd, device=ls.device))
    return DistillOutput(_reduce(div, keep, reduction), div, lp, ent)


def _reference_log_softmax(h, w, b, V, temperature, cd):
    """Naive [N, V] log-softmax of (h @ w[:V]^T + b[:V]) / T in dtype `cd`."""
    s = h.to(cd) @ w[:V].to(cd).t()
    if b is not None:
        s = s + b[:V].to(cd)
    return torch.log_softmax(s / temperature, dim=-1)


def _reference_lp_ent(ls, targets, keep):
    """Log-prob of the targets and entropy from [N, V] log-probs, zero where not kept."""
    V = ls.shape[1]
    ent = -(ls.exp() * ls).sum(-1)
    lp = ls.gather(1, targets.long().clamp(0, V - 1)[:, None])[:, 0]
    zero = torch.zeros((), dtype=ls.dtype, device=ls.device)
    return torch.where(keep, lp, zero), torch.where(keep, ent, zero)


def reference_linear_logprob_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Optional[Tensor] = None,
    mask: Optional[Tensor] = None,
    temperature: float = 1.0,
    vocab_size: Optional[int] = None,
    chunk_size: Optional[int] = None,
    ignore_index: Optional[int] = -100,
    backend: Optional[str] = None,
    token_chunk_size: Optional[int] = None,
    check_targets: Optional[bool] = None,
    compute_dtype: Optional[torch.dtype] = None,
) -> LogProbEntropy:
    """Naive reference of `fused_linear_logprob_entropy`: [N, V] log_softmax + gather.

    `compute_dtype` defaults to float64 for float64 inputs, else float32; outputs are
    in it. `chunk_size`, `token_chunk_size`, `backend` and `check_targets` are accepted
    for signature compatibility and ignored.
    """
    temperature, vocab_size = _validate_student_only(hidden, weight, bias, targets, mask,
                                                     temperature, vocab_size)
    if compute_dtype is None:
        compute_dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    ls = _reference_log_softmax(hidden, weight, bias, vocab_size, temperature, compute_dtype)
    lp, ent = _reference_lp_ent(ls, targets, _keep_mask(targets, mask, ignore_index))
    return LogProbEntropy(lp, ent)


def reference_linear_reverse_kl(student_hidden: Tensor, student_weight: Tensor,
                                teacher_hidden: Tensor, teacher_weight: Tensor, targets: Tensor,
                                **kwargs) -> DistillOutput:
    """Naive reverse-KL reference (see `reference_linear_distill`)."""
    kwargs.pop("divergence", None)
    return reference_linear_distill(student_hidden, student_weight, teacher_hidden,
                                    teacher_weight, targets, divergence="reverse_kl", **kwargs)
