"""The training loop: rollouts -> scoring -> PPO + OPD update, with run management.

`Trainer` runs the steps of docs/design.md §7.2 for one arm (§7.1): sample question
sets, roll them out with the student, score, update, then log metrics (§7.7), checkpoint
and evaluate. Everything random is a pure function of (seed, step, rank), so a resumed
run continues exactly as an uninterrupted one. `prepare` / `train` build the models,
environment and run directory from a `TrainConfig`; the run-directory rules are in
rundir.py and the README ("Run directories").
"""
from __future__ import annotations

import copy
import json
import os
import random
import time
from collections.abc import Collection
from typing import TYPE_CHECKING, Callable

import torch

from memopd.hf import head_of

from .backend import make_backend
from .collectives import barrier, init_distributed
from .config import ConfigError, TrainConfig, as_stored, check_requirements, check_user_data, comparable_config
from .device import place_model, resolve_device, resolve_dtype
from .modules import Actor, Critic, Scoring, register_zero3_external_params
from .stats import KL_TEACHER, train_metric
from .update import UpdateSettings, score, update

if TYPE_CHECKING:
    from memopd.env.build import EnvironmentBundle
    from memopd.env.rollout import Environment, TaskSource

__all__ = ["Trainer", "train", "prepare", "sft_cache_dir", "evaluation_settings", "set_seed"]


def _mix(*xs: int) -> int:
    """A deterministic 31-bit seed from integers (no Python hash randomisation)."""
    h = 1469598103934665603
    for x in xs:
        h = ((h ^ (int(x) & 0xFFFFFFFFFFFF)) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h & 0x7FFFFFFF


def set_seed(seed: int) -> None:
    """Seed Python's and torch's generators (a run's first act, before its models are built)."""
    random.seed(seed)
    torch.manual_seed(seed)


def _peak_context(trajs) -> int:
    return max((len(inv.prefix_ids) + len(inv.context_ids) for tr in trajs for inv in tr.invocations), default=0)


def _teacher_context_peak(trajs, layout: str | None) -> int:
    """The longest sequence the teacher reads in one scoring forward: one call
    `[q, x_t, a_t]` under `aligned`, a whole history `[q, x_0, a_0, ...]` under `flatten`
    (the cost the persistent control pays, docs/design.md §2.4); 0 without a teacher."""
    if layout is None:
        return 0
    if layout == "flatten":
        return max((tr.flattened_tokens for tr in trajs), default=0)
    return max((len(inv.input_ids) for tr in trajs for inv in tr.invocations), default=0)


class Trainer:
    """Holds the models, backends and environment of one run.

    `env` is the `memopd.env.rollout.Environment` the episodes run in; `tasks` is the
    `TaskSource` each step's task sets are drawn from (a `World` or `UserTasks` for QA)."""

    def __init__(self, cfg: TrainConfig, *, student_lm, teacher_lm, env: "Environment", tasks: "TaskSource",
                 log: Callable[[str], None] = print):
        self.cfg = cfg
        self.env = env
        self.tasks = tasks
        self.log = log
        if cfg.cpu_threads > 0 and not torch.cuda.is_available():
            # per-op threading overhead dominates for tiny models, and oversubscribed
            # cores (other processes, other ranks) make it far worse
            torch.set_num_threads(cfg.cpu_threads)
        self.info = init_distributed()
        self.rank = self.info.rank
        self.world_size = self.info.world_size
        ds = cfg.deepspeed or None
        from memopd.teacher_client import ServedTeacher

        # a served teacher (teacher_url=) is no module here: only its lm_head comes into memory
        self.served_teacher = teacher_lm if isinstance(teacher_lm, ServedTeacher) and cfg.arm_spec.uses_teacher else None
        if self.served_teacher is not None:
            self.teacher_lm = self.served_teacher
        else:
            self.teacher_lm = teacher_lm.eval().requires_grad_(False) if (teacher_lm is not None and cfg.arm_spec.uses_teacher) else None
        # measured before any copy or wrapper: every copy inherits the measured scale, and
        # no probe forward ever runs inside a ZeRO-3 engine
        if self.teacher_lm is not None and self.served_teacher is None:
            head_of(self.teacher_lm)
        head_of(student_lm)
        # cfg.device / cfg.dtype (trainer/device.py), before any copy: the reference and
        # the critic are copies of the placed student; DeepSpeed moves models itself
        self.device = resolve_device(cfg.device, local_rank=self.info.local_rank, deepspeed=bool(ds))
        dtype = resolve_dtype(cfg.dtype)
        for m in (student_lm, None if self.served_teacher is not None else self.teacher_lm):
            place_model(m, None if ds else self.device, dtype)
        self.scoring = Scoring(cfg.temperature, resolve_vocab_size(cfg, env, student_lm, self.teacher_lm))
        self._served_head = None
        if self.served_teacher is not None:  # shapes and vocabulary checked at connect, before any step
            self.served_teacher.check(self.scoring.vocab_size)
        if self.served_teacher is not None and not cfg.teacher_topk:  # the full-vocabulary KL needs the head
            h = self.served_teacher.lm_head()
            self._served_head = type(h)(h.weight.to(self.device, dtype), None if h.bias is None else h.bias.to(self.device, dtype),
                                        h.scale)
        self.ref_lm = copy.deepcopy(student_lm).eval().requires_grad_(False) if cfg.ppo.ref_kl_coef > 0 else None
        actor = Actor(student_lm, scoring=self.scoring)
        critic = Critic(copy.deepcopy(student_lm)).to(next(student_lm.parameters()).device)  # value head beside the body
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
        for m in (self.ref_lm, None if self.served_teacher is not None else self.teacher_lm, *(self._views or ())):
            if m is not None:
                m.to(dev)
        self.step = 0
        self._tb = None  # TensorBoard writer, opened on first use (rank 0)
        # {role: model dir} the run trains from; set by `train`. Checkpoints record their
        # weights' fingerprints, and --resume refuses other weights (rundir.py)
        self.model_dirs: dict[str, str | None] | None = None
        self._fingerprints: dict | None = None
        self._vllm = None  # the vLLM engine (rollout_engine=vllm), started on first use

    @property
    def teacher_head(self):
        """The teacher's head (weight, bias, measured logit scale), or None without a teacher."""
        if self.served_teacher is not None:  # None in top-k mode: the head stays on the server
            return self._served_head
        return head_of(self.teacher_lm) if self.teacher_lm is not None else None

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
        tasks = self.tasks.sample_tasks(k, cfg.tasks_per_step, split="train", seed=_mix(cfg.seed, step, self.rank))
        lm = actor.lm
        lm.eval()
        if cfg.rollout_engine == "vllm":
            engine = self.vllm_engine(lm)  # started once; the current weights loaded in place each step
        else:
            engine = HFEngine(lm, pad_id=self.env.tokens.pad, vocab_size=self.scoring.vocab_size)
        with torch.no_grad():
            trajs = rollout(self.env, engine, tasks, group_size=cfg.group_size, temperature=cfg.temperature,
                            top_p=cfg.top_p, seed=_mix(cfg.seed, step, self.rank, 1), group_prefix=f"s{step}r{self.rank}-")
        return trajs, k

    def vllm_engine(self, lm):
        """The run's `memopd.env.vllm_engine.VLLMEngine`, started on first use from `lm`, and
        given `lm`'s current weights (in place, no restart) whenever they changed."""
        from memopd.env.vllm_engine import VLLMEngine

        cfg = self.cfg
        if self._vllm is None:
            self._vllm = VLLMEngine.from_model(
                lm, vocab_size=self.scoring.vocab_size, gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
                max_model_len=cfg.vllm_max_model_len or None, enforce_eager=cfg.vllm_enforce_eager)
        else:
            self._vllm.sync_weights(lm)
        return self._vllm

    def mismatch_metrics(self, scored) -> dict:
        """The sampler-vs-trainer log-prob mismatch of this step's rollouts, over all ranks."""
        from memopd.rce import mismatch_figures, mismatch_sums

        out = {}
        pairs = [("mismatch", scored.logp_old)]
        if scored.logp_flatten is not None:
            pairs.append(("mismatch_flatten", scored.logp_flatten))
        for prefix, logp in pairs:
            sums = mismatch_sums(logp, scored.sample_logprobs, self.cfg.mismatch_threshold)
            mx = self.actor.all_reduce_max(sums.pop("abs_max"))
            g = dict(zip(sums, self.actor.all_reduce_sum(torch.tensor(list(sums.values()), dtype=torch.float64)).tolist()))
            out.update(mismatch_figures({**g, "abs_max": mx}, prefix))
        return out

    def train_step(self, step: int) -> dict:
        cfg = self.cfg
        t0 = time.time()
        actor, critic = self.inference_modules()
        actor.eval()
        critic.eval()
        trajs, k = self.rollout(step, actor)
        t_roll = time.time() - t0
        teacher_layout = cfg.teacher_layout
        scored = score(actor, critic, self.ref_lm, self.teacher_lm, trajs,
                       teacher_layout=teacher_layout, max_tokens=cfg.max_tokens, ppo=cfg.ppo,
                       action_domain=cfg.action_domain, layout=cfg.pack_layout,
                       flatten_logp=cfg.mismatch_flatten, teacher_topk=cfg.teacher_topk)
        self.actor.train()
        self.critic.train()
        gen = torch.Generator().manual_seed(_mix(cfg.seed, step, self.rank, 2))
        stats = update(self.actor, self.critic, trajs, scored, UpdateSettings.from_config(cfg),
                       teacher_head=self.teacher_head, generator=gen)
        # rollout statistics over all ranks' episodes
        local = {
            "episodes": len(trajs), "reward": sum(float(tr.reward) for tr in trajs),
            "em": sum(float(tr.rewards.get("em_mean", float("nan"))) for tr in trajs),
            "f1": sum(float(tr.rewards.get("f1_mean", float("nan"))) for tr in trajs),
            "calls": sum(len(tr) for tr in trajs), "actions": int(scored.is_sampled.sum()),
            "call_tokens": sum(len(inv.input_ids) for tr in trajs for inv in tr.invocations),
            "copies": int((~scored.is_sampled).sum()), "penalty": float(scored.kl_penalty.sum()),
        }
        g = dict(zip(local, self.actor.all_reduce_sum(torch.tensor(list(local.values()), dtype=torch.float64)).tolist()))
        n, n_act, n_copies = g["episodes"], g["actions"], g["copies"]
        m = {
            "step": step + 1,
            "rollout/k": k,
            "rollout/episodes": int(n),
            "rollout/reward_mean": g["reward"] / n,
            "rollout/em_mean": g["em"] / n,
            "rollout/f1_mean": g["f1"] / n,
            "rollout/calls_mean": g["calls"] / n,
            "rollout/peak_context": self.actor.all_reduce_max(_peak_context(trajs)),
            # per call |q| + |x_t| + |a_t|: what the student attends over when it acts
            "rollout/call_tokens_mean": g["call_tokens"] / max(g["calls"], 1.0),
            "train/teacher_context_peak": self.actor.all_reduce_max(_teacher_context_peak(trajs, teacher_layout)),
            "rollout/action_tokens": int(n_act),
            "train/context_copies": int(n_copies),
            "rce/max_dlogp_vs_sampling": self.actor.all_reduce_max(scored.sample_dlogp),
            **self.mismatch_metrics(scored),
            "train/kl_penalty_mean": g["penalty"] / max(n_act + n_copies, 1.0),
            "train/lr": self.actor.lr(),
            **{train_metric(k2): v for k2, v in stats.items()},
            "time/rollout_s": round(t_roll, 3),
            "time/step_s": round(time.time() - t0, 3),
        }
        return m

    # ---- checkpoints ---------------------------------------------------------------
    def save(self, step: int) -> str:
        """Collective: checkpoints/step_N/{actor,critic}; once every rank's files are down
        (barrier), rank 0 writes the manifest that makes it complete, then `latest`."""
        from memopd.files import atomic_write_text, write_manifest

        from .rundir import checkpoint_write, clear_checkpoint_dir

        # an OS write failure: one line saying which checkpoint is complete, no partial step_N
        with checkpoint_write(self.ckpt_root, step) as path:
            if self.rank == 0:
                clear_checkpoint_dir(path)  # an unfinished or damaged copy from an earlier attempt
            self.actor.barrier()
            client = {"step": step, "config": self.cfg.to_dict()}
            self.actor.save_checkpoint(os.path.join(path, "actor"), client_state=client)
            self.critic.save_checkpoint(os.path.join(path, "critic"), client_state=client)
            self.actor.barrier()
            if self.rank == 0:
                write_manifest(path, step=step, config=self.cfg.to_dict(), device=str(self.actor.device),
                               **self._models_record())
                atomic_write_text(os.path.join(self.ckpt_root, "latest"), f"step_{step}\n")
        self.actor.barrier()
        return path

    def _models_record(self) -> dict:
        """{"models": fingerprints} for a checkpoint manifest, hashed once per run."""
        if self.model_dirs is None:
            return {}
        if self._fingerprints is None:
            from .rundir import model_fingerprints

            self._fingerprints = model_fingerprints(self.model_dirs)
        if self.served_teacher is not None:  # the server's fingerprint of its weight files
            return {"models": {**self._fingerprints, "teacher": self.served_teacher.fingerprint}}
        return {"models": self._fingerprints}

    def latest_checkpoint(self) -> str | None:
        """The newest complete checkpoint (its manifest verifies), or None."""
        from .rundir import newest_complete_checkpoint

        found, _ = newest_complete_checkpoint(self.ckpt_root)
        return found[1] if found else None

    def resume(self) -> int:
        """Load the newest complete checkpoint and cut metrics.jsonl back to its step.

        Newer checkpoints that are unfinished or fail their manifest are skipped (the log
        says which and why). Without a usable checkpoint the run starts at step 0 with a
        fresh metrics.jsonl. Rank 0 chooses; every rank loads the same checkpoint."""
        from memopd.errors import RunDirError
        from memopd.files import atomic_write_text

        from .rundir import newest_complete_checkpoint, rank0_decides, truncate_metrics

        def choose() -> int:
            found, skipped = newest_complete_checkpoint(self.ckpt_root)
            for name, why in skipped:
                self.log(f"resume: skipping checkpoint {name}: {why}")
            if found is None:
                self.log(f"resume: no complete checkpoint under {self.ckpt_root}: starting from step 0 "
                         f"with a fresh {self.metrics_path}")
                if os.path.exists(self.metrics_path):
                    os.remove(self.metrics_path)
                return 0
            if found[0] > self.cfg.steps:
                raise RunDirError(f"--resume: the newest complete checkpoint {found[1]} is past steps="
                                  f"{self.cfg.steps}; resume with steps>={found[0]}, or pass --overwrite to start over")
            if self.model_dirs is not None:
                from memopd.files import read_manifest

                from .rundir import check_model_fingerprints, check_served_teacher

                stored = (read_manifest(found[1]) or {}).get("models")
                self._fingerprints = check_model_fingerprints(stored, self.model_dirs, found[1])
                if self.served_teacher is not None:
                    check_served_teacher(stored, self.served_teacher.fingerprint, found[1])
            return found[0]

        step = rank0_decides(choose, self.rank, self.world_size)
        if step == 0:
            return 0
        path = os.path.join(self.ckpt_root, f"step_{step}")
        client = self.actor.load_checkpoint(os.path.join(path, "actor")) or {}
        self.critic.load_checkpoint(os.path.join(path, "critic"))
        if int(client.get("step", step)) != step:
            raise RuntimeError(f"{path}: its client state is of step {client.get('step')}")
        if self.rank == 0:
            # drop lines written after the checkpoint, so the file matches an uninterrupted run
            truncate_metrics(self.metrics_path, step, self.log)
            atomic_write_text(os.path.join(self.ckpt_root, "latest"), f"step_{step}\n")
        self.log(f"resumed from {path} (step {step})")
        self._say_device_change(path)
        return step

    def _say_device_change(self, path: str) -> None:
        """Log a resume onto another device than the checkpoint's (a CPU run resumed on a GPU,
        or back; also under device=auto on another host): allowed, but not bit for bit."""
        from .rundir import read_manifest

        then, now = (read_manifest(path) or {}).get("device"), str(self.actor.device)
        if isinstance(then, str) and then != now:
            self.log(f"resume: checkpoint {os.path.basename(path)} was trained on {then}, this run continues on "
                     f"{now}: weights and optimiser state were loaded onto {now}, and the steps from here on are "
                     f"computed there (its kernels and rounding), not bit for bit what {then} would give")

    def write_metrics(self, m: dict) -> None:
        if self.rank != 0:
            return
        from memopd.files import guarded_write

        with guarded_write(f"the metrics of step {m['step']}", self.metrics_path,
                           "the earlier steps' lines are intact (--resume drops a partial last line)",
                           "run with --resume"), open(self.metrics_path, "a") as f:  # one line per append
            f.write(json.dumps(m) + "\n")
            f.flush()
            os.fsync(f.fileno())  # durable before the checkpoint of this step is
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
            stop_after: int | None = None, overwrite: bool = False, run=None) -> list[dict]:
        """Train steps [start, cfg.steps): start is 0, or the resumed checkpoint's step.

        `run`: the `rundir.RunDir` that `train` opened (locked, checked, config.yaml
        written). Without it, fit opens the run directory itself (same checks: a used
        directory needs `resume` or `overwrite`) and releases it when it returns."""
        from .rundir import RunDir

        cfg = self.cfg
        owned = run is None
        if owned:
            run = RunDir.open(cfg.to_dict(), resume=resume, overwrite=overwrite, rank=self.rank,
                              world_size=self.world_size, defaults=TrainConfig().to_dict(), log=self.log,
                              comparable=comparable_config)
        try:
            return self._fit_steps(resume, evaluate, stop_after)
        finally:
            if owned:
                run.close()

    def _fit_steps(self, resume: bool, evaluate, stop_after) -> list[dict]:
        cfg = self.cfg
        start = self.resume() if resume else 0
        self.step = start
        if cfg.tensorboard and self.rank == 0:
            self._tb_writer()  # fail early if tensorboard is missing, before any step
        history = []
        if evaluate is not None and start == 0:
            # the starting point on the same held-out sets: the baseline of the final
            # scores, and the first point of every eval curve (also with eval_every=0)
            self.write_metrics({"step": 0, **evaluate(0)})
        bar = None
        if cfg.progress and self.rank == 0:
            from memopd.progress import progress_bar

            bar = progress_bar(cfg.steps, f"train[{cfg.arm}]", unit="step", initial=start)
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
                # the postfix first: a logged progress line then shows this step's figures
                bar.set_postfix(reward=f"{m['rollout/reward_mean']:.3f}", kl=f"{m[train_metric(KL_TEACHER)]:.3f}")
                bar.update(1)
        if bar is not None:
            bar.close()
        if self._tb is not None:
            self._tb.flush()
        return history

    def close(self) -> None:
        if self.served_teacher is not None:
            self.served_teacher.close()
        if self._vllm is not None:
            self._vllm.close()
            self._vllm = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def resolve_vocab_size(cfg: TrainConfig, env, student_lm, teacher_lm=None) -> int:
    """The ids sampled and scored: `cfg.vocab_size`, else the environment tokenizer's
    size, else the student head's rows; every head present must have that many rows."""
    rows = {"student": int(student_lm.get_output_embeddings().weight.shape[0])}
    if teacher_lm is not None:  # a served teacher reports its head's rows
        rows["teacher"] = int(getattr(teacher_lm, "head_rows", None) or teacher_lm.get_output_embeddings().weight.shape[0])
    tok = getattr(env, "tokenizer", None)
    v = cfg.vocab_size or (len(tok) if tok is not None else rows["student"])
    short = {k: r for k, r in rows.items() if r < v}
    if short:
        raise ConfigError(
            f"vocab_size={v} ({'set in the config' if cfg.vocab_size else 'the tokenizer size'}) exceeds the "
            + ", ".join(f"{k} lm_head's {r} rows" for k, r in short.items())
            + ": every id the tokenizer can produce needs a row in both heads")
    return v


def _zero_stage(ds) -> int:
    from .deepspeed_config import load_deepspeed_config  # the bundled example configs resolve as in the backend

    return int(load_deepspeed_config(ds).get("zero_optimization", {}).get("stage", 0))


def sft_cache_dir(cfg: TrainConfig) -> str:
    """Where the default models of the run's environment are cached, under `cache_dir`
    (the QA world: `sft` for the default world, `sft-<preset>` otherwise)."""
    from memopd.env.build import env_kind

    return os.path.join(cfg.cache_dir, env_kind(cfg.env.kind).cache_name(cfg.env))


def evaluation_settings(cfg: TrainConfig) -> dict:
    """The held-out evaluation settings the environment's `evaluate` reads."""
    return {"ks": list(cfg.eval_k), "n": cfg.eval_tasks, "temperature": cfg.eval_temperature, "samples": cfg.eval_samples}


def prepare(cfg: TrainConfig, log: Callable[[str], None] = print) -> "EnvironmentBundle":
    """Models and environment of a run, as a `memopd.env.build.EnvironmentBundle`.

    Generated world: SFT'd defaults from the cache unless student/teacher are given (memopd
    checkpoints, with memopd_env.json); rank 0 builds missing ones, the others wait.
    Bring-your-own (corpus=/tasks=): any local HF causal LMs with their tokenizer on the
    user's corpus and question sets; the bundle's `tasks` is then a
    `memopd.env.qa.tasks.UserTasks` (the same `sample_tasks` interface as a `World`)."""
    from memopd.env.build import build_environment

    if cfg.env.user_data:
        check_user_data(cfg)
    info = init_distributed()
    return build_environment(cfg.env, student=cfg.student, teacher=cfg.teacher,
                             load_teacher=cfg.arm_spec.uses_teacher and not cfg.teacher_url,
                             sft_dir=sft_cache_dir(cfg), builds_sft=info.rank == 0, after_sft=barrier,
                             train_k=cfg.train_k, evaluation=evaluation_settings(cfg), progress=cfg.progress, log=log)


def _save_agent(trainer: "Trainer", bundle: "EnvironmentBundle", out_dir: str) -> None:
    """The current actor as a normal HF checkpoint dir with its tokenizer, and the
    environment's metadata (`bundle.save_meta`: for the QA world what `memopd eval` reads)."""
    from memopd.files import atomic_directory

    actor, _ = trainer.inference_modules()  # collective under ZeRO-3
    if trainer.rank != 0:
        return
    with atomic_directory(out_dir) as tmp:  # a kill mid-save never leaves a partial model behind
        actor.lm.save_pretrained(tmp)
        bundle.tokenizer.save_pretrained(tmp)
        if bundle.save_meta is not None:
            bundle.save_meta(tmp, f"student+{trainer.cfg.arm}")


def train(cfg: TrainConfig, *, resume: bool = False, overwrite: bool = False,
          log: Callable[[str], None] = print, asked: Collection[str] | None = None) -> dict:
    """The whole job: prepare, fit, evaluate on held-out Q-k sets, save the final model.

    Before anything is written, `check_requirements` checks the packages and files the
    config needs; a fresh run that fails before its first metrics line leaves the run
    directory unused. Before any model is loaded or trained, the run directory is opened (see
    trainer/rundir.py): every output location must be a writable directory, the
    directory is locked for this run, and a used one needs `resume` (same config up to
    the safe keys) or `overwrite` (its earlier outputs are deleted). `asked`: the config
    keys the user set (`TrainConfig.load_given`); on resume, a key added since the stored
    run was written that the user did not set takes the stored run's value, one the user
    did set is compared with it (None: a key at its default counts as unset)."""
    from .rundir import RunDir

    t0 = time.time()
    cpu0 = time.process_time()
    check_requirements(cfg)  # packages and files, before anything is written
    if resume:
        cfg = _as_stored_run(cfg, log, asked)
    info = init_distributed()
    # the SFT cache is written only when a default model is needed (as in `prepare`)
    sft_needed = not cfg.student or (not (cfg.teacher or cfg.teacher_url) and cfg.arm_spec.uses_teacher)
    extra = ((sft_cache_dir(cfg), "SFT cache directory"),) if sft_needed else ()
    run = RunDir.open(cfg.to_dict(), resume=resume, overwrite=overwrite, rank=info.rank, world_size=info.world_size,
                      extra_dirs=extra, defaults=TrainConfig().to_dict(), log=log, comparable=comparable_config)
    try:
        return _train_in(cfg, run, resume, log, t0, cpu0)
    except BaseException:
        if info.rank == 0 and not resume:
            _forget_unstarted_run(cfg.run_dir)
        raise
    finally:
        run.close()


def _as_stored_run(cfg: TrainConfig, log: Callable[[str], None], asked: Collection[str] | None) -> TrainConfig:
    """`cfg` with the values its stored run had for keys added since that the user did not
    set (`config.as_stored`; `asked`: the keys the user set, None to judge by defaults),
    read from the run directory's config.yaml; `cfg` itself when there is none to read."""
    import yaml

    try:
        with open(os.path.join(cfg.run_dir, "config.yaml")) as f:
            stored = yaml.safe_load(f)
    except (OSError, yaml.YAMLError):
        return cfg  # nothing stored, or unreadable: the run directory's own checks say so
    if not isinstance(stored, dict):
        return cfg
    cfg, taken = as_stored(cfg, stored, asked)
    for k in taken:
        log(f"resume: {cfg.run_dir}/config.yaml was written before {k} existed; the run continues with the "
            f"value it ran with, {k}={getattr(cfg, k)}")
    return cfg


def _forget_unstarted_run(run_dir: str) -> None:
    """A fresh run that failed before its first metrics line (a model that does not load,
    an SFT stage cut short, ...) wrote only its config.yaml: remove it, so that the same
    command is accepted once the problem is fixed instead of finding a 'used' directory.
    Anything more (metrics, a checkpoint) is a real run's output and stays for --resume."""
    from .rundir import clear_outputs, previous_outputs

    used = set(previous_outputs(run_dir))
    if used and used <= {"config.yaml", "tb"}:  # tb/ then holds no scalar yet: created before step 1
        try:
            clear_outputs(run_dir)
        except OSError:
            pass  # the original error matters more than this tidy-up


def _train_in(cfg: TrainConfig, run, resume: bool, log: Callable[[str], None], t0: float, cpu0: float) -> dict:
    """`train` inside its opened run directory `run`."""
    from memopd.env.build import env_kind
    from memopd.files import atomic_write_json

    set_seed(cfg.seed)
    served_lm = None
    if cfg.teacher_url and cfg.arm_spec.uses_teacher:  # the served teacher: connected before any model is loaded
        from memopd.teacher_client import ServedTeacher

        served_lm = ServedTeacher(cfg.teacher_url, secret_file=cfg.teacher_secret_file or None, timeout=cfg.teacher_timeout,
                                  retries=cfg.teacher_retries, transport=cfg.teacher_transport,
                                  head_dir=cfg.teacher_head_dir or None)
    try:
        bundle = prepare(cfg, log)
    except BaseException:
        if served_lm is not None:
            served_lm.close()
        raise
    student_dir, teacher_dir = bundle.student_dir, bundle.teacher_dir
    teacher_lm = bundle.teacher
    if served_lm is not None:
        teacher_lm, teacher_dir = served_lm, cfg.teacher_url
    trainer = Trainer(cfg, student_lm=bundle.student, teacher_lm=teacher_lm, env=bundle.env, tasks=bundle.tasks,
                      log=log)
    served = trainer.served_teacher is not None
    trainer.model_dirs = {"student": student_dir, "teacher": teacher_dir if trainer.teacher_lm is not None and not served else None,
                          "reference": student_dir if trainer.ref_lm is not None else None}
    record_run = env_kind(cfg.env.kind).record_run
    if trainer.rank == 0 and not resume and not (cfg.student and (cfg.teacher or served)) and record_run is not None:
        record_run(sft_cache_dir(cfg), cfg.run_dir, trainer._models_record().get("models", {}))  # retraining names it

    can_eval = bundle.evaluate is not None
    evaluate_saved = bundle.evaluate
    cached = bundle.baseline_key is not None and not cfg.student
    baseline_cache = _BaselineCache(bundle.baseline_key, student_dir) if cached else None
    baseline: dict = {}

    def evaluate(step: int) -> dict:
        res = baseline_cache.get() if (step == 0 and baseline_cache is not None and trainer.rank == 0) else None
        if res is None:
            d = os.path.join(cfg.run_dir, "eval_model")
            _save_agent(trainer, bundle, d)  # collective under ZeRO-3: every rank
            res = evaluate_saved(d)["results"] if trainer.rank == 0 else {}
            if step == 0 and baseline_cache is not None and trainer.rank == 0:
                baseline_cache.put(res)
        if step == 0:
            baseline.update(res)
        return {f"eval/{k}": v for k, v in _flatten_eval(res).items()}

    history = trainer.fit(resume=resume, evaluate=evaluate if can_eval else None, run=run)
    if can_eval and not baseline and trainer.rank == 0:  # resumed: the step-0 line of the earlier start
        baseline.update(_step0_eval(trainer.metrics_path))
    report: dict = {"arm": cfg.arm, "run_dir": cfg.run_dir, "steps": cfg.steps, "student": student_dir,
                    "teacher": teacher_dir if cfg.arm_spec.uses_teacher else None}
    final_dir = os.path.join(cfg.run_dir, "final")
    _save_agent(trainer, bundle, final_dir)
    report["final_model"] = final_dir
    if trainer.rank == 0 and not can_eval:
        report["eval"] = None
        log(bundle.no_evaluation)
    elif trainer.rank == 0:
        final = evaluate_saved(final_dir)
        trainer.write_metrics({"step": cfg.steps,
                               **{f"eval/{k}": v for k, v in _flatten_eval(final["results"]).items()}})
        report["eval"] = final["results"]
        report["baseline_eval"] = baseline or None
        decoding = ("greedy" if not cfg.eval_temperature else
                    f"temperature {cfg.eval_temperature:g}, {cfg.eval_samples} episode(s) per set")
        log(f"\nfinal evaluation of the {cfg.arm} student after {cfg.steps} steps (held-out sets, {decoding}):")
        log(final["table"])
        if baseline and bundle.compare is not None:
            log("\nthe starting student (step 0) against the trained one, on the same held-out sets:")
            start = "student (step 0)" if cfg.student else "SFT student (step 0)"
            log(bundle.compare([(start, baseline), (f"{cfg.arm}, step {cfg.steps}", final["results"])]))
    trainer.close()
    report["wall_s"] = round(time.time() - t0, 1)
    report["cpu_s"] = round(time.process_time() - cpu0, 1)
    if history:
        report["last_step"] = history[-1]
    else:  # resumed from the final checkpoint: no step trained now, the last one is in metrics.jsonl
        from .rundir import last_train_record

        report["last_step"] = last_train_record(trainer.metrics_path)
    if trainer.rank == 0:
        atomic_write_json(os.path.join(cfg.run_dir, "report.json"), report)
        log(f"run directory: {os.path.abspath(cfg.run_dir)}  (metrics.jsonl, report.json, final/, checkpoints/)")
    return report


class _BaselineCache:
    """The held-out scores of an SFT'd default student, kept beside it in the SFT cache:
    every run from that student starts from the same weights on the same held-out episodes,
    so its step-0 evaluation is measured once per cached student and evaluation setting
    (`env_key`: the environment's part of the key, `EnvironmentBundle.baseline_key`)."""

    FILE = "baseline_eval.json"
    LOCK = ".baseline_eval.lock"  # not the SFT lock: a builder holds that for minutes

    def __init__(self, env_key: dict, student_dir: str):
        import hashlib

        from memopd.files import MANIFEST

        self.path = os.path.join(os.path.dirname(os.path.abspath(student_dir)), self.FILE)
        try:
            with open(os.path.join(student_dir, MANIFEST), "rb") as f:
                weights = hashlib.sha256(f.read()).hexdigest()
        except OSError:
            weights = None  # no manifest: nothing identifies the weights, so nothing is cached
        key = {"student": weights, **env_key}
        self.key = None if weights is None else json.dumps(key, sort_keys=True)

    def _entries(self) -> dict:
        try:
            with open(self.path) as f:
                entries = json.load(f)
            return entries if isinstance(entries, dict) else {}
        except (OSError, ValueError):
            return {}

    def get(self) -> dict | None:
        return None if self.key is None else self._entries().get(self.key)

    def put(self, results: dict) -> None:
        from memopd.errors import UserError
        from memopd.files import DirectoryLock, atomic_write_json

        if self.key is None:
            return
        # read, merge and write under a lock: two runs finishing together would otherwise
        # each write the entries they read, and one run's entry would be lost
        lock = DirectoryLock(os.path.dirname(self.path), name=self.LOCK, what="SFT cache")
        try:
            lock.acquire(command="baseline evaluation cache", wait=lambda _message: None)
            try:
                atomic_write_json(self.path, {**self._entries(), self.key: results})
            finally:
                lock.release()
        except (OSError, UserError):  # a cache: the run does not depend on it
            pass


def _step0_eval(metrics_path: str) -> dict:
    """The step-0 evaluation line of metrics.jsonl back as {"Q2": {"em_mean": ..}, ..}."""
    import re

    try:
        with open(metrics_path) as f:
            line = next((json.loads(x) for x in f if x.strip().startswith('{"step": 0,')), None)
    except (OSError, ValueError):
        return {}
    out: dict = {}
    for key, v in (line or {}).items():
        m = re.fullmatch(r"eval/(\w+)_(q\d+)", key)
        if m:
            out.setdefault(m.group(2).upper(), {})[m.group(1)] = v
    return out


def _flatten_eval(res: dict) -> dict:
    """{"Q2": {"em_mean": .., ...}, ...} -> {"em_mean_q2": .., ...} for metrics lines."""
    out = {}
    for qk, row in res.items():
        if isinstance(row, dict):
            for name, v in row.items():
                if isinstance(v, (int, float)):
                    out[f"{name}_{qk.lower()}"] = v
    return out
