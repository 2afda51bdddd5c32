"""memopd's verl recipe driven by verl 0.9.1's own classes.

A tiny Qwen2 model serves behind verl's rollout-server interface as a Ray actor; verl's
`GlobalRequestLoadBalancer` (as a Ray actor) and `LLMServerClient` route the calls; the
agent loop is instantiated from verl's registry (`_agent_loop_registry`, `@register`) the
way verl's `AgentLoopWorker._run_agent_loop` does (`hydra.utils.instantiate` with the
trainer config composed from examples/verl/memopd_compact_memory.yaml over verl's
`ppo_trainer`). The sessions run with a sliding-window memory (contexts rewritten). Then:
per-call rows, their restored packed forward against independent per-call forwards, the
teacher's scores of every call (in process, and through a real `memopd serve-teacher`
process on a loopback port: the same, every call), the RCE hook, and the registered loss
against verl's own `ppo_loss` on the same rows (float64) for every `loss_agg_mode`, plus
the KL term, and the session weighting."""
import asyncio
import os

import pytest
import torch

from memopd.integrations.verl.rows import ROW_KEY, sessions_from_rows

pytestmark = pytest.mark.usefixtures("one_torch_thread")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
V = 97
MODEL = dict(family="qwen2", vocab_size=V, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, seed=3,
             initializer_range=0.2)
TEACHER = dict(MODEL, seed=11, hidden_size=48, num_heads=4, num_kv_heads=2)
MAX_NEW = 5


def _model(kw):
    from memopd.models import tiny_causal_lm

    kw = dict(kw)
    return tiny_causal_lm(kw.pop("family"), **kw).eval()


def _config():
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=os.path.join(ROOT, "examples", "verl"), version_base=None):
        return compose(config_name="memopd_compact_memory", overrides=[
            "actor_rollout_ref.rollout.prompt_length=64", f"actor_rollout_ref.rollout.response_length={MAX_NEW}",
            "memopd.policy=window", "memopd.policy_kwargs.turns=1", "memopd.max_calls=6"])


ROWS = [  # dataset rows: q, x_0, the environment's answer after each call, the reward
    {"uid": "p0", "session_id": 0, "memopd_prefix_ids": [5, 6, 7, 8], "memopd_context_ids": [9, 10],
     "memopd_observations": [[11, 12, 13], [14], [15, 16], []], "memopd_reward": 1.0},
    {"uid": "p1", "session_id": 0, "memopd_prefix_ids": [20, 21, 22], "memopd_context_ids": [],
     "memopd_observations": [[23, 24], [25, 26, 27]], "memopd_reward": 0.0},
    {"uid": "p1", "session_id": 1, "memopd_prefix_ids": [20, 21, 22], "memopd_context_ids": [],
     "memopd_observations": [[28]], "memopd_reward": 0.5},
]


@pytest.fixture(scope="module")
def episode():
    """(config, outputs per dataset row, number of generate calls the server answered)."""
    import hydra
    import ray
    from _tiny_server import TinyModelServer
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap, _agent_loop_registry
    from verl.utils.dataset.rl_dataset import RLHFDataset
    from verl.workers.rollout.llm_server import LLMServerClient
    from verl.workers.rollout.router import GlobalRequestLoadBalancer

    import memopd.integrations.verl.agent_loop  # noqa: F401 - registers memopd_compact_memory
    from memopd.env.qa.tokenizer import build_tokenizer

    # the server actor imports this folder's _tiny_server and the checkout's memopd
    path = os.pathsep.join([ROOT, HERE, os.environ.get("PYTHONPATH", "")])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
             runtime_env={"env_vars": {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"}})
    try:
        cfg = _config()
        server = ray.remote(TinyModelServer).remote(MODEL, MAX_NEW)
        balancer = ray.remote(GlobalRequestLoadBalancer).remote(servers={"tiny-0": server})
        client = LLMServerClient(cfg, balancer)
        tokenizer = build_tokenizer(["alpha beta gamma delta"], kind="bpe", vocab_size=300)
        sampling = dict(temperature=1.0, top_p=1.0, top_k=-1, repetition_penalty=1.0, logprobs=True)

        async def run_all():
            outs = []
            for row in ROWS:
                loop = hydra.utils.instantiate(
                    config=_agent_loop_registry["memopd_compact_memory"], trainer_config=DictConfigWrap(cfg),
                    server_manager=client, tokenizer=tokenizer, processor=None, hf_model_type="qwen2",
                    dataset_cls=RLHFDataset, data_config=DictConfigWrap(cfg.data), tools=ToolListWrap([]))
                outs.append(await loop.run(sampling, **row))
            return outs

        outputs = asyncio.run(run_all())
        served = ray.get(server.num_calls.remote())
        yield cfg, outputs, served
    finally:
        ray.shutdown()


def test_one_agent_loop_output_per_call(episode):
    from verl.experimental.agent_loop.agent_loop import AgentLoopOutput

    _, outputs, served = episode
    assert [len(o) for o in outputs] == [4, 2, 1]
    assert served == 7  # every call went through verl's client to the server actor
    for row, outs in zip(ROWS, outputs):
        q = row["memopd_prefix_ids"]
        for t, out in enumerate(outs):
            assert isinstance(out, AgentLoopOutput)
            rec = out.extra_fields[ROW_KEY]
            inv = rec["invocation"]
            assert rec["call"] == t and rec["num_calls"] == len(outs)
            assert rec["session_id"] == f"{row['uid']}_{row['session_id']}"
            assert out.prompt_ids == q + inv["context_ids"] and out.response_ids == inv["action_ids"]
            assert out.response_mask == [1] * len(inv["action_ids"]) == rec["action_domain_mask"]
            assert len(out.response_logprobs) == len(out.response_ids) and max(out.response_logprobs) <= 0
            assert 1 <= len(out.response_ids) <= MAX_NEW and out.reward_score == row["memopd_reward"]
            d = out.as_dict()  # verl's own conversion to a row
            assert torch.equal(d["responses"], torch.tensor(inv["action_ids"]))
            assert d["rm_scores"][-1] == row["memopd_reward"]
    # the window memory (1 turn) rewrote the context: call 2 of session 0 no longer holds call 0's action
    s0 = [o.extra_fields[ROW_KEY]["invocation"] for o in outputs[0]]
    assert s0[1]["context_ids"][-3:] == [11, 12, 13]
    assert len(s0[2]["context_ids"]) < len(s0[1]["context_ids"]) + len(s0[1]["action_ids"]) + 1
    assert not any(src == 1 and call == 0 for src, call, _ in s0[2]["provenance"])


def _rows(episode):
    return [o for outs in episode[1] for o in outs]


def test_restored_packed_forward_equals_per_call_forwards(episode):
    from memopd.rce import audit, restored_logprobs

    rows = _rows(episode)[::-1]  # any order: the rows are grouped back into sessions
    sessions, ids = sessions_from_rows(rows)
    assert sorted(ids) == ["p0_0", "p1_0", "p1_1"] and sorted(len(s.invocations) for s in sessions) == [1, 2, 4]
    model = _model(MODEL)
    res = {r.variant: r for r in audit(model, sessions, ("aligned", "positions_broken", "visibility_broken"))}
    print("RCE fp32 aligned: max |logit diff| %.2e, max |dlogp| %.2e over %d actions"
          % (res["aligned"].max_logit_linf, res["aligned"].max_dlogp, res["aligned"].actions))
    assert res["aligned"].actions == sum(len(o.response_ids) for o in rows)
    assert res["aligned"].max_logit_linf <= 1e-5 and res["aligned"].max_dlogp <= 1e-5
    # the restored state is what makes them equal: break either half and they differ
    assert res["positions_broken"].max_logit_linf > 1e-3 and res["visibility_broken"].max_logit_linf > 1e-3
    # and the sampler's own log-probs (recorded by the server) are the restored ones
    lp, rec = restored_logprobs(model, sessions)
    assert rec.shape == lp.shape and not bool(torch.isnan(rec).any())
    print("sampler log-probs vs restored: max |d| %.2e" % float((lp.double() - rec.double()).abs().max()))
    assert float((lp.double() - rec.double()).abs().max()) <= 1e-5


def test_teacher_scores_every_call_in_its_restored_state(episode):
    from memopd.hf import independent_forward
    from memopd.integrations.verl.teacher import TEACHER_KEY, LocalTeacherScorer, score_every_call

    rows = _rows(episode)
    teacher = _model(TEACHER)
    n = asyncio.run(score_every_call(rows, LocalTeacherScorer(teacher, max_tokens=64)))
    assert n == len(rows) == 7
    worst = 0.0
    for out in rows:
        score = out.extra_fields[TEACHER_KEY]
        inv = out.extra_fields[ROW_KEY]["invocation"]
        n_in = len(inv["prefix_ids"]) + len(inv["context_ids"])
        assert score.kind == "hidden" and score.hidden.shape == (len(inv["action_ids"]), 48)
        with torch.no_grad():
            ref = independent_forward(teacher, inv["prefix_ids"] + inv["context_ids"] + inv["action_ids"], output="hidden")
        worst = max(worst, float((score.hidden - ref[n_in - 1:n_in - 1 + len(inv["action_ids"])]).abs().max()))
    print(f"teacher hidden states, packed vs per call: max |diff| {worst:.2e} over {len(rows)} calls")
    assert worst <= 1e-5
    # the calls before the last are scored too, and differ from the last call's scores
    first, last = rows[0].extra_fields[TEACHER_KEY].hidden, rows[3].extra_fields[TEACHER_KEY].hidden
    assert first.abs().sum() > 0 and not torch.equal(first[:1], last[:1])


# ----------------------------------------------------------------- the served teacher (memopd serve-teacher)


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """The tiny teacher saved as a checkpoint directory, as `memopd serve-teacher` loads one."""
    d = tmp_path_factory.mktemp("verl_teacher") / "teacher"
    _model(TEACHER).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def teacher_url(teacher_dir):
    """A real `memopd serve-teacher` process serving it on a free loopback port."""
    from _teacher_server import served

    with served(teacher_dir) as (_, url):
        yield url


def _scores(rows, scorer):
    from memopd.integrations.verl.teacher import TEACHER_KEY, score_every_call

    assert asyncio.run(score_every_call(rows, scorer)) == len(rows)
    return [r.extra_fields[TEACHER_KEY] for r in rows]


def test_served_scorer_equals_the_in_process_one_for_every_call(episode, teacher_dir, teacher_url):
    """`memopd.teacher.kind=served` through the config: each call's hidden states, the
    teacher's head, the per-call full-vocabulary KL and the registered fused loss equal the
    in-process teacher's on the same sessions (fp32)."""
    from omegaconf import OmegaConf

    from memopd.files import weights_fingerprint
    from memopd.hf import head_of, independent_forward, packed_forward
    from memopd.integrations.verl.agent_loop import memopd_settings
    from memopd.integrations.verl.teacher import LocalTeacherScorer, ServedTeacherScorer, build_scorer, session_groups
    from memopd.integrations.verl.training import memopd_actor_loss, session_inputs
    from memopd.models import load_local_model

    rows = _rows(episode)
    n_requests = len(session_groups(sessions_from_rows(rows)[0], 64))
    assert n_requests > 1  # several requests, whole sessions in each
    teacher = load_local_model(teacher_dir).eval().requires_grad_(False)
    sha = weights_fingerprint(teacher_dir)["sha256"]
    example = memopd_settings(_config())["teacher"]  # the example config's keys, switched to the served teacher
    settings = {"teacher": {**example, "kind": "served", "url": teacher_url, "max_tokens": 64, "retries": 1,
                            "fingerprint": sha[:16]}}
    served = build_scorer(None, settings)
    try:
        assert isinstance(served, ServedTeacherScorer) and served.kind == "hidden"
        assert served.fingerprint["sha256"] == sha and served.fingerprint["url"] == teacher_url
        local_scores = _scores(rows, LocalTeacherScorer(teacher, max_tokens=64))
        sent = served.client.bytes_sent
        served_scores = _scores(rows, served)
        assert served.client.bytes_sent > sent  # the sessions went over the wire
        head = served.head()
        got = served.client.bytes_received
        assert served.head() is head and served.client.bytes_received == got  # the head is read once
        half = build_scorer(None, {"teacher": {**settings["teacher"], "transport": "bf16"}})
        try:  # bf16 on the wire: the fp32 states rounded once
            bf16_scores = _scores(rows, half)
        finally:
            half.close()
    finally:
        served.close()
    assert all(torch.equal(b.hidden, a.hidden.to(torch.bfloat16).float()) for a, b in zip(local_scores, bf16_scores))
    local_head = head_of(teacher)
    assert torch.equal(head.weight, local_head.weight) and head.scale == local_head.scale and head.bias is None
    # every call, not only the last: hidden states and the full-vocabulary reverse KL of the call
    student = _model(MODEL)
    dh = dkl = 0.0
    for out, a, b in zip(rows, local_scores, served_scores):
        inv = out.extra_fields[ROW_KEY]["invocation"]
        n_in, n = len(inv["prefix_ids"]) + len(inv["context_ids"]), len(inv["action_ids"])
        assert a.kind == b.kind == "hidden" and a.hidden.shape == b.hidden.shape == (n, 48)
        assert b.hidden.dtype == torch.float32 and b.hidden.abs().sum() > 0
        dh = max(dh, float((a.hidden - b.hidden).abs().max()))
        with torch.no_grad():
            hs = independent_forward(student, inv["prefix_ids"] + inv["context_ids"] + inv["action_ids"], output="hidden")
            ls = torch.log_softmax(head_of(student).logits(hs[n_in - 1:n_in - 1 + n]), -1)
            kl = [float((ls.exp() * (ls - torch.log_softmax(hd.logits(sc.hidden), -1))).sum())
                  for hd, sc in ((local_head, a), (head, b))]
        assert kl[0] > 0
        dkl = max(dkl, abs(kl[0] - kl[1]))
    # the registered fused loss (PPO + entropy + teacher KL) fed either teacher's states
    sessions, ids = sessions_from_rows(rows)
    where = {(r.extra_fields[ROW_KEY]["session_id"], r.extra_fields[ROW_KEY]["call"]): i for i, r in enumerate(rows)}
    per = [[where[(sid, t)] for t in range(len(tr.invocations))] for sid, tr in zip(ids, sessions)]
    g = torch.Generator().manual_seed(1)
    old = [[torch.tensor(rows[i].response_logprobs) - 0.3 * torch.rand(len(rows[i].response_ids), generator=g)
            for i in calls] for calls in per]
    adv = [[torch.randn(len(rows[i].response_ids), generator=g) for i in calls] for calls in per]
    config = OmegaConf.create({"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0,
                               "entropy_coeff": 0.01, "loss_agg_mode": "seq-mean-token-mean", "global_batch_info": {},
                               "teacher_kl_coef": KL_COEF, "memopd_weighting": "per_session"})
    results = []
    for scores, hd in ((local_scores, local_head), (served_scores, head)):
        inputs = session_inputs(sessions, old, adv, [[scores[i].hidden for i in calls] for calls in per])
        with torch.no_grad():
            h = packed_forward(student, inputs.batch, output="hidden")
            loss, metrics = memopd_actor_loss(config, {"hidden": h, "head": head_of(student), "inputs": inputs,
                                                       "teacher_head": hd})
        results.append((float(loss), metrics["memopd/teacher_kl"]))
    (loss_in, kl_in), (loss_sv, kl_sv) = results
    print(f"served vs in-process teacher, fp32, {len(rows)} calls in {n_requests} requests: max |dh| {dh:.3g}, "
          f"max |dKL| per call {dkl:.3g}, "
          f"|dloss| {abs(loss_in - loss_sv):.3g}, |dKL| in the loss {abs(kl_in - kl_sv):.3g}, "
          f"bitwise {dh == 0 and dkl == 0 and loss_in == loss_sv}")
    assert kl_in > 0 and metrics["memopd/calls"] == 7
    assert dh <= 1e-6 and dkl <= 1e-6 and abs(loss_in - loss_sv) <= 1e-6 and abs(kl_in - kl_sv) <= 1e-6


def test_served_scorer_faults(episode, teacher_dir, teacher_url):
    """A dead server is one PeerError line naming it (at connect, and mid-run after it
    stopped); another teacher's fingerprint and a missing url are refused at connect."""
    import socket

    from _teacher_server import served

    from memopd.errors import EXIT_PEER_FAILED, PeerError, UserError
    from memopd.integrations.verl.teacher import TEACHER_KEY, build_scorer

    def settings(**kw):
        return {"teacher": {"kind": "served", "max_tokens": 64, "timeout": 5, "retries": 1, **kw}}

    with socket.socket() as sock:  # a loopback port nobody listens on
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    with pytest.raises(PeerError) as e:
        build_scorer(None, settings(url=dead))
    assert e.value.exit_code == EXIT_PEER_FAILED and dead in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(UserError, match="memopd.teacher.url"):
        build_scorer(None, settings())
    with pytest.raises(UserError, match="fingerprint") as e:
        build_scorer(None, settings(url=teacher_url, fingerprint="0" * 64))
    assert teacher_url in str(e.value)
    # a server that stops between connect and scoring
    rows = _rows(episode)
    before = [r.extra_fields.get(TEACHER_KEY) for r in rows]
    with served(teacher_dir) as (proc, url):
        scorer = build_scorer(None, settings(url=url))
        proc.terminate()
        proc.wait(timeout=20)
    try:
        with pytest.raises(PeerError) as e:
            _scores(rows, scorer)
    finally:
        scorer.close()
    msg = str(e.value)
    print("dead teacher server:", msg)
    assert url in msg and "did not answer" in msg and "trainer.resume_mode" in msg and "\n" not in msg
    assert all(r.extra_fields.get(TEACHER_KEY) is b for r, b in zip(rows, before))  # no row half written


def test_rce_audit_hook_logs_every_n_steps(episode):
    from memopd.integrations.verl.audit import RCEAuditHook

    hook = RCEAuditHook(every=3, max_sessions=2)
    model = _model(MODEL)
    assert hook(1, model, _rows(episode)) == {}
    m = hook(3, model, _rows(episode))
    assert m["memopd/rce_passed"] == 1.0 and m["memopd/rce_max_dlogp"] <= 1e-5
    assert m["memopd/rce_actions"] == sum(len(o.response_ids) for o in episode[1][0] + episode[1][1])
    with pytest.raises(ValueError, match="every"):
        RCEAuditHook(every=0)


# ----------------------------------------------------------------- the registered loss vs verl's ppo_loss

T = 0.9
KL_COEF = 0.3
MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
INFOS = {"local": {}, "dp2": {"dp_size": 2, "batch_num_tokens": 61, "global_batch_size": 5, "loss_scale_factor": 8}}


@pytest.fixture(scope="module")
def loss_case(episode):
    """float64 student and teacher, the sessions of the episode's rows, per-call old
    log-probs, advantages and teacher hidden states (from the teacher hook), and the
    independent per-call forwards verl's loss is fed with."""
    from memopd.hf import independent_forward
    from memopd.integrations.verl.teacher import LocalTeacherScorer

    sessions, _ = sessions_from_rows(_rows(episode))
    student, teacher = _model(MODEL).double(), _model(TEACHER).double()
    scores = LocalTeacherScorer(teacher).score_now(sessions)
    g = torch.Generator().manual_seed(0)
    old, adv, th, ref = [], [], [], []
    for s, tr in enumerate(sessions):
        old.append([]), adv.append([]), th.append([]), ref.append([])
        for t, inv in enumerate(tr.invocations):
            n = len(inv.action_ids)
            old[s].append(torch.tensor(inv.sample_logprobs, dtype=torch.float64) + 0.4 * torch.randn(n, generator=g,
                                                                                                     dtype=torch.float64))
            adv[s].append(2 * torch.randn(n, generator=g, dtype=torch.float64))
            th[s].append(scores[s][t].hidden)
            n_in = len(inv.prefix_ids) + len(inv.context_ids)
            ids = inv.prefix_ids + inv.context_ids + inv.action_ids
            with torch.no_grad():
                zt = independent_forward(teacher, ids)[n_in - 1:n_in - 1 + n] / T
            ref[s].append((n_in, ids, zt))
    return sessions, student, teacher, old, adv, th, ref


def _memopd_loss(case, mode, weighting, info, via_forward=False):
    from omegaconf import OmegaConf

    from memopd.hf import head_of, packed_forward
    from memopd.integrations.verl.training import install_packed_loss_forward, memopd_actor_loss, session_inputs

    sessions, student, teacher, old, adv, th, _ = case
    inputs = session_inputs(sessions, old, adv, th)
    config = OmegaConf.create({"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0,
                               "entropy_coeff": 0.01, "loss_agg_mode": mode, "global_batch_info": dict(info),
                               "teacher_kl_coef": KL_COEF, "temperature": T, "memopd_weighting": weighting})
    if via_forward:  # inside the model's own forward, as the engine runs it
        model = install_packed_loss_forward(student)
        return model(memopd_batch=inputs.batch, memopd_loss=lambda h, head: memopd_actor_loss(
            config, {"hidden": h, "head": head, "inputs": inputs, "teacher_head": head_of(teacher)}))
    h = packed_forward(student, inputs.batch, output="hidden")
    return memopd_actor_loss(config, {"hidden": h, "head": head_of(student), "inputs": inputs,
                                      "teacher_head": head_of(teacher)})


def _verl_loss(case, mode, weighting, info):
    """verl's own ppo_loss on verl's rows (one per call, or one per session with its calls'
    responses concatenated), fed the log-probs and entropy of independent per-call
    forwards, plus KL_COEF x verl's agg_loss of the full-vocabulary reverse KL."""
    from omegaconf import OmegaConf
    from tensordict import TensorDict
    from verl.trainer.ppo.core_algos import agg_loss
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import ppo_loss

    sessions, student, _, old, adv, _, ref = case
    calls = []  # (session, prompt length, log_probs, entropy, kl, old, adv) per call
    for s, tr in enumerate(sessions):
        for t in range(len(tr.invocations)):
            n_in, ids, zt = ref[s][t]
            n = zt.shape[0]
            z = student(input_ids=torch.tensor([ids]), use_cache=False).logits[0, n_in - 1:n_in - 1 + n] / T
            ls, lt = torch.log_softmax(z, -1), torch.log_softmax(zt, -1)
            lp = ls.gather(-1, torch.tensor(ids[n_in:])[:, None])[:, 0]
            calls.append((s, n_in, lp, -(ls.exp() * ls).sum(-1), (ls.exp() * (ls - lt)).sum(-1), old[s][t], adv[s][t]))
    if weighting == "per_session":  # one row per session: the calls' responses side by side
        rows = []
        for s in range(len(sessions)):
            mine = [c for c in calls if c[0] == s]
            rows.append((s, mine[0][1], *(torch.cat([c[k] for c in mine]) for k in range(2, 7))))
    else:
        rows = calls
    B, P, R = len(rows), max(r[1] for r in rows), max(r[2].shape[0] for r in rows)
    prompts = torch.zeros(B, P, dtype=torch.long)
    att = torch.zeros(B, P + R, dtype=torch.long)
    pad = {k: torch.zeros(B, R, dtype=torch.float64) for k in ("old", "adv", "kl")}
    mask = torch.zeros(B, R, dtype=torch.long)
    flat_lp, flat_ent = [], []
    for b, (_, p, lp, ent, kl, o, a) in enumerate(rows):
        n = lp.shape[0]
        att[b, P - p:P + n] = 1
        mask[b, :n] = 1
        pad["old"][b, :n], pad["adv"][b, :n], pad["kl"][b, :n] = o, a, kl
        # verl's unpadded engine output: position i holds the prediction of token i + 1
        flat_lp.append(torch.cat([lp.new_zeros(p - 1), lp, lp.new_zeros(1)]))
        flat_ent.append(torch.cat([ent.new_zeros(p - 1), ent, ent.new_zeros(1)]))
    data = TensorDict({"prompts": prompts, "responses": torch.zeros(B, R, dtype=torch.long), "attention_mask": att,
                       "response_mask": mask, "old_log_probs": pad["old"], "advantages": pad["adv"]}, batch_size=[B])
    tu.assign_non_tensor(data, dp_size=info.get("dp_size", 1), batch_num_tokens=info.get("batch_num_tokens"),
                         global_batch_size=info.get("global_batch_size"))
    config = OmegaConf.create({"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0,
                               "global_batch_info": {}, "loss_scale_factor": info.get("loss_scale_factor"),
                               "loss_agg_mode": mode, "policy_loss": {"loss_mode": "vanilla"}, "entropy_coeff": 0.01,
                               "use_kl_loss": False})
    loss, metrics = ppo_loss(config, {"log_probs": torch.cat(flat_lp), "entropy": torch.cat(flat_ent)}, data)
    kl = agg_loss(pad["kl"], mask.bool(), mode, **config.global_batch_info)
    return loss + KL_COEF * kl, metrics


@pytest.mark.parametrize("info", list(INFOS))
@pytest.mark.parametrize("weighting", ["per_call", "per_session"])
@pytest.mark.parametrize("mode", MODES)
def test_registered_loss_equals_verl_ppo_loss_plus_kl(loss_case, mode, weighting, info):
    got, metrics = _memopd_loss(loss_case, mode, weighting, INFOS[info])
    want, verl_metrics = _verl_loss(loss_case, mode, weighting, INFOS[info])
    assert float(verl_metrics["actor/pg_clipfrac"].aggregate()) > 0  # the clip branches are taken
    torch.testing.assert_close(got, want.to(got.dtype), rtol=1e-11, atol=1e-12)
    assert metrics["memopd/calls"] == 7 and metrics["memopd/teacher_kl"] > 0


@pytest.mark.parametrize("weighting", ["per_call", "per_session"])
def test_registered_loss_gradients_equal_verl_inside_the_forward(loss_case, weighting):
    student = loss_case[1]
    params = [p for p in student.parameters()]
    got, _ = _memopd_loss(loss_case, "seq-mean-token-mean", weighting, {}, via_forward=True)
    g_got = torch.autograd.grad(got, params, allow_unused=True)
    want, _ = _verl_loss(loss_case, "seq-mean-token-mean", weighting, {})
    g_want = torch.autograd.grad(want, params, allow_unused=True)
    diff = {n: float((a - b).abs().max()) for (n, _), a, b in zip(student.named_parameters(), g_got, g_want)}
    top = {n: d for n, d in diff.items() if n.startswith(("lm_head", "model.norm", "model.layers.1."))}
    print(f"{weighting}: loss {float(got.detach()):.6f}, max |gradient difference| {max(diff.values()):.2e} "
          f"(lm_head, final norm, last layer: {max(top.values()):.2e}; float64)")
    assert all((a is None) == (b is None) for a, b in zip(g_got, g_want)) and float(got) != 0.0
    # the head, the fused loss and the last layer agree to float64 rounding; what flows back
    # through the packed attention's CPU backward into earlier layers differs by ~1e-8
    assert max(top.values()) <= 1e-12 and max(diff.values()) <= 1e-6


def test_session_weighting_as_documented(loss_case):
    from memopd.integrations.verl.training import session_inputs, token_weights

    sessions = loss_case[0]
    batch = session_inputs(sessions, loss_case[3], loss_case[4]).batch
    n_calls = torch.tensor([len(tr.invocations) for tr in sessions], dtype=torch.float64)
    for mode in ("seq-mean-token-sum", "seq-mean-token-mean"):
        per_call = torch.zeros(len(sessions), dtype=torch.float64).index_add_(
            0, batch.traj_index, token_weights(batch, sessions, mode, "per_call"))
        per_session = torch.zeros(len(sessions), dtype=torch.float64).index_add_(
            0, batch.traj_index, token_weights(batch, sessions, mode, "per_session"))
        if mode == "seq-mean-token-mean":  # each row's tokens sum to 1/G: a session weighs its call count (per call) or 1
            torch.testing.assert_close(per_call, n_calls / n_calls.sum())
            torch.testing.assert_close(per_session, torch.full_like(per_session, 1 / len(sessions)))
    # token modes do not see rows
    torch.testing.assert_close(token_weights(batch, sessions, "token-mean", "per_call"),
                               token_weights(batch, sessions, "token-mean", "per_session"))
    with pytest.raises(ValueError, match="weighting"):
        token_weights(batch, sessions, "token-mean", "per_turn")


def test_micro_batches_keep_sessions_whole_and_add_up(loss_case):
    from memopd.integrations.verl.rows import session_sizes
    from memopd.integrations.verl.training import session_micro_batches

    sessions, student, teacher, old, adv, th, _ = loss_case
    sizes = session_sizes(sessions)
    budget = max(sizes) + 1
    groups = session_micro_batches(sessions, budget)
    assert len(groups) > 1 and sorted(i for g in groups for i in g) == list(range(len(sessions)))
    assert all(sum(sizes[i] for i in g) <= budget for g in groups)
    with pytest.raises(ValueError, match="never split"):
        session_micro_batches(sessions, max(sizes) - 1)
    # gradient accumulation: micro-batch losses with the global counts add up to the whole batch's
    n_tokens = sum(len(i.action_ids) for tr in sessions for i in tr.invocations)
    for mode, info in (("token-mean", {"batch_num_tokens": n_tokens}), ("seq-mean-token-mean", {"global_batch_size": 3})):
        whole, _ = _memopd_loss(loss_case, mode, "per_session", info)
        parts = 0.0
        for g in groups:
            sub = ([sessions[i] for i in g], student, teacher, [old[i] for i in g], [adv[i] for i in g],
                   [th[i] for i in g], None)
            parts = parts + _memopd_loss(sub, mode, "per_session", info)[0]
        torch.testing.assert_close(parts, whole, rtol=1e-12, atol=1e-13)


def test_example_config_loads_in_verls_hydra_config():
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.import_utils import load_class_from_fqn
    from verl.workers.config import RolloutConfig

    from memopd.integrations.verl.agent_loop import CompactMemoryAgentLoop, memopd_settings

    cfg = _config()
    agent = cfg.actor_rollout_ref.rollout.agent
    assert agent.default_agent_loop == "memopd_compact_memory" and cfg.trainer.use_v1
    rollout = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)  # verl's own validation of the section
    assert isinstance(rollout, RolloutConfig) and rollout.calculate_log_probs
    manager = load_class_from_fqn(agent.agent_loop_manager_class, "AgentLoopManager")
    from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopManagerTQ

    assert issubclass(manager, AgentLoopManagerTQ)
    loops = OmegaConf.load(os.path.join(ROOT, agent.agent_loop_config_path))
    assert [x.name for x in loops] == ["memopd_compact_memory"]
    assert load_class_from_fqn(loops[0]._target_, "AgentLoop") is CompactMemoryAgentLoop
    s = memopd_settings(cfg)
    assert s["policy"] == "window" and s["policy_kwargs"] == {"turns": 1} and s["loss"]["weighting"] in ("per_call", "per_session")


def test_make_loss_fn_binds_the_memopd_settings(loss_case):
    from memopd.hf import head_of, packed_forward
    from memopd.integrations.verl.training import make_loss_fn, session_inputs

    sessions, student, teacher, old, adv, th, _ = loss_case
    actor = {"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0,
             "entropy_coeff": 0.01, "loss_agg_mode": "seq-mean-token-sum", "global_batch_info": {}}
    fn = make_loss_fn(actor, {"loss": {"teacher_kl_coef": KL_COEF, "weighting": "per_session"}}, temperature=T)
    inputs = session_inputs(sessions, old, adv, th)
    with torch.no_grad():
        got, _ = fn(model_output={"hidden": packed_forward(student, inputs.batch, output="hidden"),
                                  "head": head_of(student), "inputs": inputs, "teacher_head": head_of(teacher)},
                    data=None, dp_group=None)
        want, _ = _verl_loss(loss_case, "seq-mean-token-sum", "per_session", {})
    torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-12)
    with pytest.raises(ValueError, match="weighting"):
        make_loss_fn(actor, {"loss": {"weighting": "per_turn"}})
