"""A padded-batch PPO actor whose log-probs and loss come from memopd's tensor-level verl
hooks (`memopd.integrations.verl.hooks`), run on CPU, optionally under FSDP2 with several
gloo ranks.

verl 0.9 no longer ships the `DataParallelPPOActor` this example was first written
against: it trains through engine workers (`workers/engine_workers.py`) and its FSDP
engine, and memopd's recipe for it (agent loop, teacher scoring of every call, packed
session training, the fused loss as verl's loss) is docs/verl.md. What this example still
shows holds for any actor on the `[B, R]` response layout verl's `ppo_loss` uses:

1. The forward returns the last hidden states, not logits:
   `compute_log_prob(h, lm_head.weight, responses, response_mask, temperature=T)` gives
   the `[B, R]` log-probs and entropy without forming `[B, R, V]` logits.
2. The update's loss comes from those hidden states:
   `policy_loss(h, lm_head.weight, responses, response_mask, old_log_prob, advantages,
   clip_ratio=..., entropy_coeff=..., loss_agg_mode=..., global_batch_info=...)` equals
   verl's vanilla policy loss + `agg_loss` of the entropy; `teacher_hidden_states=`,
   `teacher_weight=` and `teacher_kl_coef=` add memopd's full-vocabulary reverse KL.
3. Under FSDP / FSDP2 or DeepSpeed ZeRO-3 the lm_head weight is sharded; outside the
   forward of the module that owns it, it is a placeholder. The fused ops read the whole
   weight in their forward (the recomputing ones again in their backward), so they must run **inside the
   forward of the module that owns the lm_head**: `ActorModule.forward` below is that
   module (the recipe's `install_packed_loss_forward` does the same for verl's engine).
   Under ZeRO-3, do the same (or declare the weight with
   `deepspeed.zero.register_external_parameter(module, lm_head.weight)`); docs/deepspeed.md §4.

`python examples/verl_style_actor.py` runs one update on one process; `--ranks 2` runs it
under FSDP2 with 2 gloo processes, each with its half of the batch, and checks the
averaged gradient against one process holding the whole batch (verl's
`global_batch_info` makes the per-rank losses add up to the global token mean).
`tests/integrations/test_examples.py` runs both.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
from torch import nn

from memopd.integrations.verl import compute_log_prob, policy_loss
from memopd.models import tiny_causal_lm

VOCAB = 61


class ActorModule(nn.Module):
    """The causal LM whose forward ends in memopd's fused op: the lm_head weight is read
    inside the forward of the module that owns it (the FSDP / ZeRO-3 requirement)."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, batch: dict, temperature: float = 1.0, loss_kwargs: dict | None = None):
        hidden = self.lm.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                               position_ids=batch["position_ids"]).last_hidden_state
        weight = self.lm.lm_head.weight
        if loss_kwargs is None:  # compute_log_prob: old log-probs, entropy
            return compute_log_prob(hidden, weight, batch["responses"], batch["response_mask"],
                                    temperature=temperature, calculate_entropy=True)
        return policy_loss(hidden, weight, batch["responses"], batch["response_mask"], batch["old_log_probs"],
                           batch["advantages"], temperature=temperature, **loss_kwargs)


class VerlStyleActor:
    """A padded-batch actor reduced to the two methods the fused ops change."""

    def __init__(self, module: nn.Module, *, temperature: float = 1.0, clip_ratio: float = 0.2,
                 entropy_coeff: float = 0.01, loss_agg_mode: str = "token-mean"):
        self.module = module
        self.temperature = temperature
        self.loss_kwargs = dict(clip_ratio=clip_ratio, entropy_coeff=entropy_coeff, loss_agg_mode=loss_agg_mode)

    def compute_log_prob(self, batch: dict):
        with torch.no_grad():
            return self.module(batch, temperature=self.temperature)

    def update_policy(self, micro_batches: list[dict], global_batch_info: dict) -> list[dict]:
        """Forward + backward of every micro-batch (gradients accumulate); the optimiser
        step is the caller's, as in verl."""
        metrics = []
        for mb in micro_batches:
            loss, m = self.module(mb, temperature=self.temperature,
                                  loss_kwargs={**self.loss_kwargs, "global_batch_info": global_batch_info})
            loss.backward()
            metrics.append({k: float(v) for k, v in m.items()})
        return metrics


def make_batch(seed: int = 0) -> dict:
    """verl's layout: prompts left-padded to P, responses (assistant and tool turns)
    right-padded to R; response_mask 0 on tool tokens and padding; positions count real
    tokens."""
    g = torch.Generator().manual_seed(seed)
    P, R = 6, 9
    prompt_lens, resp_lens = [6, 3, 4, 2], [9, 4, 7, 5]
    B = len(prompt_lens)
    ids = torch.zeros(B, P + R, dtype=torch.long)
    att = torch.zeros(B, P + R, dtype=torch.long)
    rmask = torch.zeros(B, R, dtype=torch.long)
    for b, (p, r) in enumerate(zip(prompt_lens, resp_lens)):
        ids[b, P - p:P] = torch.randint(3, VOCAB, (p,), generator=g)
        ids[b, P:P + r] = torch.randint(3, VOCAB, (r,), generator=g)
        att[b, P - p:P + r] = 1
        rmask[b, :r] = 1
    rmask[0, 3:5] = 0  # a tool observation inside the first response
    return {"input_ids": ids, "attention_mask": att, "position_ids": (torch.cumsum(att, 1) - 1).clamp_min(0),
            "responses": ids[:, P:].clone(), "response_mask": rmask,
            "advantages": torch.randn(B, R, generator=g)}


def _rows(batch: dict, rows: slice) -> dict:
    return {k: v[rows] for k, v in batch.items()}


def _model(seed: int = 0) -> nn.Module:
    return tiny_causal_lm("qwen2", vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                          seed=seed, initializer_range=0.2)


def one_update(actor: VerlStyleActor, batch: dict, dp_size: int = 1, batch_num_tokens=None) -> list[dict]:
    """verl's order: old log-probs from the current weights (rollout scoring), then the
    policy update on micro-batches of 2 sequences."""
    old, _ = actor.compute_log_prob(batch)
    batch = {**batch, "old_log_probs": old - 0.1 * batch["advantages"].sign()}  # as if a step had been taken
    if batch_num_tokens is None:
        batch_num_tokens = int(batch["response_mask"].sum())
    info = {"dp_size": dp_size, "batch_num_tokens": batch_num_tokens}
    micro = [_rows(batch, slice(i, i + 2)) for i in range(0, batch["input_ids"].shape[0], 2)]
    return actor.update_policy(micro, info)


def reference_gradients(batch: dict) -> dict[str, torch.Tensor]:
    """One process holding the whole batch."""
    module = ActorModule(_model())
    one_update(VerlStyleActor(module), batch)
    return {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}


def _fsdp_rank(rank: int, world: int, port: int, result_path: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        module = ActorModule(_model())
        for layer in module.lm.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(module, mesh=mesh)  # the root owns the embeddings, the final norm and the lm_head
        batch = make_batch()
        per_rank = batch["input_ids"].shape[0] // world
        mine = _rows(batch, slice(rank * per_rank, (rank + 1) * per_rank))
        # verl's global batch info: every rank divides by the global token count
        one_update(VerlStyleActor(module), mine, dp_size=world, batch_num_tokens=int(batch["response_mask"].sum()))
        grads = {n: p.grad.full_tensor() for n, p in module.named_parameters() if p.grad is not None}
        if rank == 0:
            torch.save(grads, result_path)
    finally:
        dist.destroy_process_group()


def run_fsdp(world: int) -> float:
    """FSDP2 over `world` gloo ranks on CPU; returns the largest gradient difference to
    one process holding the whole batch."""
    import socket
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "grads.pt")
        mp.spawn(_fsdp_rank, args=(world, port, path), nprocs=world)
        got = torch.load(path)
    want = reference_gradients(make_batch())
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    return max(float((got[n] - want[n]).abs().max()) for n in want)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=1, help="FSDP2 ranks (gloo, CPU); 1: a plain process")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.ranks == 1:
        module = ActorModule(_model())
        metrics = one_update(VerlStyleActor(module), make_batch())
        print("micro-batch metrics:", metrics)
        return 0
    diff = run_fsdp(args.ranks)
    print(f"FSDP2 on {args.ranks} gloo ranks vs one process: max |gradient difference| {diff:.2e}")
    return 0 if diff < 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
