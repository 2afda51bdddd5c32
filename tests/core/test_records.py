"""Records: validation errors and exact on-disk round trip."""
import json
import math

import pytest

from memopd import Invocation, RecordError, Trajectory, load_trajectories, random_trajectories, save_trajectories
from memopd.memory import POLICIES


def _inv(**kw):
    base = dict(prefix_ids=[5, 6], context_ids=[7], action_ids=[8, 9], sample_logprobs=[-0.5, -1.25])
    base.update(kw)
    return Invocation(**base)


@pytest.mark.parametrize("policy", POLICIES)
def test_round_trip_exact(tmp_path, seed, policy):
    trajs = random_trajectories(policy, 7, seed=seed, group_size=2, vocab_size=500)
    trajs[0].rewards = {"em": [1, 0], "f1": [1.0, 0.3333333333333333]}
    trajs[1].info = {"note": "ünïcode"}
    path = tmp_path / "t.jsonl"
    save_trajectories(path, trajs, vocab_size=500)
    back = load_trajectories(path)
    assert back == trajs
    # each body line is plain JSON another tool can read
    lines = path.read_text().splitlines()
    assert json.loads(lines[1])["invocations"][0]["action_ids"] == trajs[0].invocations[0].action_ids


@pytest.mark.parametrize(
    "kw, msg",
    [
        (dict(action_ids=[]), "action_ids is empty"),
        (dict(action_ids=[8, -1], sample_logprobs=[-1.0, -1.0]), "negative"),
        (dict(action_ids=[8, 1000], sample_logprobs=[-1.0, -1.0]), "out of range for vocab_size 100"),
        (dict(sample_logprobs=[-1.0]), "1 values for 2 action tokens"),
        (dict(sample_logprobs=[-1.0, math.nan]), "not finite"),
        (dict(sample_logprobs=[-1.0, math.inf]), "not finite"),
        (dict(sample_logprobs=[-1.0, 0.5]), "positive"),
        (dict(prefix_ids=[], context_ids=[]), "both empty"),
        (dict(provenance=[(1, 0, 0), (1, 0, 1)]), "2 entries for 1 context tokens"),
    ],
)
def test_invocation_validation(kw, msg):
    with pytest.raises(RecordError, match=msg):
        Trajectory([_inv(), _inv(**kw)]).validate(vocab_size=100)


def test_non_integer_ids_rejected():
    with pytest.raises(RecordError, match="not an integer"):
        _inv(action_ids=[1.5])
    with pytest.raises(RecordError, match="not an integer"):
        _inv(context_ids=["a"])


def test_inconsistent_prefix():
    with pytest.raises(RecordError, match="prefix_ids differ"):
        Trajectory([_inv(), _inv(prefix_ids=[5, 7])]).validate()


def test_provenance_must_match_source():
    a = _inv(observation_ids=[3])
    good = _inv(context_ids=[9, 3], provenance=[(1, 0, 1), (2, 0, 0)])
    Trajectory([a, good]).validate()
    bad = _inv(context_ids=[8, 3], provenance=[(1, 0, 1), (2, 0, 0)])
    with pytest.raises(RecordError, match="does not equal its claimed source"):
        Trajectory([a, bad]).validate()
    future = _inv(context_ids=[9], provenance=[(1, 1, 0)])
    with pytest.raises(RecordError, match="not an earlier call"):
        Trajectory([a, future]).validate()


def test_empty_trajectory():
    with pytest.raises(RecordError, match="no invocations"):
        Trajectory([]).validate()


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "t.jsonl"
    save_trajectories(path, random_trajectories("full", 3, seed=0))
    return path


def test_truncated_file(saved):
    data = saved.read_bytes()
    saved.write_bytes(data[: len(data) // 2])
    with pytest.raises(RecordError, match="truncated"):
        load_trajectories(saved)
    lines = data.decode().splitlines(keepends=True)
    saved.write_text("".join(lines[:-1]))
    with pytest.raises(RecordError, match="truncated"):
        load_trajectories(saved)


def test_corrupted_file(saved):
    text = saved.read_text()
    lines = text.splitlines(keepends=True)
    d = json.loads(lines[1])
    d["invocations"][0]["action_ids"][0] += 1
    lines[1] = json.dumps(d, separators=(",", ":")) + "\n"
    saved.write_text("".join(lines))
    with pytest.raises(RecordError, match="checksum mismatch"):
        load_trajectories(saved)
    saved.write_bytes(b"\xff\xfe garbage\n")
    with pytest.raises(RecordError):
        load_trajectories(saved)


def test_not_a_trajectories_file(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_text('{"hello": 1}\n{"a": 2}\n{"footer": true}\n')
    with pytest.raises(RecordError, match="not a memopd.trajectories file"):
        load_trajectories(p)


def test_save_validates(tmp_path):
    bad = Trajectory([_inv(action_ids=[])])
    with pytest.raises(RecordError, match="trajectory 0, call 0: action_ids is empty"):
        save_trajectories(tmp_path / "b.jsonl", [bad])
    assert not (tmp_path / "b.jsonl").exists()
