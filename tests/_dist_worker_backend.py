"""Helper for tests/trainer/test_backend.py: the shared toy problem, and the multi-process worker.

Run under a launcher (``torchrun --standalone --nproc_per_node 2 tests/_dist_worker_backend.py
OUT [scenario ...]``); each scenario trains the tiny Qwen2 for 4 optimiser steps with the
loss-scaling contract of docs/deepspeed.md §1, each rank taking half of every global batch,
and writes HF snapshots after steps 2 and 4 plus a resumed run (checkpoint after step 2,
fresh model with other weights, load, steps 3-4). The leading underscore keeps pytest
from collecting it; the test imports the toy problem from here for its reference run.
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch

VOCAB, HIDDEN, LAYERS, SEQ, BATCH, STEPS = 64, 32, 2, 10, 8, 4
# micro-batches per optimiser step (same on every rank): variable, to exercise the boundary
MICRO_PLAN = (2, 3, 1, 2)
HPARAMS = dict(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, warmup_steps=2,
               total_steps=STEPS, max_grad_norm=0.5, schedule="cosine", min_lr_ratio=0.1)
SCENARIOS = {
    "plain": None,
    "zero1": {"zero_optimization": {"stage": 1}},
    "zero2": {"zero_optimization": {"stage": 2}},
    "zero3": {"zero_optimization": {"stage": 3}},
}


def make_model(seed: int = 0):
    from memopd.models import tiny_causal_lm

    return tiny_causal_lm("qwen2", vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=LAYERS,
                          num_heads=4, num_kv_heads=2, seed=seed).train()


def global_batch(step: int):
    """Token ids (BATCH, SEQ) and a target mask with an uneven token count per row."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    lengths = torch.randint(2, SEQ, (BATCH,), generator=g)  # targets at positions 1..len-1
    mask = (torch.arange(SEQ)[None, :] < lengths[:, None]) & (torch.arange(SEQ)[None, :] >= 1)
    return ids, mask


def token_loss_sum(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum over masked target tokens of -log p(token | prefix)."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    nll = -logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    return (nll * mask[:, 1:]).sum()


def train_steps(backend, steps, on_step=None) -> dict:
    """Optimiser steps `steps` (0-based) with this rank's share of every global batch."""
    rec = {"grad_norm": [], "lr": []}
    for step in steps:
        ids, mask = global_batch(step)
        rows = torch.arange(BATCH).chunk(backend.world_size)[backend.rank]
        ids, mask = ids[rows].to(backend.device), mask[rows].to(backend.device)
        n_global = backend.all_reduce_sum(mask[:, 1:].sum().double())
        parts = torch.arange(len(rows)).tensor_split(MICRO_PLAN[step % len(MICRO_PLAN)])
        for i, mb in enumerate(parts):
            out = backend.module(input_ids=ids[mb])
            loss = token_loss_sum(out.logits, ids[mb], mask[mb]) / n_global * backend.world_size
            backend.backward(loss, last_micro_batch=i == len(parts) - 1)
        rec["lr"].append(backend.lr())
        rec["grad_norm"].append(backend.step())
        if on_step is not None:
            on_step(step)
    return rec


def run_scenario(name: str, out: str) -> dict:
    from memopd.trainer.backend import make_backend

    cfg = SCENARIOS[name]
    t0 = time.time()
    backend = make_backend(make_model(0), deepspeed_config=cfg, **HPARAMS)
    t_init = time.time() - t0
    ckpt = os.path.join(out, f"{name}_ckpt")

    def on_step(step):
        if step == 1:
            backend.save_pretrained(os.path.join(out, f"{name}_s2"))
            backend.save_checkpoint(ckpt, client_state={"rank": backend.rank, "next_step": 2})
    rec = train_steps(backend, range(STEPS), on_step)
    backend.save_pretrained(os.path.join(out, f"{name}_s4"))

    # resume: a model with other weights must end up where the uninterrupted run is
    resumed = make_backend(make_model(123), deepspeed_config=cfg, **HPARAMS)
    client = resumed.load_checkpoint(ckpt)
    assert client == {"rank": resumed.rank, "next_step": 2}, client
    assert resumed.global_step == 2, resumed.global_step
    rec_r = train_steps(resumed, range(2, STEPS))
    resumed.save_pretrained(os.path.join(out, f"{name}_resumed"))
    return {**rec, "resumed": rec_r, "init_s": t_init, "total_s": time.time() - t0,
            "world_size": backend.world_size, "synced_gpus": backend.synced_gpus}


def main() -> None:
    out = sys.argv[1]
    names = sys.argv[2:] or list(SCENARIOS)
    from memopd.trainer.collectives import init_distributed, shutdown_distributed

    info = init_distributed()
    results = {name: run_scenario(name, out) for name in names}
    if info.rank == 0:
        with open(os.path.join(out, "results.json"), "w") as f:
            json.dump(results, f, indent=1)
    shutdown_distributed()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
