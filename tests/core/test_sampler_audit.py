"""`memopd audit --trajectories F --model M`: recorded sampling log-probs against the model's
restored ones. Trajectories recorded with HFEngine through `memopd.recording.Recorder`
(the recipe for any sampler) pass in the aligned layout and not in flatten; a recorded
log-prob that is off by 0.05 fails the check (exit 1)."""
import json

import pytest

from memopd.cli import main
from memopd.env.rollout import HFEngine
from memopd.memory import SlidingWindow
from memopd.models import tiny_causal_lm
from memopd.recording import Recorder
from memopd.records import RecordError, save_trajectories


def _record(lm, n=4, turns=3):
    engine = HFEngine(lm, vocab_size=200)
    recs = [Recorder(SlidingWindow(turns=1), [10 + i, 20, 30 + i], initial_context_ids=[3], task_id=f"t{i}") for i in range(n)]
    for t in range(turns):
        samples = engine.generate([r.prompt_ids() for r in recs], max_new_tokens=5, temperature=1.0, stop_ids=[4], seed=t)
        for r, s in zip(recs, samples):
            r.record(s.ids, s.logprobs, [50, 51 + t], sampling=s.sampling, last=t == turns - 1)
    trajs = [r.trajectory(reward=0.5) for r in recs]
    for tr in trajs:
        tr.info["sampling"].update(temperature=1.0, vocab_size=200)
    return trajs


def test_audit_of_recorded_logprobs(tmp_path, capsys):
    lm = tiny_causal_lm("llama", vocab_size=256, hidden_size=64, num_heads=2, num_kv_heads=1, initializer_range=0.1)
    model_dir = tmp_path / "m"
    lm.save_pretrained(model_dir)
    trajs = _record(lm)
    assert trajs[0].info["sampling"]["calls"][0]["engine"] == "hf"
    path, report = tmp_path / "t.jsonl", tmp_path / "r.json"
    save_trajectories(path, trajs)
    assert main(["audit", "--trajectories", str(path), "--model", str(model_dir), "--json", str(report)]) == 0
    out = capsys.readouterr().out
    assert "recorded sampling log-probs vs" in out and "PASS" in out
    s = json.load(open(report))["sampler"]
    assert s["aligned"]["max_abs_dlogp"] < 1e-5 and s["aligned"]["tokens"] == sum(len(i.action_ids) for t in trajs for i in t.invocations)
    assert s["flatten"]["max_abs_dlogp"] > 1e-2

    trajs[1].invocations[2].sample_logprobs[0] -= 0.05  # a sampler that drifted on one token
    save_trajectories(path, trajs)
    assert main(["audit", "--trajectories", str(path), "--model", str(model_dir), "--json", str(report)]) == 1
    s = json.load(open(report))["sampler"]
    assert s["aligned"]["max_abs_dlogp"] == pytest.approx(0.05, abs=1e-5)


def test_sampler_audit_needs_recorded_logprobs():
    from memopd.rce import sampler_audit

    lm = tiny_causal_lm("qwen2", vocab_size=256, hidden_size=64, num_heads=2, num_kv_heads=1)
    trajs = _record(lm, n=1, turns=2)
    for inv in trajs[0].invocations:
        inv.sample_logprobs = None
    with pytest.raises(RecordError, match="recorded its sampling log-probs"):
        sampler_audit(lm, trajs)
