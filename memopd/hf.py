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
from typing import Iterator

import torch

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
    if backend == "reference":
        from .ops.reference_attention import reference_packed_attention

        out = reference_packed_attention(q, k, v, meta, softmax_scale=scaling)
    else:
        from .ops.packed_attention import packed_attention

        out = packed_attention(q, k, v, meta, softmax_scale=scaling)
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
    return lm_head_of(model)(h)


def independent_forward(model, input_ids: list[int] | torch.Tensor, *, output: str = "logits") -> torch.Tensor:
    """Plain forward of one call alone ([1, n], positions 0..n-1, the model's own
    attention): the reference state of the RCE audit. Returns [n, V] or [n, H]."""
    device = next(model.parameters()).device
    ids = torch.as_tensor(input_ids, dtype=torch.long, device=device).unsqueeze(0)
    if output == "hidden":
        return _base_model(model)(input_ids=ids, use_cache=False).last_hidden_state[0]
    return model(input_ids=ids, use_cache=False).logits[0]
