"""Shared cases of the fused-distillation tests: random student/teacher heads, float64
copies for the references, and gradients of a weighted sum of the outputs. Imported by
test_fused_distill.py and test_fused_distill_triton.py (not collected itself)."""
import torch
from torch.utils._python_dispatch import TorchDispatchMode


def make_inputs(seed, N=40, Hs=24, Ht=20, V=301, Vt=None, dtype=torch.float32, bias=True,
                teacher_bias=False, mask_p=0.3, scale=0.4, teacher=None):
    """Random student/teacher heads. teacher="close" makes the teacher the student + noise."""
    g = torch.Generator().manual_seed(seed)
    Vt = V if Vt is None else Vt
    hs = torch.randn(N, Hs, generator=g)
    ws = torch.randn(V, Hs, generator=g) * scale
    if teacher == "close":
        ht = hs.clone()
        wt = ws[:Vt].clone() if Vt <= V else torch.cat([ws, torch.randn(Vt - V, Hs, generator=g)])
        wt = wt + 1e-3 * torch.randn(wt.shape, generator=g)
    else:
        ht = torch.randn(N, Ht, generator=g)
        wt = torch.randn(Vt, Ht, generator=g) * scale
    y = torch.randint(0, min(V, Vt), (N,), generator=g)
    mask = torch.rand(N, generator=g) > mask_p
    bs = (torch.randn(V, generator=g) * 0.5) if bias else None
    bt = (torch.randn(Vt, generator=g) * 0.5) if teacher_bias else None
    cast = lambda x: None if x is None else x.to(dtype)  # noqa: E731
    return dict(hs=cast(hs).requires_grad_(), ws=cast(ws).requires_grad_(),
                bs=None if bs is None else cast(bs).requires_grad_(), ht=cast(ht), wt=cast(wt),
                bt=cast(bt), y=y, mask=mask)


def far_inputs(seed, N=24, V=96, close_rows=0, dtype=torch.float32):
    """Logits given directly (identity heads): on each row the teacher's favourite token
    gets, from the student, e^-85 to e^-200 of the teacher's probability (log q - log p
    beyond 80 nats, where a capped e^{-δ} would distort the JSD); `close_rows` rows get a
    teacher equal to the student up to 1e-3 noise instead (the precise path's rows)."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(N, V, generator=g, dtype=torch.float64)
    t = torch.randn(N, V, generator=g, dtype=torch.float64)
    fav = torch.randint(0, V, (N,), generator=g)
    gap = 85.0 + 115.0 * torch.rand(N, generator=g, dtype=torch.float64)
    rows = torch.arange(N)
    t[rows, fav] += 6.0
    s[rows, fav] -= gap
    if close_rows:
        t[:close_rows] = s[:close_rows] + 1e-3 * torch.randn(close_rows, V, generator=g, dtype=torch.float64)
    eye = torch.eye(V, dtype=torch.float64)
    cast = lambda x: x.to(dtype).clone()  # noqa: E731 - fresh tensors, never shared between roles
    return dict(hs=cast(s).requires_grad_(), ws=cast(eye).requires_grad_(), bs=None, ht=cast(t), wt=cast(eye),
                bt=None, y=torch.randint(0, V, (N,), generator=g), mask=torch.ones(N, dtype=torch.bool))


def as64(inp):
    """Same values in float64 (fresh leaves) for the reference."""
    return {k: (v.detach().double().requires_grad_(v.requires_grad)
                if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
            for k, v in inp.items()}


def weighted_grads(out, inp, weights):
    """Gradients to the student hidden / weight / bias of sum_k (weights[k] * out.k).sum();
    a weight is a number or a per-token tensor. Unused inputs get zeros."""
    params = [p for p in (inp["hs"], inp["ws"], inp["bs"]) if p is not None]
    total = 0.0
    for name, w in weights.items():
        val = getattr(out, name)
        total = total + ((val * w.to(val.dtype)).sum() if isinstance(w, torch.Tensor) else w * val.sum())
    g = torch.autograd.grad(total, params, allow_unused=True)
    return [torch.zeros_like(p) if x is None else x for p, x in zip(params, g)]


def run_lpe(fn, inp, weights=None, **kw):
    """fused/reference_linear_logprob_entropy on the student of `inp`; (outputs, grads or None)."""
    out = fn(inp["hs"], inp["ws"], inp["y"], bias=inp["bs"], mask=inp["mask"], **kw)
    return out, None if weights is None else weighted_grads(out, inp, weights)


class SeesInsideOurOps(TorchDispatchMode):
    """A dispatch mode that also sees the aten ops *inside* the memopd custom ops.

    A mode handling an op is popped while the op runs, so `func(*args)` on
    `memopd::fused_distill_fwd` would hide every chunk it allocates: run the op's
    Python body instead, with this mode pushed again.
    """

    def __init__(self):
        super().__init__()
        self.inner_ops = 0  # aten ops seen inside memopd custom ops (probe sanity)
        self._depth = 0

    def record(self, func, out):
        raise NotImplementedError

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "memopd":
            from torch._library import custom_ops

            body = custom_ops.OPDEFS[func.name()]._init_fn
            self._depth += 1
            try:
                with self:
                    out = body(*args, **kwargs)
            finally:
                self._depth -= 1
        else:
            out = func(*args, **kwargs)
            self.inner_ops += self._depth > 0
        self.record(func, out)
        return out


class LargestTensor(SeesInsideOurOps):
    def __init__(self):
        super().__init__()
        self.largest = 0
        self.op = None

    def record(self, func, out):
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor) and t.numel() > self.largest:
                self.largest, self.op = t.numel(), str(func)


class CountMatmuls(SeesInsideOurOps):
    def __init__(self):
        super().__init__()
        self.n = 0

    def record(self, func, out):
        # (below autograd, composite ops such as matmul reach the mode undecomposed)
        self.n += func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_,
                                          torch.ops.aten.matmul)


def run_lpe_loss(fn, inp, logprob_weight, entropy_weight, extra=None, **kw):
    """The teacher-less op `fn` with its loss declared, on the student of `inp`: (outputs,
    gradients of out.loss plus the weighted per-token outputs named in `extra`, as
    `weighted_grads`)."""
    out = fn(inp["hs"], inp["ws"], inp["y"], logprob_weight=logprob_weight, entropy_weight=entropy_weight,
             bias=inp["bs"], mask=inp["mask"], **kw)
    return out, weighted_grads(out, inp, dict({"loss": 1.0}, **(extra or {})))


def reference_lpe_loss(inp, logprob_weight, entropy_weight, extra=None, ignore_index=-100, **kw):
    """The float64 oracle of the declared loss Σ_kept (w_lp·logprobs + w_ent·entropy):
    reference_linear_logprob_entropy and plain autograd; (outputs, gradients) as
    `run_lpe_loss`."""
    from memopd.ops import LogProbEntropyLoss, reference_linear_logprob_entropy

    r = as64(inp)
    ref = reference_linear_logprob_entropy(r["hs"], r["ws"], r["y"], bias=r["bs"], mask=r["mask"],
                                           ignore_index=ignore_index, **kw)
    keep = torch.ones_like(r["y"], dtype=torch.bool) if r["mask"] is None else r["mask"].clone()
    if ignore_index is not None:
        keep &= r["y"] != ignore_index

    def term(w, x):
        w = w.double() if isinstance(w, torch.Tensor) else float(w)
        return torch.where(keep, w * x, 0.0).sum()

    out = LogProbEntropyLoss(term(logprob_weight, ref.logprobs) + term(entropy_weight, ref.entropy),
                             ref.logprobs, ref.entropy)
    return out, weighted_grads(out, r, dict({"loss": 1.0}, **(extra or {})))
