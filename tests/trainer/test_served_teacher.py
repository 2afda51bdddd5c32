"""The served teacher (`memopd serve-teacher` + `teacher_url=`) against the in-process one,
through real server processes on free loopback ports: the same hidden states, loss and
gradients for every layout and two context-rewriting memory policies; `memopd train` end
to end with the same metrics; and the faults (bad requests, limits, secret, a server that
dies mid-run, a restarted one with other weights, a vocabulary that does not fit)."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from _teacher_server import ROOT, served

from memopd.errors import EXIT_BAD_INPUT, EXIT_PEER_FAILED, PeerError, RunDirError, UserError

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """A tiny random teacher (H=64) and student (H=32) of one 128-id vocabulary."""
    from memopd.models import tiny_causal_lm

    d = tmp_path_factory.mktemp("served")
    tiny_causal_lm("qwen2", vocab_size=128, hidden_size=64, num_heads=4, num_kv_heads=2, seed=0,
                   initializer_range=0.2).save_pretrained(d / "teacher")
    student = tiny_causal_lm("qwen2", vocab_size=128, hidden_size=32, num_heads=4, num_kv_heads=2, seed=1)
    return d / "teacher", student


@pytest.fixture(scope="module")
def tiny_server(tiny_models):
    with served(tiny_models[0]) as (proc, url):
        yield proc, url


def _loss_and_grads(student, teacher_lm, trajs, layout, head):
    """score() with `teacher_lm` (in process or served), then the fused actor loss of every
    micro-batch, backward: (teacher hidden, teacher mask, loss, KL sum, student grads)."""
    from memopd.trainer.modules import Actor, Critic, PPOInputs, Scoring
    from memopd.trainer.settings import ActorLossCoefs, PPOSettings
    from memopd.trainer.update import pack_layout, score

    student.zero_grad(set_to_none=True)
    actor = Actor(student, scoring=Scoring(1.0, 128))
    critic = Critic(student)
    scored = score(actor, critic, None, teacher_lm, trajs, teacher_layout=layout, max_tokens=256,
                   ppo=PPOSettings(ref_kl_coef=0.0, gamma=1.0, lam=0.95))
    batch = pack_layout(trajs, 256)
    coefs = ActorLossCoefs(0.2, 0.001, 1.0)
    n_t = float(batch.teacher_mask.sum())
    loss = kl = 0.0
    for mb in batch.micro_batches(128):
        gid = scored.offsets[mb.traj_index, mb.call_index] + mb.token_index
        ppo = PPOInputs(scored.logp_old[gid], scored.advantages[gid], mb.teacher_mask, coefs,
                        normalizer=float(batch.num_actions), kl_normalizer=n_t)
        out = actor(mb, scored.teacher_hidden[gid], head, ppo=ppo)
        out.loss.backward()
        loss += float(out.loss.detach())
        kl += float((out.kl * mb.teacher_mask).sum())
    grads = {n: p.grad.clone() for n, p in student.named_parameters() if p.grad is not None}
    return scored.teacher_hidden, batch.teacher_mask, loss, kl, grads


FIGURES: dict = {}


@pytest.mark.parametrize("policy", ["summary", "window"])
@pytest.mark.parametrize("layout", ["aligned", "aligned_unshared", "independent", "flatten", "trie"])
def test_served_equals_in_process(tiny_models, tiny_server, layout, policy):
    from memopd.hf import head_of
    from memopd.memory import random_trajectories
    from memopd.models import load_local_model
    from memopd.teacher_client import ServedTeacher

    teacher_dir, student = tiny_models
    teacher = load_local_model(teacher_dir).eval().requires_grad_(False)
    client = ServedTeacher(tiny_server[1], retries=0)
    try:
        trajs = random_trajectories(policy, 6, seed=3, group_size=2, vocab_size=128, calls=(3, 5), action_len=(2, 8),
                                    obs_len=(2, 10))
        assert any(inv.context_ids for tr in trajs for inv in tr.invocations[1:])  # rewritten context to restore
        h_in, mask, loss_in, kl_in, g_in = _loss_and_grads(student, teacher, trajs, layout, head_of(teacher))
        served_head = client.lm_head()
        assert torch.equal(served_head.weight, head_of(teacher).weight) and served_head.scale == head_of(teacher).scale
        h_sv, _, loss_sv, kl_sv, g_sv = _loss_and_grads(student, client, trajs, layout, served_head)
    finally:
        client.close()
    assert mask.any() and kl_in > 0
    dh = float((h_in[mask] - h_sv[mask]).abs().max())
    dg = max(float((g_in[n] - g_sv[n]).abs().max()) for n in g_in)
    FIGURES[(layout, policy)] = (dh, abs(loss_in - loss_sv), dg)
    print(f"[served vs in-process] {layout}/{policy}: max|dh| {dh:.3g}, |dloss| {abs(loss_in - loss_sv):.3g}, "
          f"max|dgrad| {dg:.3g}, bitwise {dh == 0 and loss_in == loss_sv and dg == 0}")
    assert set(g_in) == set(g_sv) and len(g_in) > 5
    assert dh <= 1e-6 and abs(loss_in - loss_sv) <= 1e-6 and abs(kl_in - kl_sv) <= 1e-6 and dg <= 1e-6


@pytest.mark.parametrize("layout", ["aligned", "trie"])
def test_a_teacher_of_the_trainers_layout_reads_the_one_packed_batch(tiny_models, tiny_server, monkeypatch, layout):
    """score() with the teacher's layout equal to the trainer's packs the step's trajectories
    once, served or in process, and the served teacher's states are the in-process ones;
    a teacher of another layout gets its own batch."""
    import memopd.trainer.update as U
    from memopd.memory import random_trajectories
    from memopd.models import load_local_model
    from memopd.teacher_client import ServedTeacher
    from memopd.trainer.modules import Actor, Critic, Scoring
    from memopd.trainer.settings import PPOSettings

    packed = []
    real = U.pack
    monkeypatch.setattr(U, "pack", lambda *a, **k: packed.append(k["layout"]) or real(*a, **k))
    teacher_dir, student = tiny_models
    actor, critic = Actor(student, scoring=Scoring(1.0, 128)), Critic(student)
    trajs = random_trajectories("summary", 8, seed=4, group_size=4, vocab_size=128, calls=(3, 5), group_context=True,
                                group_steps=1)

    def run(teacher_lm, teacher_layout):
        packed.clear()
        sc = U.score(actor, critic, None, teacher_lm, trajs, teacher_layout=teacher_layout, max_tokens=256,
                     ppo=PPOSettings(ref_kl_coef=0.0, gamma=1.0, lam=0.95), layout=layout)
        return sc, sorted(packed)

    client = ServedTeacher(tiny_server[1], retries=0)
    try:
        served, served_packs = run(client, layout)
        other, other_packs = run(client, "flatten")
    finally:
        client.close()
    local, local_packs = run(load_local_model(teacher_dir).eval().requires_grad_(False), layout)
    assert served_packs == local_packs == [layout]
    assert other_packs == sorted([layout, "flatten"])
    mask = U.pack_layout(trajs, 256, layout=layout).teacher_mask
    assert mask.any() and float(local.teacher_hidden[mask].abs().max()) > 0
    assert float((served.teacher_hidden - local.teacher_hidden).abs().max()) <= 1e-6
    assert torch.equal(served.logp_old, local.logp_old) and torch.equal(served.advantages, local.advantages)


def test_topk_and_bf16_answers(tiny_models, tiny_server):
    """Top-k log-probs are the teacher's own (float64 reference); bf16 hidden states are
    the fp32 ones rounded once."""
    from memopd.hf import head_of, packed_forward
    from memopd.memory import random_trajectories
    from memopd.models import load_local_model
    from memopd.packing import pack
    from memopd.teacher_client import ServedTeacher

    teacher = load_local_model(tiny_models[0]).eval()
    batch = pack(random_trajectories("summary", 4, seed=5, vocab_size=128), layout="aligned")
    mask = batch.teacher_mask
    with torch.no_grad():
        ref_h = packed_forward(teacher, batch, output="hidden")
        head = head_of(teacher)
        z = (ref_h.double() @ head.weight.double().T) * head.scale / 0.7
        ref = torch.log_softmax(z[:, :100], dim=-1).topk(8, dim=-1)
    client = ServedTeacher(tiny_server[1], retries=0)
    bf16 = ServedTeacher(tiny_server[1], retries=0, transport="bf16")
    try:
        ids, lps = client.topk(batch, 8, temperature=0.7, vocab_size=100)
        h16 = bf16.hidden_states(batch)
    finally:
        client.close()
        bf16.close()
    assert torch.equal(ids[mask], ref.indices[mask])
    assert float((lps[mask].double() - ref.values[mask]).abs().max()) < 1e-5
    assert torch.equal(h16[mask], ref_h[mask].to(torch.bfloat16).float())


def test_a_server_restarted_with_other_weights_mid_run_is_refused(tiny_models, tmp_path):
    """A client connected to one teacher refuses the answers of another served later at the
    same address (a restart between steps would otherwise mix two teachers in one run):
    one PeerError naming both fingerprints; a restart with the same weights is fine."""
    import socket

    from memopd.errors import EXIT_PEER_FAILED, PeerError
    from memopd.memory import random_trajectories
    from memopd.packing import pack
    from memopd.teacher_client import ServedTeacher
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    batch = pack(random_trajectories("summary", 2, seed=3, vocab_size=128), layout="aligned")
    with served(tiny_models[0], port=port) as (_, url):
        client = ServedTeacher(url, retries=3, backoff=0.2)
        first = client.hidden_states(batch)
    try:
        with served(tiny_models[0], port=port):  # the same weights again: answered as before
            assert torch.equal(client.hidden_states(batch), first)
        tiny_models[1].save_pretrained(tmp_path / "other")
        with served(tmp_path / "other", port=port):  # other weights at the same address
            with pytest.raises(PeerError, match="now answers with weights") as e:
                client.hidden_states(batch)
        assert client.fingerprint["sha256"][:16] in str(e.value) and e.value.exit_code == EXIT_PEER_FAILED
    finally:
        client.close()


def test_topk_answer_check_refuses_what_a_broken_server_could_send():
    """The client's check of a top-k answer: ids must be integers inside the vocabulary and
    log-probs finite and <= 0, in [rows, k]; the good answer (int32 ids, as the server sends)
    passes."""
    from memopd.teacher_wire import topk_answer_problem

    ids = torch.tensor([[3, 0], [9, 1]], dtype=torch.int32)
    lps = torch.tensor([[-0.1, -2.0], [-0.5, -0.9]])
    assert topk_answer_problem(ids, lps, 2, 2, 10) is None
    assert topk_answer_problem(ids.long(), lps, 2, 2, 10) is None
    assert "outside [0, 9)" in topk_answer_problem(ids, lps, 2, 2, 9)
    assert "outside" in topk_answer_problem(ids - 1, lps, 2, 2, 10)
    assert "shapes" in topk_answer_problem(ids, lps, 3, 2, 10)
    assert "dtypes" in topk_answer_problem(ids.float(), lps, 2, 2, 10)
    assert "not finite" in topk_answer_problem(ids, lps.clone().fill_(float("nan")), 2, 2, 10)
    assert "not finite" in topk_answer_problem(ids, -lps, 2, 2, 10)
    assert "no topk_ids" in topk_answer_problem(None, lps, 2, 2, 10)


def test_bad_requests_limits_and_secret(tiny_models, tmp_path):
    """One error answer each (400, 401, 413, 429), and the server keeps serving."""
    import http.client

    from memopd.memory import random_trajectories
    from memopd.packing import pack
    from memopd.teacher_client import ServedTeacher
    from memopd.teacher_wire import batch_to_wire, encode

    secret = tmp_path / "secret"
    secret.write_text("s3cret-s3cret-s3cret\n")
    batch = pack(random_trajectories("window", 3, seed=1, vocab_size=128), layout="aligned")
    with served(tiny_models[0], "--secret-file", str(secret), "--max-request-mb", "0.02", "--max-tokens", "400",
                "--rate", "20") as (proc, url):
        host, port = url[len("http://"):].split(":")

        def post(body, auth=True):
            c = http.client.HTTPConnection(host, int(port), timeout=30)
            c.request("POST", "/score", body=body,
                      headers={"Authorization": "Bearer s3cret-s3cret-s3cret"} if auth else {})
            r = c.getresponse()
            return r.status, json.loads(r.read() or b"{}").get("error", "")

        assert post(b"x" * 100, auth=False)[0] == 401
        with pytest.raises(UserError, match="HTTP 401"):
            ServedTeacher(url, retries=0)
        status, said = post(b"\x08\x00\x00\x00\x00\x00\x00\x00{not json")
        assert status == 400 and "not JSON" in said
        tensors, meta = batch_to_wire(batch)
        tensors["attn.cu_seqlens"] = tensors["attn.cu_seqlens"].flip(0)  # segments that run backwards
        status, said = post(encode(tensors, meta))
        assert status == 400 and "attention metadata" in said
        assert post(b"y" * 30000)[0] == 413
        big = pack(random_trajectories("full", 12, seed=2, vocab_size=128, calls=(5, 6)), layout="flatten", max_tokens=8192)
        assert big.num_tokens > 400
        status, said = post(encode(*batch_to_wire(big)))
        assert status == 413 and ("--max-tokens" in said or "--max-request-mb" in said)
        statuses = [post(b"z")[0] for _ in range(40)]  # over 20 a second
        assert 429 in statuses and set(statuses) <= {400, 429}
        time.sleep(1.5)
        client = ServedTeacher(url, secret_file=str(secret), retries=3, backoff=0.2)
        try:  # still serving, the right answer
            assert client.hidden_states(batch, 96)[batch.teacher_mask].abs().sum() > 0
        finally:
            client.close()
        assert proc.poll() is None
    # a non-loopback address without a secret is refused before anything loads
    r = subprocess.run([sys.executable, "-m", "memopd.cli", "serve-teacher", str(tiny_models[0]), "--host", "0.0.0.0"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == EXIT_BAD_INPUT and len(r.stderr.strip().splitlines()) == 1
    assert "--secret-file" in r.stderr


def test_unreachable_and_mismatched_server(tiny_models, tiny_server, tmp_path):
    from memopd.teacher_client import ServedTeacher

    client = ServedTeacher(tiny_server[1], retries=0)
    try:
        with pytest.raises(UserError, match="129 ids"):  # a vocabulary the teacher cannot score, at connect
            client.check(129)
        client.check(128)
        # the lm_head from a local copy of the served files: the downloaded one, bit for bit
        local = ServedTeacher(tiny_server[1], retries=0, head_dir=str(tiny_models[0]))
        assert torch.equal(local.lm_head().weight, client.lm_head().weight)
        local.close()
        tiny_models[1].save_pretrained(tmp_path / "other")  # other weights: refused, both fingerprints named
        other = ServedTeacher(tiny_server[1], retries=0, head_dir=str(tmp_path / "other"))
        with pytest.raises(UserError, match=client.fingerprint["sha256"][:16]):
            other.lm_head()
        other.close()
    finally:
        client.close()
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nobody listens there now
    t0 = time.monotonic()
    with pytest.raises(PeerError, match=f"127.0.0.1:{port}.*after 3 tries") as e:
        ServedTeacher(f"http://127.0.0.1:{port}", retries=2, backoff=0.1)
    assert e.value.exit_code == EXIT_PEER_FAILED and time.monotonic() - t0 >= 0.3  # backoff 0.1 + 0.2


# ---- memopd train teacher_url=... ---------------------------------------------------------------------------------

def _cfg(sft_dirs, run_dir, **kw):
    from memopd.trainer.config import TrainConfig

    base = dict(steps=2, run_dir=str(run_dir), student=sft_dirs[0], tasks_per_step=2, group_size=2, train_k=[1],
                eval_k=[1], eval_tasks=2, ppo_epochs=1, minibatches=2, checkpoint_every=1, progress=False, seed=4)
    base.update(kw)
    return TrainConfig.from_dict(base)


def _train_lines(run_dir):
    lines = [json.loads(x) for x in open(os.path.join(run_dir, "metrics.jsonl"))]
    return [{k: v for k, v in x.items() if not k.startswith("time/")} for x in lines if "train/pg_loss" in x]


@pytest.fixture(scope="module")
def teacher_port():
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_train_connects_to_the_served_teacher_before_building_any_model(tmp_path, teacher_port):
    """No server at teacher_url: `train` stops with the PeerError before it loads or SFTs
    a model (no student given, so the default models would be built first otherwise): the
    SFT cache stays empty and the fresh run directory unused."""
    from memopd.trainer.config import TrainConfig
    from memopd.trainer.loop import train

    cfg = TrainConfig.from_dict(dict(steps=1, run_dir=str(tmp_path / "run"), cache_dir=str(tmp_path / "cache"),
                                     teacher_url=f"http://127.0.0.1:{teacher_port}", teacher_retries=0,
                                     progress=False))
    with pytest.raises(PeerError, match="did not answer GET /info") as e:
        train(cfg, log=lambda _: None)
    assert e.value.exit_code == EXIT_PEER_FAILED
    cache = tmp_path / "cache"
    assert not cache.exists() or not any(cache.rglob("*.safetensors"))
    from memopd.trainer.rundir import previous_outputs

    assert not previous_outputs(str(tmp_path / "run"))  # nothing but the lock: the same command can run again


def test_train_with_served_teacher_equals_in_process(sft_dirs, tmp_path, teacher_port):
    from memopd.trainer.loop import train
    from memopd.trainer.rundir import read_manifest

    quiet = dict(log=lambda *_: None)
    train(_cfg(sft_dirs, tmp_path / "local", teacher=sft_dirs[1]), **quiet)
    with served(sft_dirs[1], port=teacher_port) as (_, url):
        rep = train(_cfg(sft_dirs, tmp_path / "served", teacher_url=url), **quiet)
    local, remote = _train_lines(tmp_path / "local"), _train_lines(tmp_path / "served")
    assert [x["step"] for x in remote] == [1, 2] and remote[0]["train/kl_teacher"] > 0
    assert remote == local  # every metric of every step, exactly
    assert rep["teacher"] == url
    fp = read_manifest(str(tmp_path / "served" / "checkpoints" / "step_2"))["models"]["teacher"]
    from memopd.files import weights_fingerprint

    assert fp["url"] == url and fp["sha256"] == weights_fingerprint(sft_dirs[1])["sha256"]


def test_server_dies_mid_run_then_resume(sft_dirs, tmp_path, teacher_port):
    """SIGKILL of the server after the first step: the trainer stops with one line and exit
    69, the complete checkpoints stand, --resume finishes once the server is back, with the
    same metrics as the uninterrupted run; a server of other weights is refused on resume."""
    from memopd.trainer.loop import train

    run_dir = tmp_path / "run"
    args = [f"student={sft_dirs[0]}", f"run_dir={run_dir}", "steps=3", "tasks_per_step=2", "group_size=2",
            "train_k=[1]", "eval_k=[1]", "eval_tasks=2", "ppo_epochs=1", "minibatches=2", "checkpoint_every=1",
            "progress=false", "seed=4", "teacher_retries=2", "teacher_timeout=20"]
    with served(sft_dirs[1], port=teacher_port) as (server, url):
        trainer = subprocess.Popen([sys.executable, "-m", "memopd.cli", "train", f"teacher_url={url}", *args], cwd=ROOT,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   env={**os.environ, "OMP_NUM_THREADS": "1"})
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and trainer.poll() is None:
            if metrics.exists() and '"step": 1,' in metrics.read_text():
                break
            time.sleep(0.05)
        server.send_signal(signal.SIGKILL)
        server.wait()
        out, err = trainer.communicate(timeout=300)
    assert trainer.returncode == EXIT_PEER_FAILED, err[-2000:]
    said = err.strip().splitlines()
    assert len(said) == 1 and url in said[0] and "--resume" in said[0], err[-2000:]
    done = [x["step"] for x in _train_lines(run_dir)]
    assert done and done == list(range(1, len(done) + 1)) and len(done) < 3
    ckpts = sorted(os.listdir(run_dir / "checkpoints"))
    assert [c for c in ckpts if c.startswith("step_")] == [f"step_{s}" for s in done]  # no half-written step
    assert not (run_dir / "final").exists()
    # a restarted server of other weights (the student's) is refused, naming both fingerprints
    from memopd.files import weights_fingerprint

    with served(sft_dirs[0], port=teacher_port) as (_, url2):
        with pytest.raises(RunDirError) as e:
            train(_cfg(sft_dirs, run_dir, steps=3, teacher_url=url2), resume=True, log=lambda *_: None)
    msg = str(e.value)
    assert "\n" not in msg and weights_fingerprint(sft_dirs[0])["sha256"][:16] in msg
    assert weights_fingerprint(sft_dirs[1])["sha256"][:16] in msg
    # the same teacher back on its port: the run continues and ends as an uninterrupted one
    with served(sft_dirs[1], port=teacher_port) as (_, url):
        train(_cfg(sft_dirs, run_dir, steps=3, teacher_url=url), resume=True, log=lambda *_: None)
    resumed = _train_lines(run_dir)
    assert [x["step"] for x in resumed] == [1, 2, 3]
    ref = tmp_path / "ref"
    with served(sft_dirs[1], port=teacher_port) as (_, url):
        from memopd.trainer.loop import train as train_again

        train_again(_cfg(sft_dirs, ref, steps=3, teacher_url=url), log=lambda *_: None)
    assert resumed == _train_lines(ref)


def test_train_topk_mode(sft_dirs, tmp_path):
    """teacher_topk=K: the server sends top-K log-probs, the trainer never reads the lm_head;
    with K = the whole vocabulary the top-k KL is the full one, so the metrics match the
    full-vocabulary run to rounding (the two ops sum in different orders)."""
    from memopd.trainer.loop import train

    quiet = dict(log=lambda *_: None)
    with served(sft_dirs[1]) as (_, url):
        from memopd.teacher_client import ServedTeacher

        vocab = ServedTeacher(url).head_rows
        train(_cfg(sft_dirs, tmp_path / "full", teacher_url=url, steps=1, checkpoint_every=0), **quiet)
        train(_cfg(sft_dirs, tmp_path / "topV", teacher_url=url, steps=1, checkpoint_every=0, teacher_topk=vocab), **quiet)
        train(_cfg(sft_dirs, tmp_path / "top4", teacher_url=url, steps=1, checkpoint_every=0, teacher_topk=4), **quiet)
    full, top_v, top4 = (_train_lines(tmp_path / n)[0] for n in ("full", "topV", "top4"))
    assert full["train/kl_teacher"] > 0
    assert top_v["train/kl_teacher"] == pytest.approx(full["train/kl_teacher"], rel=1e-4)
    assert top_v["train/pg_loss"] == pytest.approx(full["train/pg_loss"], rel=1e-4, abs=1e-6)
    assert top4["train/kl_teacher"] != pytest.approx(full["train/kl_teacher"], rel=1e-3)  # a truncated KL
