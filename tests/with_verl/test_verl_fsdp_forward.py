"""`install_packed_loss_forward` under FSDP2 on 2 gloo processes (CPU): the packed forward
and memopd's fused loss run inside the root module's forward, where FSDP2 has gathered the
lm_head, and the gradients (each rank holding the same sessions, so their average is one
process's) equal those of the unsharded model. This is the part of `MemopdFSDPEngine` that
runs without CUDA; verl's engine itself needs it."""
import os
import socket
import tempfile

import pytest
import torch

pytestmark = pytest.mark.usefixtures("one_torch_thread")
MODEL = dict(vocab_size=61, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, seed=5, initializer_range=0.2)


def _sessions():
    from memopd.memory import SlidingWindow, drive

    g = torch.Generator().manual_seed(1)

    def ids(n):
        return torch.randint(3, 61, (n,), generator=g).tolist()

    return [drive(SlidingWindow(turns=1), ids(4), [(ids(3), ids(2)), (ids(2), ids(3)), (ids(4), [])],
                  initial_context_ids=ids(2)),
            drive(SlidingWindow(turns=1), ids(3), [(ids(2), ids(1)), (ids(5), [])])]


def _loss_and_grads(model):
    from omegaconf import OmegaConf

    from memopd.integrations.verl.training import install_packed_loss_forward, memopd_actor_loss, session_inputs

    sessions = _sessions()
    g = torch.Generator().manual_seed(2)
    old = [[-1.0 - torch.rand(len(i.action_ids), generator=g) for i in tr.invocations] for tr in sessions]
    adv = [[torch.randn(len(i.action_ids), generator=g) for i in tr.invocations] for tr in sessions]
    inputs = session_inputs(sessions, old, adv)
    config = OmegaConf.create({"loss_agg_mode": "seq-mean-token-mean", "entropy_coeff": 0.01, "global_batch_info": {},
                               "memopd_weighting": "per_session"})
    model = install_packed_loss_forward(model)
    loss, _ = model(memopd_batch=inputs.batch,
                    memopd_loss=lambda h, head: memopd_actor_loss(config, {"hidden": h, "head": head, "inputs": inputs}))
    loss.backward()
    return loss.detach()


def _rank(rank, world, port, path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from memopd.models import tiny_causal_lm

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        model = tiny_causal_lm("qwen2", **MODEL)
        from memopd.hf import head_of

        head_of(model)  # the logit scale, measured before sharding
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)  # the root owns the embeddings, the final norm and the lm_head
        loss = _loss_and_grads(model)
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
        if rank == 0:
            torch.save({"loss": loss, "grads": grads}, path)
        dist.barrier()  # neither rank tears gloo down while the other is still using it
    finally:
        dist.destroy_process_group()
    # Leave without the interpreter's and the C++ libraries' exit-time destructors: once in
    # ~30 CI runs a gloo thread was destroyed unjoined at exit ("terminate called without an
    # active exception", SIGABRT) after the work was done. The result is already on disk.
    os._exit(0)


def test_packed_loss_forward_under_fsdp2_matches_one_process():
    import torch.multiprocessing as mp

    from memopd.models import tiny_causal_lm

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "out.pt")
        mp.spawn(_rank, args=(2, port, path), nprocs=2)
        got = torch.load(path)
    model = tiny_causal_lm("qwen2", **MODEL)
    want = _loss_and_grads(model)
    torch.testing.assert_close(got["loss"], want, rtol=1e-6, atol=1e-7)
    ref = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(got["grads"]) == set(ref) and "lm_head.weight" in ref
    worst = max(float((got["grads"][n] - ref[n]).abs().max()) for n in ref)
    print(f"FSDP2 (2 gloo ranks) vs one process: loss {float(want):.6f}, max |gradient difference| {worst:.2e}")
    assert worst <= 1e-5
