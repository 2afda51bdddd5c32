"""Packing speedup benchmark: actor forward+backward over three layouts of the same batch.

What is timed: one actor step, i.e. forward of every call of a batch of trajectories,
log-probs of the sampled action tokens (`lm_head` only at the prediction positions, fp32
log-softmax), `loss = -sum(log-probs)`, backward through the whole model, micro-batched
under one token budget (`MEMOPD_BENCH_MAX_TOKENS`, the same for every layout; gradients
accumulate over micro-batches). Building the batches (packing, padding, host->device
copies) is done once, outside the timing; its cost is recorded as `prep_s`.

Layouts (names as they appear in `benchmark.extra_info["layout"]`):
  independent     the unpacked trainer: one row per call `[q, x_t, a_t]`, calls sorted by
                  length (longest first) and cut greedily into micro-batches of
                  rows x longest-row <= budget, right-padded to the longest row of their
                  micro-batch, plain HF batched forward with a padding attention mask and
                  the model's standard attention (sdpa), positions 0..n-1.
  aligned         `pack(..., "aligned_unshared")` + `memopd.hf.packed_forward`: every call
                  its own segment `[q, x_t, a_t]`, no padding, no prefix sharing.
  aligned_shared  `pack(..., "aligned", share_prefix="group")` + `packed_forward`: the
                  rollouts of one group (GRPO/PPO samples of one prompt, group size 4)
                  read one prefix segment per packed row.
  trie            `pack(..., "trie")` + `packed_forward`: every token prefix common to
                  several calls laid out once (the task prefix, a group's shared call-0
                  context, identical early calls, the memory span later calls of one
                  episode start with), each call reading its spine to its branch depth.

Configurations: Q2-, Q8-, Q16-shaped trajectories x batch sizes 4, 8, 16 trajectories
(`MEMOPD_BENCH_BATCHES`). Shapes follow expert episodes of the project's own QA
environment (`memopd.env`, summary memory; see `qa_shaped_trajectories` and
`python benchmarks/bench_packing.py --measure-env`), with fresh random token ids.
Two shape knobs, unset by default (the expert shapes): `MEMOPD_BENCH_PREFIX` (prefix
length in ids) and `MEMOPD_BENCH_CALLS` (calls per trajectory), each a comma-separated
list that multiplies the configurations (named e.g. `Q8-b4-p512-c24`). The speedup
curve over both: `python benchmarks/bench_packing.py --curve --prefix 32,128,512
--calls 4,12,24` (a table; `--help` for the rest).

Measurement: for each configuration, first an untimed equivalence check (a forward of every
layout captures the log-prob of every action token; the packed layouts must match
`independent` within 1e-4 in fp32, 0.1 in bf16), then on CUDA one untimed forward+backward
round per layout (kernel compilation, autotuning; `MEMOPD_BENCH_WARMUP`), then
`MEMOPD_BENCH_ROUNDS` (3) timed rounds, each running all three layouts back to back in a
rotating order, so machine noise hits them alike (`_timing.interleaved`). The durations of a
layout are then handed to pytest-benchmark (through its `pedantic` API, with a clock that
replays them), so `--benchmark-json` holds one entry per (configuration, layout) with the
real interleaved durations and, in `extra_info`: config, layout, tokens (incl. padding),
real_tokens, padding_fraction, the durations, the speedups, the load average of each round
and the rounds that load made unreliable. `benchmarks/conftest.py` prints the speedup table
at the end of the session and writes it as JSON (`benchmarks/results/packing_summary.json`,
or `$MEMOPD_BENCH_RESULTS_DIR`). Clock and threads (`benchmarks/_timing.py`): on CPU by
default one torch thread and the CPU time of the process, which other jobs on the machine
do not inflate (`MEMOPD_BENCH_CLOCK=wall`, `MEMOPD_BENCH_THREADS=N` on request); on CUDA
the wall clock after a device sync.

Models: on CPU by default `tiny-3b-ratio`, a random Qwen2 (hidden 256, 2 layers
(`MEMOPD_BENCH_LAYERS`), 8 heads / 2 kv heads, intermediate 512, fp32) with a 488-id
vocabulary, so that its lm-head costs 0.112 of its transformer layers per token
(weight-matmul FLOPs, `matmul_flops_per_token`), as in Qwen2.5-3B: the part of a step
that packing cannot shrink (the lm-head and log-softmax over every action token) then
weighs what it weighs in a real 3B model. `tiny` is the same body with a 4096-id
vocabulary, whose head costs 0.94 of its body (the benchmark's default before). With
CUDA a random Qwen2.5-0.5B-shaped model (hidden 896, 24 layers, 14 / 2 heads,
intermediate 4864, vocab 151936, tied embeddings, bf16), built from its config (no
download). `MEMOPD_BENCH_MODEL=tiny|tiny-3b-ratio|qwen2.5-0.5b` overrides the choice.
"""
from __future__ import annotations

import contextlib
import math
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass

import pytest
import torch
from _timing import apply_threads, bench_clock, interleaved, record_durations

from memopd.hf import packed_forward
from memopd.memory import SummaryReplacement, drive
from memopd.packing import pack
from memopd.records import Trajectory

LAYOUTS = ("independent", "aligned", "aligned_shared", "trie")
QUESTION_COUNTS = (2, 8, 16)
GROUP_SIZE = 4
PAD_ID = 0
MEM_OPEN, MEM_CLOSE = 1, 2  # reserved ids (0 is padding)


def _env_ints(name: str, default: tuple[int, ...]) -> tuple[int, ...]:
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        vals = tuple(int(x) for x in raw.replace(" ", "").split(",") if x)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected comma-separated integers") from None
    if not vals or min(vals) < 1:
        raise ValueError(f"{name}={raw!r}: expected positive integers")
    return vals


def _env_knob(name: str) -> tuple[int | None, ...]:
    """A shape knob: its comma-separated values, or (None,) (the expert shape) when unset."""
    return _env_ints(name, ()) or (None,)


BATCH_SIZES = _env_ints("MEMOPD_BENCH_BATCHES", (4, 8, 16))
PREFIX_LENGTHS = _env_knob("MEMOPD_BENCH_PREFIX")
CALLS_PER_TRAJECTORY = _env_knob("MEMOPD_BENCH_CALLS")
ROUNDS = _env_ints("MEMOPD_BENCH_ROUNDS", (3,))[0]
CLOCK = bench_clock()  # "process" (CPU time) on CPU, "wall" on CUDA, unless asked otherwise
# untimed fwd+bwd warm-up rounds: CUDA needs one (kernel compilation, autotuning, allocator);
# on CPU the median over the timed rounds absorbs a slower first round
_WARMUP_ENV = os.environ.get("MEMOPD_BENCH_WARMUP")
LOGPROB_TOL = {torch.float32: 1e-4, torch.float64: 1e-6, torch.bfloat16: 1e-1, torch.float16: 5e-2}


# --------------------------------------------------------------------------------------
# Trajectory shapes
# --------------------------------------------------------------------------------------
# Measured on expert episodes of memopd.env (generated world, its Qwen2-style tokenizer,
# summary memory, top-3 retrieval; 50 tasks per k; `--measure-env` reprints them; env of
# commit 2be9bc5):
#   Q2 : prefix 31-35,   calls 3-5,   context 0-35, action 9-13
#   Q8 : prefix 65-77,   calls 11-17, context 0-47, action 9-43
#   Q16: prefix 109-127, calls 21-30, context 0-63, action 9-83
# Per call: the prefix is ~21 + 6k ids; call t writes `<mem> notes </mem>` + a search of
# ~7 ids, so a_t ~ 9 + |notes|, and the notes grow by ~1.3 ids per call; the observation
# is 28-29 ids; summary memory keeps the memory span, so x_{t+1} ~ 31 + |notes|; the last
# call answers all k questions in ~3k + 1 ids after its memory span.
EXPERT_CALLS = {2: (3, 5), 8: (11, 17), 16: (21, 30)}
SHAPE = dict(prefix_base=21, prefix_per_question=6, search=(6, 8), observation=(27, 30),
             notes_growth=(1, 1, 2), answer_per_question=3)


def _calls_range(k: int) -> tuple[int, int]:
    if k in EXPERT_CALLS:
        return EXPERT_CALLS[k]
    return max(2, round(1.4 * k)), round(1.9 * k) + 1


def config_name(k: int, batch_size: int, prefix_len: int | None = None, calls: int | None = None) -> str:
    """`Qk-bB`, with `-pP` / `-cC` when a shape knob is set."""
    return (f"Q{k}-b{batch_size}" + ("" if prefix_len is None else f"-p{prefix_len}")
            + ("" if calls is None else f"-c{calls}"))


def qa_shaped_trajectories(k: int, n: int, *, group_size: int = GROUP_SIZE, vocab_size: int = 4096,
                           seed: int = 0, prefix_len: int | None = None,
                           calls: int | None = None, context0_len: int | None = None) -> list[Trajectory]:
    """`n` valid trajectories shaped like expert episodes of k questions (see above).

    Rollouts of one group (`group_size` in a row) share the prefix q (like samples of one
    prompt) but differ in their number of calls, actions and observations. Token ids are
    random in [3, vocab_size); ids 1/2 are the memory tags used by `SummaryReplacement`.
    `prefix_len` / `calls` replace the expert prefix length / the drawn number of calls
    of every trajectory. The expert draws are made either way, so that with the same
    `calls` two prefix lengths give the same contexts, actions and observations.
    `context0_len`: the rollouts of a group also share an initial context x_0 of that many
    ids (e.g. documents given with the question; the expert shape has none), drawn from a
    generator of its own so that the other draws stay the same.
    """
    rng = random.Random(1_000_003 * seed + k)
    prefix_rng = random.Random(7_919 * seed + k)
    context_rng = random.Random(104_729 * seed + k)
    context0: list[int] = []
    lo = 3

    def toks(m: int) -> list[int]:
        return [rng.randrange(lo, vocab_size) for _ in range(m)]

    policy = SummaryReplacement(MEM_OPEN, MEM_CLOSE)
    jitter = 1 + k // 4
    calls_lo, calls_hi = _calls_range(k)
    out: list[Trajectory] = []
    prefix: list[int] = []
    for i in range(n):
        if i % group_size == 0:
            prefix = toks(SHAPE["prefix_base"] + SHAPE["prefix_per_question"] * k + rng.randint(-jitter, jitter))
            if prefix_len is not None:
                prefix = [prefix_rng.randrange(lo, vocab_size) for _ in range(prefix_len)]
            if context0_len:
                context0 = [context_rng.randrange(lo, vocab_size) for _ in range(context0_len)]
        n_calls = rng.randint(calls_lo, calls_hi)
        if calls is not None:
            n_calls = calls
        notes: list[int] = []
        steps = []
        for t in range(n_calls):
            mem = [MEM_OPEN] + notes + [MEM_CLOSE]
            if t == n_calls - 1:  # answer all k questions
                act = mem + toks(SHAPE["answer_per_question"] * k + 1 + rng.randint(0, 1))
            else:  # search
                act = mem + toks(rng.randint(*SHAPE["search"]))
            steps.append((act, toks(rng.randint(*SHAPE["observation"]))))
            notes = notes + toks(rng.choice(SHAPE["notes_growth"]))
        g = i // group_size
        out.append(drive(policy, prefix, steps, initial_context_ids=context0, task_id=f"Q{k}-task{g}",
                         group_id=f"Q{k}-g{g}"))
    return out


def measure_env_shapes(ks=QUESTION_COUNTS, tasks: int = 50, kind: str = "word") -> None:
    """Print prefix/calls/context/action ranges of expert episodes of `memopd.env`."""
    from memopd.env.qa import QAEnv
    from memopd.env.qa.expert import expert_trajectories
    from memopd.env.qa.tokenizer import build_tokenizer
    from memopd.env.qa.world import World

    world = World.generate()
    env = QAEnv.from_world(world, build_tokenizer(world.vocabulary_texts(), kind=kind))
    for k in ks:
        trs = expert_trajectories(env, world.sample_tasks(k, tasks, seed=1))
        rows = {
            "prefix": [len(t.prefix_ids) for t in trs],
            "calls": [len(t) for t in trs],
            "context": [len(i.context_ids) for t in trs for i in t.invocations],
            "action": [len(i.action_ids) for t in trs for i in t.invocations],
        }
        print(f"Q{k:<2} " + "  ".join(
            f"{name} {min(v)}-{max(v)} (mean {statistics.mean(v):.1f})" for name, v in rows.items()))


# --------------------------------------------------------------------------------------
# Model / device
# --------------------------------------------------------------------------------------
@dataclass
class BenchSetup:
    model: torch.nn.Module
    device: torch.device
    dtype: torch.dtype
    max_tokens: int
    name: str
    vocab_size: int


# the shape whose lm-head share `tiny-3b-ratio` copies (Qwen2.5-3B's config.json)
QWEN2_5_3B = dict(hidden_size=2048, num_layers=36, num_heads=16, num_kv_heads=2, intermediate_size=11008,
                  vocab_size=151936)
# the vocabulary that gives the tiny body (h256, 2 layers, 8/2 heads, i512) that head share
TINY_3B_RATIO_VOCAB = 488


def matmul_flops_per_token(*, hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int,
                           intermediate_size: int, vocab_size: int) -> tuple[int, int]:
    """(lm-head, transformer layers) forward FLOPs per token of a Qwen2-style model, weight
    matmuls only (2 per multiply-add): q/k/v/o projections, gate/up/down, the head. The
    attention scores (4 x context x hidden per layer) are left out: they depend on the
    context, and at this benchmark's contexts (hundreds of ids) they add 1-2% to a 3B body."""
    head_dim = hidden_size // num_heads
    attention = 2 * hidden_size * num_heads * head_dim + 2 * hidden_size * num_kv_heads * head_dim
    mlp = 3 * hidden_size * intermediate_size
    return 2 * vocab_size * hidden_size, 2 * num_layers * (attention + mlp)


def head_share(**shape) -> float:
    """lm-head FLOPs / transformer-layer FLOPs per token (`matmul_flops_per_token`)."""
    head, body = matmul_flops_per_token(**shape)
    return head / body


def make_setup(choice: str | None = None) -> BenchSetup:
    """The benchmark model for this machine (see the module docstring); `choice` wins over
    `MEMOPD_BENCH_MODEL`."""
    from memopd.models import tiny_causal_lm

    cuda = torch.cuda.is_available()
    apply_threads()
    choice = choice or os.environ.get("MEMOPD_BENCH_MODEL", "qwen2.5-0.5b" if cuda else "tiny-3b-ratio")
    device = torch.device("cuda" if cuda else "cpu")
    if choice in ("tiny", "tiny-3b-ratio"):
        layers = _env_ints("MEMOPD_BENCH_LAYERS", (2,))[0]
        vocab = 4096 if choice == "tiny" else TINY_3B_RATIO_VOCAB
        kw = dict(vocab_size=vocab, hidden_size=256, num_layers=layers, num_heads=8, num_kv_heads=2,
                  intermediate_size=512, dtype=torch.float32)
        name = f"qwen2-tiny(h256,L{layers},8/2h,i512,V{vocab})"
        if choice == "tiny-3b-ratio":
            share = head_share(**{key: v for key, v in kw.items() if key != "dtype"})
            name += f"[head/body {share:.3f}, Qwen2.5-3B {head_share(**QWEN2_5_3B):.3f}]"
        default_budget = 4096
    elif choice == "qwen2.5-0.5b":
        kw = dict(vocab_size=151936, hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2,
                  intermediate_size=4864, tie_word_embeddings=True, max_positions=32768,
                  dtype=torch.bfloat16 if cuda else torch.float32)
        name = "qwen2.5-0.5b-shaped(random)"
        default_budget = 16384 if cuda else 4096
    else:
        raise ValueError(f"MEMOPD_BENCH_MODEL={choice!r}: choose 'tiny', 'tiny-3b-ratio' or 'qwen2.5-0.5b'")
    budget = _env_ints("MEMOPD_BENCH_MAX_TOKENS", (default_budget,))[0]
    try:
        with torch.device(device):  # initialise directly on the GPU (fast) when there is one
            model = tiny_causal_lm("qwen2", **kw)
    except Exception:  # noqa: BLE001 - any failure of on-device init: build on CPU, then move
        model = tiny_causal_lm("qwen2", **kw)
    model = model.to(device)
    model.config.use_cache = False
    model.train()
    if model.config._attn_implementation != "sdpa":
        model.set_attn_implementation("sdpa")
    return BenchSetup(model, device, kw["dtype"], budget, f"{name} {str(kw['dtype']).replace('torch.', '')}",
                      kw["vocab_size"])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _action_logprobs(model, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model.get_output_embeddings()(hidden).float()
    return logits.log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def _action_offsets(trajs: list[Trajectory]) -> list[list[int]]:
    """Ordinal of action token (b, t, 0) in (trajectory, call, k) order."""
    out, n = [], 0
    for tr in trajs:
        row = []
        for inv in tr.invocations:
            row.append(n)
            n += len(inv.action_ids)
        out.append(row)
    return out


# --------------------------------------------------------------------------------------
# Layout runners: prepare once (untimed), then `step()` = one timed actor step
# --------------------------------------------------------------------------------------
class IndependentRunner:
    """One padded row per call; length-sorted micro-batches; HF forward with sdpa."""

    layout = "independent"

    def __init__(self, setup: BenchSetup, trajs: list[Trajectory]):
        t0 = time.perf_counter()
        self.setup = setup
        offs = _action_offsets(trajs)
        calls = [(b, t) for b, tr in enumerate(trajs) for t in range(len(tr.invocations))]
        calls.sort(key=lambda c: -len(trajs[c[0]].invocations[c[1]]))
        groups: list[list[tuple[int, int]]] = []
        for c in calls:
            n = len(trajs[c[0]].invocations[c[1]])
            if n > setup.max_tokens:
                raise ValueError(f"a call of {n} tokens exceeds the micro-batch budget {setup.max_tokens}")
            # sorted longest first: the first row of a micro-batch sets its width
            if groups and (len(groups[-1]) + 1) * len(trajs[groups[-1][0][0]].invocations[groups[-1][0][1]]) <= setup.max_tokens:
                groups[-1].append(c)
            else:
                groups.append([c])
        dev = setup.device
        self.micro = []
        self.tokens = self.real_tokens = 0
        for g in groups:
            width = len(trajs[g[0][0]].invocations[g[0][1]])
            ids = torch.full((len(g), width), PAD_ID, dtype=torch.long)
            mask = torch.zeros((len(g), width), dtype=torch.long)
            flat, tgt, order = [], [], []
            for r, (b, t) in enumerate(g):
                inv = trajs[b].invocations[t]
                seq = inv.input_ids
                ids[r, : len(seq)] = torch.tensor(seq)
                mask[r, : len(seq)] = 1
                first = len(seq) - len(inv.action_ids)
                for kk, tok in enumerate(inv.action_ids):
                    flat.append(r * width + first + kk - 1)  # logit that predicts a_{t,k}
                    tgt.append(tok)
                    order.append(offs[b][t] + kk)
                self.real_tokens += len(seq)
            self.tokens += len(g) * width
            self.micro.append(
                (ids.to(dev), mask.to(dev), torch.tensor(flat, device=dev), torch.tensor(tgt, device=dev),
                 torch.tensor(order, device=dev))
            )
        self.rows = len(calls)
        self.num_actions = sum(len(inv.action_ids) for tr in trajs for inv in tr.invocations)
        self.padding_fraction = 1.0 - self.real_tokens / max(1, self.tokens)
        _sync(dev)
        self.prep_s = time.perf_counter() - t0

    def step(self, capture: bool = False) -> torch.Tensor | None:
        """One actor step (forward + backward); with `capture`, a forward only (no grad)
        that returns the action log-probs in (trajectory, call, k) order."""
        model = self.setup.model
        base = model.base_model
        out = torch.empty(self.num_actions, dtype=torch.float32, device=self.setup.device) if capture else None
        with torch.no_grad() if capture else contextlib.nullcontext():
            for ids, mask, flat, tgt, order in self.micro:
                h = base(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
                h = h.reshape(-1, h.shape[-1]).index_select(0, flat)
                lp = _action_logprobs(model, h, tgt)
                if capture:
                    out[order] = lp
                else:
                    (-lp.sum()).backward()
        return out


class PackedRunner:
    """`pack()` once, micro-batch its rows under the budget, `packed_forward` each."""

    def __init__(self, setup: BenchSetup, trajs: list[Trajectory], layout: str):
        t0 = time.perf_counter()
        self.setup = setup
        self.layout = layout
        if layout == "aligned":
            batch = pack(trajs, "aligned_unshared", max_tokens=setup.max_tokens, pad_id=PAD_ID)
        elif layout == "aligned_shared":
            batch = pack(trajs, "aligned", max_tokens=setup.max_tokens, share_prefix="group", pad_id=PAD_ID)
        elif layout == "trie":
            batch = pack(trajs, "trie", max_tokens=setup.max_tokens, pad_id=PAD_ID)
        else:
            raise ValueError(layout)
        self.stats = batch.stats()
        self.tokens = batch.num_tokens
        self.padding_fraction = batch.padding_fraction
        self.real_tokens = self.tokens - batch.padding_tokens
        self.rows = batch.num_rows
        self.num_actions = batch.num_actions
        offs = _action_offsets(trajs)
        self.micro = []
        for mb in batch.micro_batches(setup.max_tokens):
            order = torch.tensor([offs[b][t] + kk for b, t, kk in zip(
                mb.traj_index.tolist(), mb.call_index.tolist(), mb.token_index.tolist())])
            self.micro.append((mb.to(setup.device), order.to(setup.device)))
        _sync(setup.device)
        self.prep_s = time.perf_counter() - t0

    def step(self, capture: bool = False) -> torch.Tensor | None:
        model = self.setup.model
        out = torch.empty(self.num_actions, dtype=torch.float32, device=self.setup.device) if capture else None
        with torch.no_grad() if capture else contextlib.nullcontext():
            for mb, order in self.micro:
                h = packed_forward(model, mb, output="hidden", attention_backend="auto")
                lp = _action_logprobs(model, h, mb.target_ids)
                if capture:
                    out[order] = lp
                else:
                    (-lp.sum()).backward()
        return out


def make_runner(setup: BenchSetup, trajs: list[Trajectory], layout: str):
    if layout == "independent":
        return IndependentRunner(setup, trajs)
    return PackedRunner(setup, trajs, layout)


def measure_config(setup: BenchSetup, k: int, batch_size: int, rounds: int, warmup: int = 0, *,
                   prefix_len: int | None = None, calls: int | None = None, group_size: int = GROUP_SIZE,
                   context0_len: int | None = None, layouts: tuple[str, ...] = LAYOUTS) -> dict:
    """Interleaved measurement of the layouts on one configuration.

    Returns {layout: record}; a record holds the timed durations and the layout numbers.
    """
    trajs = qa_shaped_trajectories(k, batch_size, group_size=group_size, vocab_size=setup.vocab_size, seed=batch_size,
                                   prefix_len=prefix_len, calls=calls, context0_len=context0_len)
    runners = {lay: make_runner(setup, trajs, lay) for lay in layouts}
    model = setup.model
    # equivalence check (untimed, forward only): the action log-probs of every layout
    lps = {lay: runners[lay].step(capture=True) for lay in layouts}
    _sync(setup.device)
    ref = lps["independent"]
    diffs = {lay: float((lps[lay] - ref).abs().max()) if ref.numel() else 0.0 for lay in layouts}
    del lps, ref
    # untimed warm-up steps (on CUDA the first backward compiles the Triton kernels)
    for _ in range(warmup):
        for lay in layouts:
            model.zero_grad(set_to_none=True)
            runners[lay].step()
    timed = interleaved({lay: runners[lay].step for lay in layouts}, rounds, clock=CLOCK,
                        before=lambda _: model.zero_grad(set_to_none=True), sync=lambda: _sync(setup.device))
    times = timed.times
    model.zero_grad(set_to_none=True)
    n_calls = sum(len(t) for t in trajs)
    out = {}
    for lay, run in runners.items():
        out[lay] = {
            "config": config_name(k, batch_size, prefix_len, calls),
            "layout": lay,
            "questions": k,
            "trajectories": batch_size,
            "prefix_length": prefix_len,  # None: the expert shape
            "calls_per_trajectory": calls,
            "group_size": group_size,
            "context0_length": context0_len,
            "calls": n_calls,
            "action_tokens": run.num_actions,
            "tokens": int(run.tokens),
            "real_tokens": int(run.real_tokens),
            "padding_fraction": round(float(run.padding_fraction), 4),
            "rows": run.rows,
            "micro_batches": len(run.micro),
            "max_tokens": setup.max_tokens,
            "prep_s": round(run.prep_s, 4),
            "logprob_max_abs_diff": diffs[lay],
            "logprob_tol": LOGPROB_TOL.get(setup.dtype, 1e-4),
            "times_s": [round(t, 6) for t in times[lay]],
            "median_s": statistics.median(times[lay]) if times[lay] else math.nan,
            "max_s": max(times[lay]) if times[lay] else math.nan,
            "rounds": timed.summary(),
            "model": setup.name,
            "device": str(setup.device) if setup.device.type != "cuda" else torch.cuda.get_device_name(setup.device),
            "interleaved": True,
            "clock": CLOCK,
            "threads": torch.get_num_threads(),
        }
    ind = statistics.median(times["independent"]) if rounds else math.nan
    for lay in layouts:
        rec = out[lay]
        rec["speedup_vs_independent"] = round(ind / rec["median_s"], 4) if rounds else math.nan
        rec["min_s"] = min(times[lay]) if rounds else math.nan
        rec["speedup_vs_independent_min"] = round(min(times["independent"]) / rec["min_s"], 4) if rounds else math.nan
        # per-round paired ratios (same round, adjacent in time)
        rec["paired_speedups"] = [round(a / b, 4) for a, b in zip(times["independent"], times[lay])]
    del runners
    return out


# --------------------------------------------------------------------------------------
# pytest-benchmark glue
# --------------------------------------------------------------------------------------
_MEASURED: dict[str, dict] = {}


@pytest.fixture(scope="module")
def bench_setup():
    setup = make_setup()
    yield setup
    _MEASURED.clear()
    device = setup.device
    del setup
    if device.type == "cuda":
        torch.cuda.empty_cache()


CASES = [(k, b, p, c, lay) for k in QUESTION_COUNTS for b in BATCH_SIZES for p in PREFIX_LENGTHS
         for c in CALLS_PER_TRAJECTORY for lay in LAYOUTS]


@pytest.mark.parametrize("k,batch_size,prefix_len,calls,layout", CASES,
                         ids=[f"{config_name(k, b, p, c)}-{lay}" for k, b, p, c, lay in CASES])
def test_packing_speedup(benchmark, bench_setup, packing_records, k, batch_size, prefix_len, calls, layout):
    config = config_name(k, batch_size, prefix_len, calls)
    benchmark.group = f"packing {config}"
    if config not in _MEASURED:
        _MEASURED.clear()  # keep one configuration's numbers at a time
        rounds = 1 if benchmark.disabled else ROUNDS
        warmup = int(_WARMUP_ENV) if _WARMUP_ENV else (1 if bench_setup.device.type == "cuda" else 0)
        try:
            _MEASURED[config] = measure_config(bench_setup, k, batch_size, rounds, 0 if benchmark.disabled else warmup,
                                               prefix_len=prefix_len, calls=calls)
        except Exception as e:  # noqa: BLE001 - remembered so the other layouts fail fast
            _MEASURED[config] = f"{type(e).__name__}: {e}"
        # outside the except block: the failed measurement's frames (and device memory)
        # are released before the next configuration
        bench_setup.model.zero_grad(set_to_none=True)
        if bench_setup.device.type == "cuda":
            torch.cuda.empty_cache()
    if isinstance(_MEASURED[config], str):
        pytest.fail(f"{config}: measurement failed: {_MEASURED[config]}")
    rec = dict(_MEASURED[config][layout])
    benchmark.extra_info.update(rec)
    record_durations(benchmark, rec["times_s"])
    packing_records.append(rec)
    assert rec["logprob_max_abs_diff"] <= rec["logprob_tol"], (
        f"{config}: {layout} action log-probs differ from independent by {rec['logprob_max_abs_diff']:.3g} "
        f"(tolerance {rec['logprob_tol']:g}): the layouts do not compute the same thing"
    )


# --------------------------------------------------------------------------------------
# The speedup curve over the shape knobs (script mode)
# --------------------------------------------------------------------------------------
def measure_curve(setup: BenchSetup, k: int, batch_size: int, prefix_lengths, calls_list, rounds: int) -> list[dict]:
    """One summary row per (prefix length, calls) point, measured as the benchmark does."""
    import conftest as bench_conftest  # the summary rows of the pytest run, for one format

    rows = []
    for calls in calls_list:
        for prefix_len in prefix_lengths:
            recs = measure_config(setup, k, batch_size, rounds, prefix_len=prefix_len, calls=calls)
            row = bench_conftest.summarize(list(recs.values()))["configs"][0]
            row["prefix_length"], row["calls_per_trajectory"] = prefix_len, calls
            bad = [lay for lay, r in recs.items() if r["logprob_max_abs_diff"] > r["logprob_tol"]]
            if bad:
                raise AssertionError(f"{row['config']}: {', '.join(bad)} log-probs differ from independent")
            rows.append(row)
            print(format_curve_row(row), flush=True)
    return rows


CURVE_HEAD = ("| prefix | calls | tokens ind / shared | s ind | s aligned | s shared | ind/aligned | **ind/shared** "
              "| per-round ind/shared | token ratio | load |\n|---|---|---|---|---|---|---|---|---|---|---|")


def format_curve_row(row: dict) -> str:
    def x(v):
        return "-" if v is None else f"{v:.2f}x"

    spread = row.get("speedup_aligned_shared_paired_range")
    loads = [v for v in (row.get("loadavg") or []) if v is not None]
    return (f"| {row['prefix_length']} | {row['calls_per_trajectory']} | {row['independent']['tokens']} / "
            f"{row['aligned_shared']['tokens']} | {row['independent']['median_s']:.3f} | "
            f"{row['aligned']['median_s']:.3f} | {row['aligned_shared']['median_s']:.3f} | "
            f"{x(row['speedup_aligned'])} | **{x(row['speedup_aligned_shared'])}** | "
            f"{'-' if not spread else f'{spread[0]:.2f}-{spread[1]:.2f}x'} | "
            f"{x(row['token_ratio_aligned_shared'])} | "
            f"{'-' if not loads else f'{min(loads):.1f}-{max(loads):.1f}'} |")


def _curve_main(argv: list[str]) -> None:
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python benchmarks/bench_packing.py --curve",
                                 description="packing speedup over prefix length x calls per trajectory")
    ap.add_argument("--curve", action="store_true", required=True)
    ap.add_argument("--k", type=int, default=8, help="questions per episode (answer length, jitter); default 8")
    ap.add_argument("--batch", type=int, default=4, help="trajectories per batch (groups of 4); default 4")
    ap.add_argument("--prefix", default="32,128,512", help="prefix lengths in ids, comma-separated")
    ap.add_argument("--calls", default="4,12,24", help="calls per trajectory, comma-separated")
    ap.add_argument("--rounds", type=int, default=ROUNDS, help="interleaved timed rounds")
    ap.add_argument("--model", default=None, help="tiny | tiny-3b-ratio | qwen2.5-0.5b (default: as the benchmark)")
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = ap.parse_args(argv)

    def ints(flag, raw):
        try:
            vals = [int(v) for v in raw.split(",") if v.strip()]
        except ValueError:
            ap.error(f"{flag} {raw!r}: expected comma-separated integers")
        if not vals or min(vals) < 1:
            ap.error(f"{flag} {raw!r}: expected positive integers")
        return vals

    prefixes, calls = ints("--prefix", args.prefix), ints("--calls", args.calls)
    if args.k < 1 or args.batch < 1 or args.rounds < 1:
        ap.error("--k, --batch and --rounds must be positive")
    setup = make_setup(args.model)
    print(f"model {setup.name} on {setup.device}, clock {CLOCK}, {torch.get_num_threads()} thread(s), "
          f"budget {setup.max_tokens} tokens, Q{args.k}-b{args.batch}, {args.rounds} interleaved rounds", flush=True)
    print(CURVE_HEAD, flush=True)
    rows = measure_curve(setup, args.k, args.batch, prefixes, calls, args.rounds)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": setup.name, "clock": CLOCK, "threads": torch.get_num_threads(), "k": args.k,
                       "batch": args.batch, "rounds": args.rounds, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    if "--measure-env" in sys.argv:
        measure_env_shapes(kind="bpe" if "--bpe" in sys.argv else "word")
    elif "--curve" in sys.argv:
        _curve_main(sys.argv[1:])
    else:
        print("run with pytest: pytest benchmarks/bench_packing.py --benchmark-only; "
              "`python benchmarks/bench_packing.py --measure-env [--bpe]` for the expert shapes; "
              "`python benchmarks/bench_packing.py --curve --help` for the speedup over prefix length and calls")
