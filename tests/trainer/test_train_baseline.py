"""`memopd train` evaluates its starting student on the held-out sets before step 1: the
final table then shows the baseline next to the trained scores, and `memopd plot` draws
every eval panel as a line even with eval_every=0. The default SFT student's baseline is
measured once and kept in the SFT cache."""
import json

import pytest

from memopd.env.qa.build import baseline_key
from memopd.trainer.config import TrainConfig
from memopd.trainer.loop import evaluation_settings

pytest.importorskip("transformers")


def _cache_of(cfg, student):
    """The step-0 cache of a run's student, keyed as the QA world keys the run's evaluation settings."""
    from memopd.trainer.loop import _BaselineCache

    return _BaselineCache(baseline_key(cfg.env, evaluation_settings(cfg)), student)


def _cfg(sft_dirs, run_dir, **kw):
    base = dict(steps=2, run_dir=str(run_dir), student=sft_dirs[0], teacher=sft_dirs[1], tasks_per_step=2,
                group_size=2, train_k=[1], eval_k=[1, 2], eval_tasks=2, ppo_epochs=1, minibatches=2,
                checkpoint_every=0, progress=False)
    base.update(kw)
    return TrainConfig.from_dict(base)


def test_train_reports_the_starting_student_next_to_the_trained_one(sft_dirs, tmp_path):
    from memopd.env.qa.evaluate import evaluate
    from memopd.trainer.loop import train
    from memopd.trainer.plot import read_metrics

    said = []
    rep = train(_cfg(sft_dirs, tmp_path / "run"), log=said.append)
    lines = read_metrics(str(tmp_path / "run"))
    assert lines[0]["step"] == 0 and set(lines[0]) > {"eval/em_mean_q1", "eval/em_mean_q2"}
    assert [m["step"] for m in lines if "eval/em_mean_q1" in m] == [0, 2]  # a line, not one point
    # step 0 is the student it started from, scored as `memopd eval` scores it
    direct = evaluate(sft_dirs[0], ks=[1, 2], n=2)["results"]
    assert rep["baseline_eval"]["Q1"]["em_mean"] == direct["Q1"]["em_mean"]
    assert rep["baseline_eval"]["Q2"]["f1_mean"] == direct["Q2"]["f1_mean"]
    table = said[said.index("\nthe starting student (step 0) against the trained one, on the same held-out sets:") + 1]
    rows = table.splitlines()
    assert rows[1].startswith("student (step 0)") and rows[2].startswith("memopd, step 2")
    assert rows[3].startswith("change")
    assert float(rows[1].split()[3]) == pytest.approx(direct["Q1"]["em_mean"], abs=5e-4)
    assert json.loads((tmp_path / "run" / "report.json").read_text())["baseline_eval"]["Q1"]


def test_sampled_evaluation_reads_what_memopd_eval_reads(sft_dirs, tmp_path):
    """eval_temperature / eval_samples: the run's step-0 and final evaluations are `memopd
    eval --temperature T --samples N` on the same sets (sampling seeded, so reproducible)."""
    from memopd.env.qa.evaluate import evaluate
    from memopd.trainer.loop import train

    said = []
    rep = train(_cfg(sft_dirs, tmp_path / "run", eval_temperature=1.0, eval_samples=3), log=said.append)
    direct = evaluate(sft_dirs[0], ks=[1, 2], n=2, temperature=1.0, samples=3)["results"]
    assert rep["baseline_eval"]["Q2"]["episodes"] == 6 == rep["eval"]["Q2"]["episodes"]
    assert rep["baseline_eval"]["Q2"]["f1_mean"] == direct["Q2"]["f1_mean"]
    assert rep["baseline_eval"]["Q1"]["em_mean"] == direct["Q1"]["em_mean"]
    assert any("temperature 1, 3 episode(s) per set" in x for x in said)


def test_baseline_cache_is_keyed_by_the_weights_and_the_eval_settings(sft_dirs, tmp_path):
    import shutil


    student = tmp_path / "sft" / "student"
    shutil.copytree(sft_dirs[0], student)
    cfg = _cfg(sft_dirs, tmp_path / "run")
    cache = _cache_of(cfg, str(student))
    assert cache.get() is None
    cache.put({"Q1": {"em_mean": 0.5}})
    assert _cache_of(cfg, str(student)).get() == {"Q1": {"em_mean": 0.5}}
    assert _cache_of(_cfg(sft_dirs, tmp_path / "run", eval_tasks=3), str(student)).get() is None
    assert _cache_of(_cfg(sft_dirs, tmp_path / "run", policy="full"), str(student)).get() is None
    sampled = _cfg(sft_dirs, tmp_path / "run", eval_temperature=1.0, eval_samples=2)
    assert _cache_of(sampled, str(student)).get() is None
    assert _cache_of(_cfg(sft_dirs, tmp_path / "run", eval_temperature=1.0), str(student)).key != \
        _cache_of(sampled, str(student)).key
    manifest = student / "memopd_manifest.json"
    manifest.write_text(manifest.read_text() + " ")  # other weights, another manifest
    assert _cache_of(cfg, str(student)).get() is None


def _put_baseline(cfg_args, student: str, eval_tasks: int, start: float) -> None:
    import time


    cfg = _cfg(*cfg_args, eval_tasks=eval_tasks)
    cache = _cache_of(cfg, student)
    time.sleep(max(0.0, start - time.time()))  # every writer reads at about the same moment
    cache.put({"Q1": {"em_mean": eval_tasks / 100}})


def test_baseline_cache_keeps_every_entry_of_concurrent_writers(sft_dirs, tmp_path):
    import multiprocessing as mp
    import shutil
    import time


    student = tmp_path / "sft" / "student"
    shutil.copytree(sft_dirs[0], student)
    start = time.time() + 1.5
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_put_baseline, args=((sft_dirs, tmp_path / "run"), str(student), n, start))
             for n in range(3, 9)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    for n in range(3, 9):
        got = _cache_of(_cfg(sft_dirs, tmp_path / "run", eval_tasks=n), str(student)).get()
        assert got == {"Q1": {"em_mean": n / 100}}, f"the entry of the writer with eval_tasks={n} was lost"
