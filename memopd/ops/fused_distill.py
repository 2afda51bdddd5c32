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
log-sum-exps are known (log1p/expm1 forms again keep close distributions precise).

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
- CPU tensors: the same algorithm in chunked PyTorch. Masked rows are dropped with
  `index_select` before any matmul; tokens are processed in blocks of at most
  `token_chunk_size` (default 8192) kept rows, and the vocabulary in chunks of
  `chunk_size` columns (default: as many as fit 2^22 fp32 elements per
  [rows, chunk] piece, at least 128). So the largest tensors are a handful (at most
  ~8, for the JSD) of [rows, chunk] fp32 pieces, the fp32 copies of the kept hidden
  rows and the fp32 dW accumulator; never [N, V]. The price is compute: the backward
  recomputes both logit chunks, so the op does 6 instead of 4 lm_head-sized matmuls
  (measured on CPU: 1.3-1.4x the naive time for 5-21x less peak memory, see
  benchmarks/bench_fused_distill.py).
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
The op needs the *full* lm_head weights of the student and of the teacher when its
forward runs *and again when its backward runs* (it saves them to recompute the logit
tiles). A sharded parameter is a placeholder outside its owner's forward, so:

- Recommended for ZeRO-3, FSDP and FSDP2 alike: call the op inside the forward of
  the module that owns the lm_head, i.e. make the causal LM's forward return the loss
  (or the DistillOutput) from its last hidden states instead of the logits, as Liger's
  fused cross-entropy patches do. The engine's hooks gather the weight for the
  forward, gather it again for the backward, and reduce-scatter its gradient like any
  other use. If the call sits in another ZeRO-3 module's forward, declare the weight
  with `deepspeed.zero.register_external_parameter(that_module, lm_head.weight)`.
- Outside any forward (ZeRO-3): gather explicitly and keep the weight gathered until
  the backward has run:

      with deepspeed.zero.GatheredParameters([lm_head.weight], modifier_rank=None):
          out = fused_linear_reverse_kl(h, lm_head.weight, h_t, teacher_w, y, mask=m)
          engine.backward(out.loss)     # the gradient reaches the gathered parameter

  FSDP's `summon_full_params` is not meant for training (its gradients are not
  reduce-scattered), so with FSDP use the in-forward route.
- The frozen teacher's lm_head must also still be materialised at backward time: keep
  it unsharded (it receives no gradient and is not in the optimizer), or inside the
  same gathered scope. Pass teacher tensors detached.
A weight that was re-partitioned between forward and backward is detected (its shape
no longer matches) and raises a clear error instead of computing garbage.
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

_TORCH_TOKEN_CHUNK = 8192
_TORCH_TILE_ELEMS = 1 << 22  # elements of one [rows, vocab chunk] fp32 piece (16 MiB)
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


def _logits(h: Tensor, w: Tensor, b: Optional[Tensor], v0: int, v1: int, inv_t: float) -> Tensor:
    """Logits / T of one vocabulary chunk, in h's dtype (fp32 / fp64).

    `h` is already multiplied by 1/T (once per token block), so only the bias is scaled
    here: one [rows, chunk] pass fewer than scaling the product.
    """
    wc = w[v0:v1]
    if wc.dtype != h.dtype:
        wc = wc.to(h.dtype)  # bf16 @ bf16 on CPU would round the logits to bf16
    if b is None:
        return h @ wc.t()
    return torch.addmm(b[v0:v1].to(h.dtype) * inv_t, h, wc.t())


def _rowdot(a: Tensor, b: Tensor) -> Tensor:
    """Σ_v a[i, v] b[i, v] without a [rows, chunk] temporary."""
    return torch.einsum("ij,ij->i", a, b)


def _jsd_u(delta: Tensor, beta: float) -> Tensor:
    """u = log(β + (1-β) e^δ) = log M_v - log q_v for δ = log p_v - log q_v, overflow-free."""
    small = delta.abs() < 0.5
    u_small = torch.log1p((1.0 - beta) * torch.expm1(delta.clamp(-0.5, 0.5)))
    dp = delta.clamp_min(0.0)
    u_pos = dp + torch.log((1.0 - beta) + beta * torch.exp(-dp))
    u_neg = torch.log(beta + (1.0 - beta) * torch.exp(delta.clamp_max(0.0)))
    return torch.where(small, u_small, torch.where(delta > 0, u_pos, u_neg))


_SQRT_E = math.exp(0.5)


def _torch_forward_rows(hs_t, ws, bs, ht_t, wt, bt, y, inv_t, V, div_code, beta, vchunk):
    """Online statistics of one token block (hidden rows already multiplied by 1/T).

    `ht_t is None` is the teacher-less mode: only the student sums (max, sum-exp,
    entropy sum, target logit) are kept, no teacher logits are ever computed, and
    the divergence and the teacher rows of the stats are zero.
    """
    n = hs_t.shape[0]
    has_teacher = ht_t is not None
    f = dict(device=hs_t.device, dtype=hs_t.dtype)
    m_s = torch.full((n,), _NEG, **f)
    z_s = torch.zeros(n, **f)
    a_s = torch.zeros(n, **f)
    m_t = torch.full((n,), _NEG, **f)
    z_t = torch.zeros(n, **f)
    e_d = torch.zeros(n, **f)
    m_j = torch.full((n,), _NEG, **f)
    zt_j = torch.zeros(n, **f)
    dz_j = torch.zeros(n, **f)
    s_y = torch.zeros(n, **f)
    for v0 in range(0, V, vchunk):
        v1 = min(V, v0 + vchunk)
        s = _logits(hs_t, ws, bs, v0, v1, inv_t)
        in_c = (y >= v0) & (y < v1)
        s_y += torch.where(in_c, s.gather(1, (y - v0).clamp(0, v1 - v0 - 1)[:, None])[:, 0], 0.0)
        m_s_new = torch.maximum(m_s, s.amax(1))
        alpha_s = torch.exp(m_s - m_s_new)
        if not has_teacher:
            s.sub_(m_s_new[:, None])
            es = torch.exp(s)
            a_s = alpha_s * (a_s + (m_s - m_s_new) * z_s) + _rowdot(es, s)
            z_s = alpha_s * z_s + es.sum(1)
            m_s = m_s_new
            del s, es
            continue
        t = _logits(ht_t, wt, bt, v0, v1, inv_t)
        m_t_new = torch.maximum(m_t, t.amax(1))
        alpha_t = torch.exp(m_t - m_t_new)
        d = s - t
        s.sub_(m_s_new[:, None])                   # s <- s - m_s  (<= 0)
        t.sub_(m_t_new[:, None])
        es = torch.exp(s)
        a_s = alpha_s * (a_s + (m_s - m_s_new) * z_s) + _rowdot(es, s)
        del s
        es_sum = es.sum(1)
        z_s = alpha_s * z_s + es_sum
        et = t.exp_()                              # t <- e^{t - m_t}
        et_sum = et.sum(1)
        z_t = alpha_t * z_t + et_sum
        if div_code == 1:
            e_d = alpha_t * e_d + _rowdot(et, d)
        else:
            e_d = alpha_s * e_d + _rowdot(es, d)
        # Precise Σ (e^{s-M} - e^{t-M}) at the joint max M, the difference of the two
        # normalisers (see the module docstring). With c_S = e^{m_s - M}, c_T = e^{m_t - M}:
        #   e^{s-M} - e^{t-M} = c_T e_t expm1(min(d, 1/2)) + relu(c_S e_s - c_T √e e_t)
        # exactly (the relu is non-zero iff d > 1/2, where it restores the clamped part),
        # with no overflow and full relative precision where d is small.
        m_j_new = torch.maximum(m_s_new, m_t_new)
        r_j = torch.exp(m_j - m_j_new)
        c_s = torch.exp(m_s_new - m_j_new)
        c_t = torch.exp(m_t_new - m_j_new)
        k = (torch.exp(m_t_new - m_s_new) * _SQRT_E).clamp_max(1e30)
        big = es.addcmul_(k[:, None], et, value=-1.0).relu_().sum(1)
        small = _rowdot(et, d.clamp_max_(0.5).expm1_())
        zt_j = r_j * zt_j + c_t * et_sum
        dz_j = r_j * dz_j + c_t * small + c_s * big
        m_s, m_t, m_j = m_s_new, m_t_new, m_j_new
        del t, d, es, et
    if not has_teacher:
        lse_s, ent, lp = _finalize_student(m_s, z_s, a_s, s_y)
        zero = torch.zeros(n, **f)
        return zero, lp, ent, torch.stack([lse_s, zero, zero, zero, ent])
    lse_s, lse_t, dlse, ent, lp = _finalize(m_s, z_s, a_s, m_t, z_t, m_j, zt_j, dz_j, s_y)
    if div_code == 0:
        aux = e_d / z_s - dlse
        div = aux.clamp_min(0.0)
    elif div_code == 1:
        aux = dlse - e_d / z_t
        div = aux.clamp_min(0.0)
    else:
        # JSD: second pass with normalised log-probs, KL(p||M) and KL(q||M) per token
        kl_pm = torch.zeros(n, **f)
        kl_qm = torch.zeros(n, **f)
        for v0 in range(0, V, vchunk):
            v1 = min(V, v0 + vchunk)
            s = _logits(hs_t, ws, bs, v0, v1, inv_t)
            t = _logits(ht_t, wt, bt, v0, v1, inv_t)
            delta = (s - t).sub_(dlse[:, None])
            u = _jsd_u(delta, beta)
            p = s.sub_(lse_s[:, None]).exp_()
            q = t.sub_(lse_t[:, None]).exp_()
            kl_pm += _rowdot(p, delta.sub_(u))
            kl_qm -= _rowdot(q, u)
            del s, t, delta, u
        aux = kl_pm
        div = (beta * kl_qm + (1.0 - beta) * kl_pm).clamp_min(0.0)
    stats = torch.stack([lse_s, lse_t, dlse, aux, ent])
    return div, lp, ent, stats


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


def _default_vchunk(rows: int, V: int, chunk_size: int) -> int:
    if chunk_size and chunk_size > 0:
        return int(chunk_size)
    c = max(128, _TORCH_TILE_ELEMS // max(rows, 1))
    return min(V, (c // 64) * 64)


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
    tchunk = token_chunk if token_chunk and token_chunk > 0 else _TORCH_TOKEN_CHUNK
    inv_t = 1.0 / temperature
    for r0 in range(0, n_kept, tchunk):
        rows = kept[r0:r0 + tchunk]
        hs_t = hs.index_select(0, rows).to(cdt).mul_(inv_t)
        ht_t = None if ht is None else ht.index_select(0, rows).to(cdt).mul_(inv_t)
        y = targets.index_select(0, rows).long()
        vchunk = _default_vchunk(rows.numel(), V, chunk_size)
        d_, l_, e_, st_ = _torch_forward_rows(hs_t, ws, bs, ht_t, wt, bt, y, inv_t, V, div_code,
                                              beta, vchunk)
        div.index_copy_(0, rows, d_)
        lp.index_copy_(0, rows, l_)
        ent.index_copy_(0, rows, e_)
        stats.index_copy_(1, rows, st_)
    return div, lp, ent, stats


def _torch_backward(g_div, g_lp, g_ent, hs, ws, bs, ht, wt, bt, targets, keep, stats,
                    temperature, V, div_code, beta, need_dh, need_dw, need_db, chunk_size,
                    token_chunk):
    """Recompute the chunks and reduce dL/ds (s = logits / T) into dH, dW, db.

    With ls = log p, lt = log q (both centred: O(1) where p or q matters) every term of
    dL/ds except the one-hot of the log-prob and the nonlinear part of the JSD is
    p ⊙ (A + B·ls + C·lt) with per-token A, B, C, so a chunk costs a handful of
    [rows, chunk] passes:
      log-prob:  -g_lp p (+ g_lp at the target)
      entropy:   -g_H p (ls + H)
      reverse:   g_kl p (δ - KL),  δ = ls - lt + ε,  ε = (lse_s - lse_t) - dlse  (tiny)
      forward:   g_kl (p - q) = -g_kl p expm1(-δ)
      JSD:       (1-β) g_kl p ((δ - u(δ)) - KL(p‖M))
    (Working with raw logits instead of ls / lt would cancel O(|s|) terms for the
    dominant tokens and lose digits.) Hidden rows are pre-multiplied by 1/T, so
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
        tchunk = token_chunk if token_chunk and token_chunk > 0 else _TORCH_TOKEN_CHUNK
        inv_t = 1.0 / temperature
        for r0 in range(0, n_kept, tchunk):
            rows = kept[r0:r0 + tchunk]
            n = rows.numel()
            hs_t = hs.index_select(0, rows).to(cdt).mul_(inv_t)
            ht_t = ht.index_select(0, rows).to(cdt).mul_(inv_t) if g_div is not None else None
            y = targets.index_select(0, rows).long()
            st = stats.index_select(1, rows).to(cdt)
            lse_s, lse_t, dlse, aux, ent = st[0], st[1], st[2], st[3], st[4]
            zero = torch.zeros(n, **f)
            glp = g_lp.index_select(0, rows).to(cdt) if g_lp is not None else zero
            gh = g_ent.index_select(0, rows).to(cdt) if g_ent is not None else zero
            gd = g_div.index_select(0, rows).to(cdt) if g_div is not None else zero
            # per-token coefficients of p ⊙ (A + B ls + C lt)
            eps = (lse_s - lse_t) - dlse
            A = -glp - gh * ent
            B = -gh
            C = None
            if g_div is not None:
                if div_code == 0:
                    A = A + gd * (eps - aux)
                    B = B + gd
                    C = -gd
            A, B = A[:, None], B[:, None]
            has_lp = g_lp is not None
            dh32 = torch.zeros(n, Hs, **f) if need_dh else None
            vchunk = _default_vchunk(n, V, chunk_size)
            for v0 in range(0, V, vchunk):
                v1 = min(V, v0 + vchunk)
                ls = _logits(hs_t, ws, bs, v0, v1, inv_t).sub_(lse_s[:, None])
                lt = None
                if g_div is not None:
                    lt = _logits(ht_t, wt, bt, v0, v1, inv_t).sub_(lse_t[:, None])
                ds = torch.addcmul(A, B, ls)
                if C is not None:
                    ds.addcmul_(C[:, None], lt)
                if g_div is not None and div_code == 2:
                    delta = (ls - lt).add_(eps[:, None])
                    jsd = (delta - _jsd_u(delta, beta)).sub_(aux[:, None]).mul_(((1.0 - beta) * gd)[:, None])
                    ds.add_(jsd)
                    del delta, jsd
                if g_div is not None and div_code == 1:
                    delta = (ls - lt).add_(eps[:, None])
                p = ls.exp_()                              # ls <- p
                ds.mul_(p)
                if g_div is not None and div_code == 1:
                    # p - q = -p expm1(-δ): relative precision when q ~ p (computing p and q
                    # separately would carry each one's normaliser rounding); the plain
                    # difference where |δ| is large (no cancellation there, no overflow)
                    small = delta.abs() < 0.5
                    pq = torch.where(small, torch.expm1(delta.clamp_(-0.5, 0.5).neg_()).mul_(p).neg_(),
                                     p - lt.exp_())
                    ds.addcmul_(gd[:, None], pq)
                    del delta, small, pq
                if has_lp:
                    in_c = (y >= v0) & (y < v1)
                    col = (y - v0).clamp(0, v1 - v0 - 1)[:, None]
                    ds.scatter_add_(1, col, torch.where(in_c, glp, 0.0)[:, None])
                if need_dh:
                    dh32.addmm_(ds, ws[v0:v1].to(cdt))
                if need_dw:
                    dw32[v0:v1].addmm_(ds.t(), hs_t)
                if need_db:
                    db32[v0:v1] += ds.sum(0)
                del ls, lt, ds, p
            if need_dh:
                dh.index_copy_(0, rows, dh32.mul_(inv_t).to(dh.dtype))
        if need_db:
            db32.mul_(1.0 / temperature)
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
                f"it gathered until the backward has run (see memopd.ops.fused_distill)")
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
        chunk_size: vocabulary columns per chunk of the PyTorch path (auto if None).
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
