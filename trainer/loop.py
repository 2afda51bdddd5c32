"""The training loop: rollouts -> scoring -> PPO + OPD update, with run management.

Each step: sample question sets, roll out `group_size` episodes per set with the
student (every call recorded exactly), score them (old/ref log-probs, values, teacher
hidden states under the arm's layout, GAE), then `ppo_epochs` x `minibatches` optimiser
steps. Arms: `ppo` (no teacher), `persistent` (teacher scores the flattened persistent
history: the matched control), `memopd` (teacher scores the restored aligned calls).

Everything random is a pure function of (seed, step, rank): task sampling, the
sampler's seeds and the minibatch shuffles. So a resumed run only needs the weights,
optimiser and scheduler state, and continues with exactly the next steps of an
uninterrupted run. Checkpoints: RUN_DIR/checkpoints/step_N/{actor,critic}/ (+ "latest").
Metrics: RUN_DIR/metrics.jsonl (one line per step; eval lines carry "eval/..." keys),
and with `tensorboard=true` the same scalars as TensorBoard events under RUN_DIR/tb.
"""
from __future__ import annotations

import copy
import json
import os
import random
import time
from typing import Callable

import torch
import yaml

from .backend import init_distributed, make_backend
from .config import TrainConfig
from .modules import Actor, Critic, register_zero3_external_params
from .update import max_over_ranks, score, update

__all__ = ["Trainer", "train"]


def _mix(*xs: int) -> int:
    """A deterministic 31-bit seed from integers (no Python hash randomisation)."""
    h = 1469598103934665603
    for x in xs:
        h = ((h ^ (int(x) & 0xFFFFFFFFFFFF)) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h & 0x7FFFFFFF


def _set_seed(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def _peak_context(trajs) -> int:
    return max((len(inv.prefix_ids) + len(inv.context_ids) for tr in trajs for inv in tr.invocations), default=0)


class Trainer:
    """Holds the models, backends and environment of one run."""

    def __init__(self, cfg: TrainConfig, *, student_lm, teacher_lm, env, world, log: Callable[[str], None] = print):
        self.cfg = cfg
        self.env = env
        self.world = world
        self.log = log
        if cfg.cpu_threads > 0 and not torch.cuda.is_available():
            # per-op threading overhead dominates for tiny models, and oversubscribed
            # cores (other processes, other ranks) make it far worse
            torch.set_num_threads(cfg.cpu_threads)
        self.info = init_distributed()
        self.rank = self.info.rank
        self.world_size = self.info.world_size
        ds = cfg.deepspeed or None
        self.ref_lm = copy.deepcopy(student_lm).eval().requires_grad_(False) if cfg.kl_coef > 0 else None
        self.teacher_lm = teacher_lm.eval().requires_grad_(False) if (teacher_lm is not None and cfg.arm != "ppo") else None
        actor = Actor(student_lm)
        critic = Critic(copy.deepcopy(student_lm))
        self._views = None
        if ds and _zero_stage(ds) == 3:
            # plain replicas for rollouts and no-grad scoring, refreshed every step: ranks
            # make different numbers of those forwards, and ZeRO-3's per-forward gathers
            # would deadlock (see TrainBackend.copy_weights_to)
            self._views = (copy.deepcopy(actor).requires_grad_(False), copy.deepcopy(critic).requires_grad_(False))
            register_zero3_external_params(actor)
        total = cfg.steps * cfg.ppo_epochs * cfg.minibatches
        self.actor = make_backend(actor, lr=cfg.actor_lr, warmup_steps=cfg.warmup_steps, total_steps=total,
                                  max_grad_norm=cfg.max_grad_norm, deepspeed_config=ds)
        self.critic = make_backend(critic, lr=cfg.critic_lr, warmup_steps=cfg.warmup_steps, total_steps=total,
                                   max_grad_norm=cfg.max_grad_norm, deepspeed_config=ds)
        dev = self.actor.device
        for m in (self.ref_lm, self.teacher_lm, *(self._views or ())):
            if m is not None:
                m.to(dev)
        self.step = 0
        self._tb = None  # TensorBoard writer, opened on first use (rank 0)

    def inference_modules(self):
        """(actor, critic) holding the current weights, for no-grad forwards that ranks
        run independently. Collective under ZeRO-3 (call on every rank)."""
        if self._views is None:
            return self.actor.unwrapped, self.critic.unwrapped
        self.actor.copy_weights_to(self._views[0])
        self.critic.copy_weights_to(self._views[1])
        return self._views

    # ---- paths ---------------------------------------------------------------------
    @property
    def ckpt_root(self) -> str:
        return os.path.join(self.cfg.run_dir, "checkpoints")

    @property
    def metrics_path(self) -> str:
        return os.path.join(self.cfg.run_dir, "metrics.jsonl")

    # ---- one step ------------------------------------------------------------------
    def rollout(self, step: int, actor: Actor):
        """This rank's episodes of `step`, sampled from `actor` (a no-grad module)."""
        from memopd.env.rollout import HFEngine, rollout

        cfg = self.cfg
        k = cfg.train_k[step % len(cfg.train_k)]
        tasks = self.world.sample_tasks(k, cfg.tasks_per_step, split="train", seed=_mix(cfg.seed, step, self.rank))
        lm = actor.lm
        lm.eval()
        engine = HFEngine(lm, pad_id=self.env.tokens.pad)
        with torch.no_grad():
            trajs = rollout(self.env, engine, tasks, group_size=cfg.group_size, temperature=cfg.temperature,
                            top_p=cfg.top_p, seed=_mix(cfg.seed, step, self.rank, 1), group_prefix=f"s{step}r{self.rank}-")
        return trajs, k

    def train_step(self, step: int) -> dict:
        cfg = self.cfg
        t0 = time.time()
        actor, critic = self.inference_modules()
        actor.eval()
        critic.eval()
        trajs, k = self.rollout(step, actor)
        t_roll = time.time() - t0
        teacher_layout = {"ppo": None, "persistent": "flatten", "memopd": "aligned"}[cfg.arm]
        scored = score(actor, critic, self.ref_lm, self.teacher_lm, trajs,
                       teacher_layout=teacher_layout, max_tokens=cfg.max_tokens, kl_coef=cfg.kl_coef,
                       gamma=cfg.gamma, lam=cfg.lam, action_domain=cfg.action_domain)
        self.actor.train()
        self.critic.train()
        gen = torch.Generator().manual_seed(_mix(cfg.seed, step, self.rank, 2))
        tw = None
        if self.teacher_lm is not None:
            tw = self.teacher_lm.get_output_embeddings().weight.detach()
        stats = update(self.actor, self.critic, trajs, scored, teacher_weight=tw, ppo_epochs=cfg.ppo_epochs,
                       minibatches=cfg.minibatches, max_tokens=cfg.max_tokens, clip_eps=cfg.clip_eps,
                       value_clip=cfg.value_clip, entropy_coef=cfg.entropy_coef, opd_coef=cfg.opd_coef,
                       generator=gen, action_domain=cfg.action_domain)
        # rollout statistics over all ranks' episodes
        sums = torch.tensor([
            len(trajs), sum(float(tr.reward) for tr in trajs),
            sum(float(tr.rewards.get("em_mean", float("nan"))) for tr in trajs),
            sum(float(tr.rewards.get("f1_mean", float("nan"))) for tr in trajs),
            sum(len(tr) for tr in trajs), int(scored.is_sampled.sum()), int((~scored.is_sampled).sum()),
            float(scored.kl_penalty.sum()),
        ], dtype=torch.float64)
        n, r_sum, em_sum, f1_sum, calls, n_act, n_copies, pen_sum = self.actor.all_reduce_sum(sums).tolist()
        m = {
            "step": step + 1,
            "rollout/k": k,
            "rollout/episodes": int(n),
            "rollout/reward_mean": r_sum / n,
            "rollout/em_mean": em_sum / n,
            "rollout/f1_mean": f1_sum / n,
            "rollout/calls_mean": calls / n,
            "rollout/peak_context": max_over_ranks(_peak_context(trajs), self.world_size, self.actor.device),
            "rollout/action_tokens": int(n_act),
            "train/context_copies": int(n_copies),
            "rce/max_dlogp_vs_sampling": max_over_ranks(scored.sample_dlogp, self.world_size, self.actor.device),
            "train/kl_penalty_mean": pen_sum / max(n_act + n_copies, 1.0),
            "train/lr": self.actor.lr(),
            **{f"train/{k2}": v for k2, v in stats.items()},
            "time/rollout_s": round(t_roll, 3),
            "time/step_s": round(time.time() - t0, 3),
        }
        return m

    # ---- checkpoints ---------------------------------------------------------------
    def save(self, step: int) -> str:
        path = os.path.join(self.ckpt_root, f"step_{step}")
        client = {"step": step, "config": self.cfg.to_dict()}
        self.actor.save_checkpoint(os.path.join(path, "actor"), client_state=client)
        self.critic.save_checkpoint(os.path.join(path, "critic"), client_state=client)
        self.actor.barrier()
        if self.rank == 0:
            with open(os.path.join(self.ckpt_root, "latest"), "w") as f:
                f.write(f"step_{step}\n")
        self.actor.barrier()
        return path

    def latest_checkpoint(self) -> str | None:
        p = os.path.join(self.ckpt_root, "latest")
        if not os.path.exists(p):
            return None
        with open(p) as f:
            name = f.read().strip()
        path = os.path.join(self.ckpt_root, name)
        return path if os.path.isdir(path) else None

    def resume(self) -> int:
        path = self.latest_checkpoint()
        if path is None:
            self.log(f"no checkpoint under {self.ckpt_root}: starting from step 0")
            return 0
        client = self.actor.load_checkpoint(os.path.join(path, "actor")) or {}
        self.critic.load_checkpoint(os.path.join(path, "critic"))
        step = int(client.get("step", 0))
        if self.rank == 0 and os.path.exists(self.metrics_path):
            # drop lines written after the checkpoint, so the file matches an uninterrupted run
            with open(self.metrics_path) as f:
                lines = [ln for ln in f if ln.strip() and json.loads(ln).get("step", 0) <= step]
            with open(self.metrics_path, "w") as f:
                f.writelines(lines)
        self.log(f"resumed from {path} (step {step})")
        return step

    def write_metrics(self, m: dict) -> None:
        if self.rank != 0:
            return
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(m) + "\n")
        if self.cfg.tensorboard:
            tb = self._tb_writer()
            for key, v in m.items():
                if key != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    tb.add_scalar(key, v, global_step=int(m["step"]))
            tb.flush()

    def _tb_writer(self):
        if self._tb is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ImportError("tensorboard=true needs the tensorboard package: "
                                  "pip install 'memopd[plot]' (or pip install tensorboard)") from e
            # purge_step: a resumed run replaces the events written after its checkpoint
            self._tb = SummaryWriter(os.path.join(self.cfg.run_dir, "tb"), purge_step=self.step + 1)
        return self._tb

    # ---- the run -------------------------------------------------------------------
    def fit(self, *, resume: bool = False, evaluate: Callable[[int], dict] | None = None,
            stop_after: int | None = None) -> list[dict]:
        cfg = self.cfg
        os.makedirs(cfg.run_dir, exist_ok=True)
        if self.rank == 0:
            with open(os.path.join(cfg.run_dir, "config.yaml"), "w") as f:
                yaml.safe_dump(cfg.to_dict(), f, sort_keys=False)
        start = self.resume() if resume else 0
        self.step = start
        if cfg.tensorboard and self.rank == 0:
            self._tb_writer()  # fail early if tensorboard is missing, before any step
        if not resume and self.rank == 0 and os.path.exists(self.metrics_path):
            os.remove(self.metrics_path)
        history = []
        bar = None
        if cfg.progress and self.rank == 0:
            from tqdm.auto import tqdm

            bar = tqdm(total=cfg.steps, initial=start, desc=f"train[{cfg.arm}]", unit="step")
        for step in range(start, cfg.steps):
            if stop_after is not None and step >= stop_after:
                break
            m = self.train_step(step)
            if evaluate is not None and cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < cfg.steps:
                m.update(evaluate(step + 1))
            self.write_metrics(m)
            history.append(m)
            if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0:
                self.save(step + 1)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(reward=f"{m['rollout/reward_mean']:.3f}", kl=f"{m['train/kl_teacher']:.3f}")
        if bar is not None:
            bar.close()
        if self._tb is not None:
            self._tb.flush()
        return history

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def _zero_stage(ds) -> int:
    if isinstance(ds, str):
        with open(ds) as f:
            ds = json.load(f)
    return int(ds.get("zero_optimization", {}).get("stage", 0))


def _load_lm(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)


def prepare(cfg: TrainConfig, log: Callable[[str], None] = print):
    """Models and environment of a run: SFT'd defaults from the cache unless given."""
    from memopd.env.qa import EnvConfig, QAEnv
    from memopd.env.sft import read_env_meta, run_sft
    from memopd.env.tokenizer import load_tokenizer
    from memopd.env.world import World, WorldConfig

    info = init_distributed()
    sft_dir = os.path.join(cfg.cache_dir, "sft")
    need = [r for r, given in (("student", cfg.student), ("teacher", cfg.teacher)) if not given]
    if cfg.arm == "ppo" and "teacher" in need and cfg.student:
        need.remove("teacher")
    if need:
        if info.rank == 0:
            run_sft(sft_dir, roles=need, world_config=WorldConfig(seed=cfg.world_seed), progress=cfg.progress, log=log)
        if info.world_size > 1:
            import torch.distributed as dist

            dist.barrier()
    student_dir = cfg.student or os.path.join(sft_dir, "student")
    teacher_dir = cfg.teacher or os.path.join(sft_dir, "teacher")
    meta = read_env_meta(student_dir)
    world = World.generate(WorldConfig.from_json(meta["world"]))
    tokenizer = load_tokenizer(student_dir)
    env_kw = dict(meta.get("env", {}))
    env_kw["policy"] = cfg.policy
    env = QAEnv.from_world(world, tokenizer, EnvConfig(**env_kw))
    student = _load_lm(student_dir)
    teacher = _load_lm(teacher_dir) if cfg.arm != "ppo" else None
    return student, teacher, env, world, tokenizer, student_dir, teacher_dir


def _save_agent(trainer: "Trainer", tokenizer, student_dir: str, out_dir: str) -> None:
    """The current actor as a normal HF checkpoint dir that `memopd eval` can load."""
    from memopd.env.sft import ENV_META_FILE

    actor, _ = trainer.inference_modules()  # collective under ZeRO-3
    if trainer.rank != 0:
        return
    lm = actor.lm
    lm.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    with open(os.path.join(student_dir, ENV_META_FILE)) as f:
        meta = json.load(f)
    meta["env"]["policy"] = trainer.cfg.policy
    meta["role"] = f"student+{trainer.cfg.arm}"
    with open(os.path.join(out_dir, ENV_META_FILE), "w") as f:
        json.dump(meta, f, indent=2)


def train(cfg: TrainConfig, *, resume: bool = False, log: Callable[[str], None] = print) -> dict:
    """The whole job: prepare, fit, evaluate on held-out Q-k sets, save the final model."""
    from memopd.env.evaluate import evaluate as evaluate_dir
    from memopd.env.evaluate import format_table

    t0 = time.time()
    cpu0 = time.process_time()
    _set_seed(cfg.seed)
    student, teacher, env, world, tokenizer, student_dir, teacher_dir = prepare(cfg, log)
    trainer = Trainer(cfg, student_lm=student, teacher_lm=teacher, env=env, world=world, log=log)

    def evaluate(step: int) -> dict:
        d = os.path.join(cfg.run_dir, "eval_model")
        _save_agent(trainer, tokenizer, student_dir, d)
        res = evaluate_dir(d, ks=cfg.eval_k, n=cfg.eval_tasks) if trainer.rank == 0 else {"results": {}}
        return {f"eval/{k}": v for k, v in _flatten_eval(res["results"]).items()}

    history = trainer.fit(resume=resume, evaluate=evaluate)
    report: dict = {"arm": cfg.arm, "run_dir": cfg.run_dir, "steps": cfg.steps, "student": student_dir,
                    "teacher": teacher_dir if cfg.arm != "ppo" else None}
    final_dir = os.path.join(cfg.run_dir, "final")
    _save_agent(trainer, tokenizer, student_dir, final_dir)
    report["final_model"] = final_dir
    if trainer.rank == 0:
        final = evaluate_dir(final_dir, ks=cfg.eval_k, n=cfg.eval_tasks)
        trainer.write_metrics({"step": cfg.steps, **{f"eval/{k}": v for k, v in _flatten_eval(final["results"]).items()}})
        report["eval"] = final["results"]
        log(f"\nfinal evaluation of the {cfg.arm} student after {cfg.steps} steps (held-out sets, greedy):")
        log(format_table(final))
    trainer.close()
    report["wall_s"] = round(time.time() - t0, 1)
    report["cpu_s"] = round(time.process_time() - cpu0, 1)
    report["last_step"] = history[-1] if history else None
    if trainer.rank == 0:
        with open(os.path.join(cfg.run_dir, "report.json"), "w") as f:
            json.dump(report, f, indent=2, default=str)
        log(f"run directory: {os.path.abspath(cfg.run_dir)}  (metrics.jsonl, report.json, final/, checkpoints/)")
    return report


def _flatten_eval(res: dict) -> dict:
    """{"Q2": {"em_mean": .., ...}, ...} -> {"em_mean_q2": .., ...} for metrics lines."""
    out = {}
    for qk, row in res.items():
        if isinstance(row, dict):
            for name, v in row.items():
                if isinstance(v, (int, float)):
                    out[f"{name}_{qk.lower()}"] = v
    return out
