"""Packed attention under torch.compile: one opaque custom op, no graph break.

`torch.compile(fullgraph=True)` of (a) `packed_attention` itself, forward and backward, and
(b) the packed forward of a tiny Hugging Face model through memopd's attention function,
against eager (fp32: values and gradients); plus `torch.library.opcheck` of the custom op
(schema, fake implementation, autograd registration).

BACKEND is the torch.compile backend used: "aot_eager" (Dynamo + AOTAutograd, the parts
that must handle the custom op, with the graph run eagerly). Inductor passes the same tests
but took about three minutes on 2 shared CPU cores (C++ compilation with gcc), against
about 20 s for this file with aot_eager.
"""
import pytest
import torch
from _attention_cases import make_inputs, random_meta  # noqa: E402

from memopd import pack, random_trajectories
from memopd.hf import packed_forward
from memopd.models import tiny_causal_lm
from memopd.ops import packed_attention

BACKEND = "aot_eager"


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (4, 2)])
def test_packed_attention_compiles_without_graph_break(Hq, Hkv):
    meta = random_meta(21, 200, shuffle=True)
    q, k, v, do = make_inputs(meta.num_tokens, Hq, Hkv, 16, torch.float32, 21)

    def loss(q, k, v):
        out = packed_attention(q * 1.5, k, v, meta, 0.3, backend="torch")
        return (out * do).sum(), out

    def value_and_grads(fn):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        total, out = fn(*leaves)
        return (out.detach(),) + torch.autograd.grad(total, leaves)

    graphs = []

    def recording_backend(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.lookup_backend(BACKEND)(gm, example_inputs)

    eager = value_and_grads(loss)
    compiled = value_and_grads(torch.compile(loss, fullgraph=True, backend=recording_backend))
    for name, a, b in zip(("out", "dq", "dk", "dv"), compiled, eager):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)
    # Dynamo sees the attention as one node: the custom op, not its SDPA calls
    targets = [str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]
    assert len(graphs) == 1 and targets.count("memopd.packed_attention_fwd.default") == 1, targets
    assert not any("scaled_dot_product" in t for t in targets), targets


def test_hf_packed_forward_compiles_without_graph_break():
    model = tiny_causal_lm("qwen2", vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                           initializer_range=0.2, seed=5)
    trajs = random_trajectories("summary", 4, seed=5, group_size=2, vocab_size=64, calls=(2, 3))
    batch = pack(trajs, layout="aligned", share_prefix="group")
    packed_forward(model, batch, attention_backend="torch")  # measures the head's scale once, eagerly

    def logprobs(model, batch):
        logits = packed_forward(model, batch, attention_backend="torch")
        return torch.log_softmax(logits, -1).gather(1, batch.target_ids.unsqueeze(1)).squeeze(1)

    def value_and_grads(fn):
        model.zero_grad()
        lp = fn(model, batch)
        lp.sum().backward()
        return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    lp_e, g_e = value_and_grads(logprobs)
    lp_c, g_c = value_and_grads(torch.compile(logprobs, fullgraph=True, backend=BACKEND))
    torch.testing.assert_close(lp_c, lp_e, atol=1e-5, rtol=1e-5)
    assert g_c.keys() == g_e.keys() and len(g_e) > 0
    for name in g_e:
        torch.testing.assert_close(g_c[name], g_e[name], atol=1e-5, rtol=1e-4, msg=name)


def test_opcheck_custom_op():
    """Schema, fake (meta) implementation, autograd registration and the AOT dispatch of
    memopd::packed_attention_fwd (whose backward is memopd::packed_attention_bwd)."""
    meta = random_meta(22, 80)
    q, k, v, _ = make_inputs(meta.num_tokens, 4, 2, 16, torch.float64, 22)
    args = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), meta.seg_start, meta.prefix_start,
            meta.prefix_end, 0.25, False, "torch")
    torch.library.opcheck(torch.ops.memopd.packed_attention_fwd.default, args)
