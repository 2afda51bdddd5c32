"""memopd's verl recipe driven by verl 0.9.1's own classes.

A tiny Qwen2 model serves behind verl's rollout-server interface as a Ray actor; verl's
`GlobalRequestLoadBalancer` (as a Ray actor) and `LLMServerClient` route the calls; the
agent loop is instantiated from verl's registry (`_agent_loop_registry`, `@register`) the
way verl's `AgentLoopWorker._run_agent_loop` does (`hydra.utils.instantiate` with the
trainer config composed from examples/verl/memopd_compact_memory.yaml over verl's
`ppo_trainer`). The sessions run with a sliding-window memory (contexts rewritten). Then:
per-call rows, their restored packed forward against independent per-call forwards, the
teacher's scores of every call, the RCE hook, and the registered loss against verl's own
`ppo_loss` on the same rows (float64) for every `loss_agg_mode`, plus the KL term, and the
session weighting."""
import asyncio
import os

import pytest
import torch

from memopd.integrations.verl.rows import ROW_KEY, sessions_from_rows

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
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap, _agent_loop_registry
    from verl.utils.dataset.rl_dataset import RLHFDataset
    from verl.workers.rollout.llm_server import LLMServerClient
    from verl.workers.rollout.router import GlobalRequestLoadBalancer

    import memopd.integrations.verl.agent_loop  # noqa: F401 - registers memopd_compact_memory
    from _tiny_server import TinyModelServer
    from memopd.env.tokenizer import build_tokenizer

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
