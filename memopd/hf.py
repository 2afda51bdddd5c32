"""Packed forward of Hugging Face causal LMs on a `PackedBatch`.

memopd registers an attention implementation named "memopd" with
`transformers.AttentionInterface`. It reads the segment metadata passed explicitly as
the `memopd_meta` keyword of the model's forward and never infers boundaries from
`position_ids` (restored positions repeat and restart, so that inference would let
segments see each other). The restored positions go in as ordinary `position_ids`, so
RoPE is applied exactly as at sampling time. No KV cache is used.

`packed_forward(model, batch, output="hidden"|"logits")` returns the last hidden states
(what the fused KL op takes) or the logits at the prediction positions
(`batch.pred_index`), in (trajectory, call, k) order.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch

from .errors import UserError
from .layout import AttentionMeta, PackedBatch

__all__ = [
    "ATTN_IMPLEMENTATION",
    "register_memopd_attention",
    "memopd_attention_forward",
    "use_memopd_attention",
    "packed_forward",
    "packed_hidden_states",
    "independent_forward",
    "lm_head_of",
    "LMHead",
    "HeadError",
    "head_of",
]

ATTN_IMPLEMENTATION = "memopd"
_registered = False


def memopd_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
):
    """The attention function transformers calls: [B=1, H, T, D] in, [1, T, H, D] out."""
    meta = kwargs.get("memopd_meta")
    if not isinstance(meta, AttentionMeta):
        raise ValueError(
            "memopd attention needs the segment metadata: call the model with "
            "memopd_meta=<AttentionMeta> (e.g. through memopd.hf.packed_forward). It never "
            "infers segment boundaries from position_ids."
        )
    if query.shape[0] != 1:
        raise ValueError(
            f"memopd attention takes the packed stream as one batch row of T tokens; got batch size {query.shape[0]}"
        )
    if dropout and module.training:
        raise ValueError("memopd attention does not implement attention dropout; set attention_dropout=0")
    window = kwargs.get("sliding_window")
    if window is not None and window < meta.max_seqlen + meta.max_prefix_len:
        raise ValueError(f"sliding-window attention ({window}) is not supported by memopd packing")
    backend = kwargs.get("memopd_attention_backend", "auto")
    q = query[0].transpose(0, 1)
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    # looked up at call time (not imported at module level): importing memopd.hf stays light
    from .ops import attention

    out = attention.packed_attention(q, k, v, meta, softmax_scale=scaling, backend=backend)
    return out.unsqueeze(0), None


def register_memopd_attention() -> str:
    """Register the "memopd" attention implementation (idempotent)."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(ATTN_IMPLEMENTATION, memopd_attention_forward)
        _registered = True
    return ATTN_IMPLEMENTATION


def _set_attn(model, name: str) -> None:
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:  # older transformers
        model.config._attn_implementation = name


@contextlib.contextmanager
def use_memopd_attention(model) -> Iterator[None]:
    """Temporarily switch `model` to memopd attention (restores the previous one)."""
    register_memopd_attention()
    prev = model.config._attn_implementation
    _set_attn(model, ATTN_IMPLEMENTATION)
    try:
        yield
    finally:
        _set_attn(model, prev)


def _base_model(model):
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    if base is None or base is model:
        raise TypeError(f"{type(model).__name__} has no decoder under .{model.base_model_prefix}")
    return base


class HeadError(UserError, TypeError):
    """A model whose final logits are not `scale * (h @ W.T + b)` of its last hidden state."""


@dataclass(frozen=True)
class LMHead:
    """The output head as the fused ops see it: logits = scale * (h @ weight.T + bias).

    `scale` covers models that multiply or divide their logits (or the hidden state
    that enters lm_head) by a constant: Cohere's `logit_scale`, Granite's and MiniCPM3's
    `logits_scaling`, Falcon-H1's `lm_head_multiplier`, and any other constant factor.
    It is measured from the model itself by `head_of`, never looked up by name.
    """

    weight: torch.Tensor
    bias: torch.Tensor | None
    scale: float = 1.0

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        z = h @ self.weight.T
        if self.bias is not None:
            z = z + self.bias
        return z * self.scale if self.scale != 1.0 else z


def head_of(model) -> LMHead:
    """The model's head as an `LMHead`, its scale measured once per model (see
    `measure_logit_scale`); raises `HeadError` for heads that are not of that form."""
    head = lm_head_of(model)
    scale = getattr(model, "_memopd_logit_scale", None)
    if scale is None:
        scale = measure_logit_scale(model)
        model._memopd_logit_scale = scale
    return LMHead(head.weight, getattr(head, "bias", None), scale)


@torch.no_grad()
def measure_logit_scale(model, probe_len: int = 8) -> float:
    """The constant c with model(ids).logits == c * (h @ W.T + b), where h is the decoder's
    last hidden state (what `packed_forward(output="hidden")` returns).

    Checked on a short probe, in three parts, each of which must hold exactly up to
    rounding: (1) lm_head is the linear map of its weight and bias; (2) what enters
    lm_head is a constant multiple of h; (3) the model's final logits are a constant
    multiple of what lm_head returns, tested by swapping lm_head's output for values
    spread over [-100, 100], where a non-linear post-processing (e.g. Gemma-2's
    final-logit soft-capping) cannot pass for a linear one. Anything else raises
    `HeadError` naming the model type, before any fused op can score the wrong
    distribution.
    """
    head = lm_head_of(model)
    w, b = head.weight, getattr(head, "bias", None)
    kind = f"{type(model).__name__} (model_type={getattr(model.config, 'model_type', '?')!r})"
    device = w.device
    gen = torch.Generator().manual_seed(0)
    vocab = int(model.get_input_embeddings().weight.shape[0])
    ids = torch.randint(0, vocab, (1, probe_len), generator=gen).to(device)
    seen: dict[str, torch.Tensor] = {}
    synthetic = (torch.rand(1, probe_len, w.shape[0], generator=gen, dtype=torch.float64) * 200 - 100)

    def pre(_m, args, kwargs):
        seen["x"] = (args[0] if args else kwargs.get("input")).detach()

    def post(_m, _args, out):
        seen["y"] = out.detach()
        return synthetic.to(device=out.device, dtype=out.dtype).expand_as(out).clone()

    h = _base_model(model)(input_ids=ids, use_cache=False).last_hidden_state.double()
    handles = [head.register_forward_pre_hook(pre, with_kwargs=True), head.register_forward_hook(post)]
    was_training = model.training
    model.eval()
    try:
        logits = model(input_ids=ids, use_cache=False).logits.double()
    finally:
        for hd in handles:
            hd.remove()
        model.train(was_training)
    tol = 1e-5 if w.dtype in (torch.float32, torch.float64) else 2e-2

    def proportional(a: torch.Tensor, ref: torch.Tensor) -> float | None:
        """c with a == c * ref (relative max error <= tol), else None."""
        denom = float((ref * ref).sum())
        if a.shape != ref.shape or denom == 0.0:
            return None
        c = float((a * ref).sum()) / denom
        err = float((a - c * ref).abs().max()) / max(float(a.abs().max()), 1e-30)
        return c if err <= tol else None

    if "x" not in seen:
        raise HeadError(f"{kind}: its forward does not call get_output_embeddings(); memopd cannot score it")
    x, y = seen["x"].double(), seen["y"].double()
    linear = x @ w.double().T + (b.double() if b is not None else 0.0)
    unit = proportional(y, linear)
    if unit is None or abs(unit - 1.0) > tol:
        raise HeadError(f"{kind}: lm_head ({type(head).__name__}) is not the linear map of its weight and bias")
    d = proportional(x, h)
    if d is None:
        raise HeadError(f"{kind}: the hidden state entering lm_head is not a constant multiple of the decoder's "
                        "last hidden state; memopd's fused ops cannot score this model")
    c = proportional(logits, synthetic.to(logits.device))
    if c is None:
        caps = {k: v for k, v in model.config.to_dict().items() if "softcap" in k and v}
        hint = f" ({', '.join(f'{k}={v}' for k, v in caps.items())})" if caps else ""
        raise HeadError(f"{kind}: its final logits are a non-linear function of lm_head's output{hint}; "
                        "memopd's fused ops support only logits = scale * (h @ W.T + b). Use a model without "
                        "logit soft-capping, or disable it in the model config if the model allows that.")
    # rounding to float32 drops the fit's ~1e-10 noise: an exact 1, 0.25 or 1/8 stays exact
    scale = float(torch.tensor(c * d, dtype=torch.float32))
    if not scale > 0:
        raise HeadError(f"{kind}: its logits scale is {scale:g}; only a positive constant scale is supported")
    return scale


def lm_head_of(model) -> torch.nn.Module:
    head = model.get_output_embeddings()
    if head is None:
        raise TypeError(f"{type(model).__name__} has no output embeddings (lm_head)")
    return head


def packed_hidden_states(
    model,
    batch: PackedBatch,
    *,
    attention_backend: str = "auto",
    input_embeds: torch.Tensor | None = None,
) -> torch.Tensor:
    """Last hidden states [T, H] of the whole packed stream (all rows at once)."""
    device = next(model.parameters()).device
    if batch.input_ids.device != device:
        batch = batch.to(device)
    with use_memopd_attention(model):
        out = _base_model(model)(
            input_ids=batch.input_ids.unsqueeze(0) if input_embeds is None else None,
            inputs_embeds=input_embeds,
            position_ids=batch.position_ids.unsqueeze(0),
            use_cache=False,
            memopd_meta=batch.attn,
            memopd_attention_backend=attention_backend,
        )
    return out.last_hidden_state[0]


def packed_forward(
    model,
    batch: PackedBatch,
    *,
    output: str = "logits",
    attention_backend: str = "auto",
) -> torch.Tensor:
    """Hidden states [A, H] or logits [A, V] at the prediction positions of `batch`."""
    if output not in ("logits", "hidden"):
        raise ValueError(f"output must be 'logits' or 'hidden', got {output!r}")
    h = packed_hidden_states(model, batch, attention_backend=attention_backend)
    h = h.index_select(0, batch.pred_index.to(h.device))
    if output == "hidden":
        return h
    return head_of(model).logits(h)


def independent_forward(model, input_ids: list[int] | torch.Tensor, *, output: str = "logits") -> torch.Tensor:
    """Plain forward of one call alone ([1, n], positions 0..n-1, the model's own
    attention): the reference state of the RCE audit. Returns [n, V] or [n, H]."""
    device = next(model.parameters()).device
    ids = torch.as_tensor(input_ids, dtype=torch.long, device=device).unsqueeze(0)
    if output == "hidden":
        return _base_model(model)(input_ids=ids, use_cache=False).last_hidden_state[0]
    return model(input_ids=ids, use_cache=False).logits[0]
