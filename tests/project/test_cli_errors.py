"""Errors a user can act on: one line on stderr and a documented exit code for bad input
(`memopd.errors`), a traceback only for bugs or with --debug / MEMOPD_DEBUG=1; strict
config types; model directories and trajectory files named in their errors; the
progress display in logs; the plot extra.

The CLI runs in-process (`memopd.cli.main`) except for one subprocess test of the real
exit status. Nothing here loads a trained model or runs a step: seconds in all."""
import hashlib
import io
import json
import os
import subprocess
import sys

import pytest

from memopd import random_trajectories, save_trajectories
from memopd.cli import main
from memopd.errors import EXIT_BAD_INPUT, EXIT_CHECK_FAILED, EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_RUN_CONFLICT, RunDirError
from memopd.records import RecordError, load_trajectories


def run_cli(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def one_error_line(err: str, command: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"memopd {command}: error: "), err
    assert "Traceback" not in err
    return lines[0]


# --------------------------------------------------------------------------------------
# 7: central error handling and exit codes
# --------------------------------------------------------------------------------------
def test_bad_input_is_one_line_and_exit_2(capsys, tmp_path):
    rc, _, err = run_cli(capsys, "pack", "--trajectories", str(tmp_path / "missing.jsonl"))
    assert rc == EXIT_BAD_INPUT == 2
    line = one_error_line(err, "pack")
    assert "missing.jsonl: cannot read the trajectories file (No such file or directory)" in line


@pytest.mark.parametrize("how", ["--debug first", "--debug last", "env"])
def test_debug_shows_the_traceback(capsys, tmp_path, monkeypatch, how):
    missing = str(tmp_path / "missing.jsonl")
    argv = ["pack", "--trajectories", missing]
    if how == "--debug first":
        argv = ["--debug", *argv]
    elif how == "--debug last":
        argv = [*argv, "--debug"]
    else:
        monkeypatch.setenv("MEMOPD_DEBUG", "1")
    rc, _, err = run_cli(capsys, *argv)
    assert rc == 2
    assert "Traceback (most recent call last)" in err and "RecordError" in err
    assert err.strip().splitlines()[-1].startswith("memopd pack: error: ")


def test_internal_error_is_a_traceback_and_exit_70(capsys, monkeypatch):
    import memopd.cli as cli

    def boom(args):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(cli, "_cmd_pack", boom)
    rc, _, err = run_cli(capsys, "pack")
    assert rc == EXIT_INTERNAL == 70
    assert "Traceback (most recent call last)" in err and "ZeroDivisionError: a bug" in err
    assert "internal error" in err.strip().splitlines()[-1]


def test_interrupt_is_one_line_and_exit_130(capsys, monkeypatch):
    import memopd.cli as cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_cmd_pack", interrupted)
    rc, _, err = run_cli(capsys, "pack")
    assert rc == EXIT_INTERRUPTED == 130
    assert err.strip() == "memopd pack: interrupted"


def test_run_dir_conflict_is_exit_3(capsys, monkeypatch):
    import memopd.cli as cli

    def locked(args):
        raise RunDirError("run directory runs/x is in use by process 123")

    monkeypatch.setattr(cli, "_cmd_pack", locked)
    rc, _, err = run_cli(capsys, "pack")
    assert rc == EXIT_RUN_CONFLICT == 3
    assert one_error_line(err, "pack") == "memopd pack: error: run directory runs/x is in use by process 123"


def test_failed_audit_stays_exit_1(capsys, monkeypatch):
    import memopd.rce as rce

    class Failed:
        variant, must_pass, passed = "aligned", True, False

        def to_dict(self):
            return {"variant": self.variant}

    monkeypatch.setattr(rce, "audit", lambda *a, **k: [Failed()])
    monkeypatch.setattr(rce, "format_table", lambda results, title: title)
    rc, out, _ = run_cli(capsys, "audit", "--policy", "full", "--num-trajectories", "2")
    assert rc == EXIT_CHECK_FAILED == 1
    assert "FAILED: full/aligned" in out


@pytest.mark.parametrize("argv, msg", [
    (["audit", "--num-trajectories", "0"], "argument --num-trajectories: must be >= 1, got 0"),
    (["pack", "--num-trajectories", "-3"], "argument --num-trajectories: must be >= 1, got -3"),
    (["pack", "--max-tokens", "lots"], "argument --max-tokens: expected a positive integer, got 'lots'"),
    (["sft", "--out", "x", "--policy", "bogus"], "argument --policy: invalid choice: 'bogus'"),
])
def test_argument_errors_exit_2(capsys, argv, msg):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert msg in capsys.readouterr().err


@pytest.mark.parametrize("module", ["memopd.cli", "memopd"])
def test_real_exit_status_and_stderr(module):
    """The console entry point as a process (`python -m memopd.cli`, and `python -m memopd`,
    which must be the same command line): exit status 2 and exactly one stderr line;
    MEMOPD_DEBUG=1 adds the traceback."""
    env = {k: v for k, v in os.environ.items() if k != "MEMOPD_DEBUG"}
    cmd = [sys.executable, "-m", module, "train", "steps=2.5", "policy=summary"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        "memopd train: error: override 'steps=2.5': steps must be an integer, got '2.5'"
    ]
    assert r.stdout == ""
    r = subprocess.run(cmd, capture_output=True, text=True, env={**env, "MEMOPD_DEBUG": "1"}, timeout=300)
    assert r.returncode == 2
    assert "Traceback (most recent call last)" in r.stderr and "ConfigError" in r.stderr


def test_python_m_memopd_is_the_memopd_script():
    """`python -m memopd` runs pyproject's `memopd` entry point: its help (exit 0, every
    subcommand listed) and a missing subcommand (argparse's exit 2)."""
    r = subprocess.run([sys.executable, "-m", "memopd", "--help"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: memopd ") and "Memory-Aligned On-Policy Distillation" in r.stdout
    for command in ("audit", "pack", "sft", "eval", "train", "plot", "compare"):
        assert command in r.stdout.split("positional arguments:")[1], command
    r = subprocess.run([sys.executable, "-m", "memopd"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "the following arguments are required: command" in r.stderr, r.stderr


# --------------------------------------------------------------------------------------
# 8: config types and choices, checked before anything is loaded
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("override, msg", [
    ("steps=2.5", "steps must be an integer, got '2.5'"),
    ("steps=true", "steps must be an integer, got 'true'"),
    ("steps=abc", "steps must be an integer, got 'abc'"),
    ("progress=maybe", "progress must be true or false, got 'maybe'"),
    ("progress=1", "progress must be true or false, got '1'"),
    ("actor_lr=fast", "actor_lr must be a number, got 'fast'"),
    ("train_k=[2, x]", "train_k must be a list of integers"),
    ("policy=bogus", "policy must be one of full, suffix, summary, window, refresh, got 'bogus'"),
    ("arm=ppo2", "arm must be one of ppo, persistent, memopd, broken_positions, broken_visibility, got 'ppo2'"),
    ("action_domain=all", "action_domain must be one of exact, naive, got 'all'"),
])
def test_config_override_types(capsys, override, msg):
    rc, _, err = run_cli(capsys, "train", override)
    assert rc == 2
    assert one_error_line(err, "train").startswith(f"memopd train: error: override {override!r}: {msg}")


@pytest.mark.parametrize("text, msg", [
    ("steps: abc\n", "steps must be an integer, got 'abc'"),
    ("steps: 2.5\n", "steps must be an integer, got 2.5"),
    ("tensorboard: 'no'\n", "tensorboard must be true or false, got 'no'"),
    ("run_dir: 7\n", "run_dir must be a string (quote it in YAML), got 7"),
    ("policy: bogus\n", "policy must be one of"),
    ("eval_k: [2, true]\n", "eval_k must be a list of integers"),
])
def test_config_file_types(capsys, tmp_path, text, msg):
    p = tmp_path / "run.yaml"
    p.write_text(text)
    rc, _, err = run_cli(capsys, "train", "--config", str(p))
    assert rc == 2
    line = one_error_line(err, "train")
    assert f"{p}: {msg}" in line


def test_config_accepts_yaml_scalars():
    from memopd.trainer.config import TrainConfig

    cfg = TrainConfig.load(None, ["steps=3", "actor_lr=1e-4", "progress=false", "train_k=2,8", "run_dir=2024",
                                  "temperature=1"])
    assert (cfg.steps, cfg.actor_lr, cfg.progress, cfg.train_k, cfg.run_dir) == (3, 1e-4, False, [2, 8], "2024")
    assert isinstance(cfg.temperature, float)


def test_config_types_checked_for_every_field():
    """Generic over the dataclass fields (new fields are covered without a new check)."""
    import dataclasses
    import typing

    from memopd.trainer.config import ConfigError, TrainConfig

    hints = typing.get_type_hints(TrainConfig)
    wrong = {bool: 2, int: 2.5, float: "x", str: [1], list[int]: ["a"]}
    checked = 0
    for f in dataclasses.fields(TrainConfig):
        if hints[f.name] in wrong:
            with pytest.raises(ConfigError, match=rf"\b{f.name} must be"):
                TrainConfig(**{f.name: wrong[hints[f.name]]}).validate()
            checked += 1
    for section in (TrainConfig().env, TrainConfig().ppo):  # the sections' fields, as `section: {key: value}`
        name = {"EnvSpec": "env", "PPOSettings": "ppo"}[type(section).__name__]
        inner = typing.get_type_hints(type(section))
        for f in dataclasses.fields(section):
            if inner[f.name] in wrong:
                with pytest.raises(ConfigError, match=rf"\b{f.name} must be"):
                    TrainConfig.from_dict({name: {f.name: wrong[inner[f.name]]}})
                checked += 1
    assert checked >= 30  # all of today's fields but a few are of these types


# --------------------------------------------------------------------------------------
# 9: model directories
# --------------------------------------------------------------------------------------
def test_missing_teacher_is_caught_by_config_validation(capsys):
    rc, _, err = run_cli(capsys, "train", "teacher=/nonexistent/teacher")
    assert rc == 2
    assert one_error_line(err, "train") == (
        "memopd train: error: teacher: model directory '/nonexistent/teacher' does not exist")


def test_audit_model_dir_errors(capsys, tmp_path):
    rc, _, err = run_cli(capsys, "audit", "--model", "/nonexistent")
    assert rc == 2
    assert "Repo id" not in err
    assert one_error_line(err, "audit") == "memopd audit: error: --model: model directory '/nonexistent' does not exist"
    rc, _, err = run_cli(capsys, "audit", "--model", str(tmp_path))
    assert rc == 2 and f"'{tmp_path}' has no config.json" in one_error_line(err, "audit")


def test_model_dir_without_weights(tmp_path):
    from memopd.errors import UserError
    from memopd.models import load_local_model, tiny_causal_lm_config

    tiny_causal_lm_config(vocab_size=32, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1).save_pretrained(tmp_path)
    with pytest.raises(UserError, match=r"teacher: cannot load the model in '.*'"):
        load_local_model(tmp_path, what="teacher")


# --------------------------------------------------------------------------------------
# 10: trajectory files
# --------------------------------------------------------------------------------------
def _rewrite(path, index, edit):
    """Edit body line `index` of a trajectories file and fix its footer (so only the edit is wrong)."""
    lines = path.read_text().splitlines()
    body = lines[1:-1]
    body[index] = json.dumps(edit(json.loads(body[index])), separators=(",", ":"))
    h = hashlib.sha256("".join(b + "\n" for b in body).encode())
    footer = {"footer": True, "count": len(body), "sha256": h.hexdigest()}
    path.write_text("\n".join([lines[0], *body, json.dumps(footer)]) + "\n")


@pytest.fixture
def traj_file(tmp_path):
    path = tmp_path / "t.jsonl"
    save_trajectories(path, random_trajectories("full", 3, seed=0, vocab_size=100), vocab_size=100)
    return path


def _set_inv(field, value, call=0):
    def edit(d):
        d["invocations"][call][field] = value
        return d
    return edit


@pytest.mark.parametrize("index, edit, msg", [
    (1, lambda d: {**d, "reward": "high"}, r":3: trajectory 1: reward = 'high' is not a number"),
    (0, _set_inv("action_ids", [True, 5]), r":2: trajectory 0: call 0: action_ids\[0\] = True is not an integer token id"),
    (2, _set_inv("context_ids", ["7"], call=1), r":4: trajectory 2: call 1: context_ids\[0\] = '7' is not an integer"),
    (1, _set_inv("temperature_typo", 1.0), r":3: trajectory 1: call 0: invocation has unknown fields \['temperature_typo'\]"),
    (0, _set_inv("sample_logprobs", ["x"]), r":2: trajectory 0: call 0: sample_logprobs\[0\] = 'x' is not a number"),
    (2, _set_inv("action_ids", [-4]), r":4: trajectory 2, call 0: action_ids\[0\] = -4 is negative"),
    (0, lambda d: {**d, "invocations": 5}, r":2: trajectory 0: 'invocations' must be a list"),
])
def test_record_errors_name_file_line_and_trajectory(traj_file, index, edit, msg):
    _rewrite(traj_file, index, edit)
    with pytest.raises(RecordError, match=msg) as e:
        load_trajectories(traj_file)
    assert str(e.value).startswith(str(traj_file))


def test_record_error_through_the_cli(capsys, traj_file):
    _rewrite(traj_file, 1, lambda d: {**d, "reward": "high"})
    rc, _, err = run_cli(capsys, "pack", "--trajectories", str(traj_file))
    assert rc == 2
    assert one_error_line(err, "pack") == (
        f"memopd pack: error: {traj_file}:3: trajectory 1: reward = 'high' is not a number")


@pytest.mark.parametrize("command", ["audit", "pack"])
def test_empty_trajectories_file(capsys, tmp_path, command):
    path = tmp_path / "empty.jsonl"
    save_trajectories(path, [])
    assert load_trajectories(path) == []  # an empty set round-trips through the API
    rc, _, err = run_cli(capsys, command, "--trajectories", str(path))
    assert rc == 2
    assert one_error_line(err, command) == (
        f"memopd {command}: error: {path}: the file holds no trajectories; nothing to {command}")


# --------------------------------------------------------------------------------------
# 13: progress in logs
# --------------------------------------------------------------------------------------
def test_progress_in_a_log_is_a_few_plain_lines():
    from memopd.progress import progress_bar

    log = io.StringIO()
    bar = progress_bar(500, "sft student", unit="step", stream=log)
    for i in range(500):
        bar.set_postfix(loss=f"{1 / (i + 1):.3f}")
        bar.update(1)
    bar.close()
    text = log.getvalue()
    assert "\r" not in text and "\x1b" not in text
    lines = text.splitlines()
    assert len(lines) == 10  # every 10%
    assert lines[0].startswith("sft student: 50/500 step (10%), ")
    assert lines[-1].startswith("sft student: 500/500 step (100%), ") and lines[-1].endswith("loss=0.002")
    assert all(line.startswith("sft student: ") for line in lines)


def test_progress_line_per_interval_and_at_close(monkeypatch):
    import memopd.progress as progress

    clock = iter(range(0, 10_000, 7))  # 7 s per call of time.monotonic
    monkeypatch.setattr(progress.time, "monotonic", lambda: next(clock))
    log = io.StringIO()
    bar = progress.progress_bar(10_000, "train[memopd]", unit="step", stream=log, min_interval_s=20, initial=0)
    for _ in range(9):
        bar.update(1)
    bar.close()
    lines = log.getvalue().splitlines()
    # 9 updates 7 s apart: a line every third update (>= 20 s), and one at close only if
    # something happened since the last line
    assert [line.split(",")[0] for line in lines] == ["train[memopd]: 3/10000 step (0%)",
                                                       "train[memopd]: 6/10000 step (0%)",
                                                       "train[memopd]: 9/10000 step (0%)"]


def test_progress_on_a_terminal_is_a_bar_and_off_is_silent():
    from memopd.progress import progress_bar

    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty = Tty()
    bar = progress_bar(20, "rollout", unit="ep", stream=tty)
    for _ in range(20):
        bar.update(1)
    bar.close()
    assert "\r" in tty.getvalue()  # tqdm redraws its line
    quiet = io.StringIO()
    bar = progress_bar(20, "rollout", stream=quiet, enabled=False)
    bar.update(20)
    bar.set_postfix(x=1)
    bar.close()
    assert quiet.getvalue() == "" and bar.n == 20


# --------------------------------------------------------------------------------------
# 14: the plot extra
# --------------------------------------------------------------------------------------
def test_plot_without_matplotlib_names_the_extra(capsys, tmp_path, monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ModuleNotFoundError
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "rollout/reward_mean": 0.5}\n')
    rc, _, err = run_cli(capsys, "plot", str(tmp_path))
    assert rc == 2
    assert "pip install 'memopd[plot]'" in one_error_line(err, "plot")


def test_plot_of_a_missing_run_dir(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    rc, _, err = run_cli(capsys, "plot", str(tmp_path / "nope"))
    assert rc == 2
    assert one_error_line(err, "plot") == f"memopd plot: error: run directory '{tmp_path / 'nope'}' does not exist"
