"""Rollout engine: exact recording of what the model received and sampled."""
import pytest
import torch

from memopd.env import (
    Engine,
    EnvConfig,
    HFEngine,
    QAEnv,
    ScriptedExpert,
    World,
    WorldConfig,
    build_tokenizer,
    rollout,
    sample_next,
)
from memopd.env.qa.sft import ModelSpec, make_model
from memopd.records import load_trajectories, save_trajectories

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def setup():
    world = World.generate(WorldConfig(seed=2, n_entities=16))
    tok = build_tokenizer(world.vocabulary_texts())
    model = make_model(ModelSpec(32, 2, 2, 1, 64, max_position_embeddings=512), tok, seed=0,
                       attn_implementation="sdpa").eval()
    return world, tok, model


class Capture:
    """Wraps model.forward: records, per generation batch, the real ids each row received."""

    def __init__(self, model):
        self.model = model
        self.orig = model.forward
        self.rows = []  # per batch: list of lists (the prompt as received, then fed tokens)
        model.forward = self

    def __call__(self, input_ids=None, attention_mask=None, position_ids=None, **kw):
        if input_ids.shape[1] > 1 or not self.rows or kw.get("cache") is not None and kw["cache"].get_seq_length() == 0:
            # prefill: drop left padding using the attention mask
            rows = [input_ids[b][attention_mask[b].bool()].tolist() for b in range(input_ids.shape[0])]
            # positions must be exactly 0..n-1 for the real tokens
            for b in range(input_ids.shape[0]):
                pos = position_ids[b][attention_mask[b].bool()].tolist()
                assert pos == list(range(len(pos)))
            self.rows.append([[r, []] for r in rows])
        else:
            for b in range(input_ids.shape[0]):
                self.rows[-1][b][1].append(int(input_ids[b, 0]))
        return self.orig(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kw)

    def restore(self):
        self.model.forward = self.orig


def fresh_logprobs(model, inv):
    ids = inv.prefix_ids + inv.context_ids + inv.action_ids
    n = len(inv.prefix_ids) + len(inv.context_ids)
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1)
    return [float(lp[n - 1 + j, a]) for j, a in enumerate(inv.action_ids)]


@pytest.mark.parametrize("batch_size,temperature,top_p", [(8, 1.0, 1.0), (1, 1.0, 0.9), (8, 0.0, 1.0)])
def test_recorded_calls_are_exact(setup, batch_size, temperature, top_p):
    world, tok, model = setup
    env = QAEnv.from_world(world, tok, EnvConfig(max_turns=3))
    engine = HFEngine(model, pad_id=tok.pad_token_id, batch_size=batch_size)
    assert isinstance(engine, Engine) and isinstance(ScriptedExpert(tok), Engine)
    samples = []
    orig_generate = engine.generate

    def gen(prompts, **kw):
        out = orig_generate(prompts, **kw)
        samples.extend(zip([list(p) for p in prompts], out))
        return out

    engine.generate = gen
    cap = Capture(model)
    try:
        trajs = rollout(env, engine, world.sample_tasks(2, 2) + world.sample_tasks(4, 1), group_size=2,
                        temperature=temperature, top_p=top_p, max_new_tokens=12, seed=5)
    finally:
        cap.restore()
    assert len(trajs) == 6
    calls = [inv for tr in trajs for inv in tr.invocations]
    assert len(calls) == len(samples)
    # 1) what the model received, token for token, is prefix_ids + context_ids, and the
    #    ids fed back during decoding are the recorded action ids (all but the last).
    received = [(tuple(r), tuple(fed)) for batch in cap.rows for r, fed in batch]
    assert len(received) == len(calls)  # one prefill row per recorded call, nothing else
    for inv in calls:
        prompt = tuple(inv.prefix_ids + inv.context_ids)
        match = [fed for r, fed in received if r == prompt and fed[: len(inv.action_ids) - 1] == tuple(inv.action_ids[:-1])]
        assert match, "a recorded call does not match any input the model received"
    # 2) action ids are exactly the sampled ids; logprobs are the engine's
    by_prompt = {}
    for p, s in samples:
        by_prompt.setdefault(tuple(p), []).append(s)
    for inv in calls:
        cands = by_prompt[tuple(inv.prefix_ids + inv.context_ids)]
        assert any(s.ids == inv.action_ids and s.logprobs == inv.sample_logprobs for s in cands)
    # 3) recorded log-probs = a fresh unpadded forward's log-softmax at the sampled ids
    worst = 0.0
    for inv in calls:
        ref = fresh_logprobs(model, inv)
        worst = max(worst, max(abs(a - b) for a, b in zip(ref, inv.sample_logprobs)))
    assert worst < 1e-5, worst
    # 4) valid records, groups, round trip
    for i in range(0, 6, 2):
        assert trajs[i].group_id == trajs[i + 1].group_id == trajs[i].task_id
        assert trajs[i].info["rollout_index"] == 0 and trajs[i + 1].info["rollout_index"] == 1
    for tr in trajs:
        tr.validate(vocab_size=model.config.vocab_size)
        assert 1 <= len(tr) <= 3
        for inv in tr.invocations:
            assert len(inv.action_ids) <= 12
    import os
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        save_trajectories(os.path.join(d, "r.jsonl"), trajs)
        assert [t.to_json() for t in load_trajectories(os.path.join(d, "r.jsonl"))] == [t.to_json() for t in trajs]


def test_generation_stops_at_stop_ids_and_limits(setup):
    world, tok, model = setup
    engine = HFEngine(model, pad_id=tok.pad_token_id, batch_size=4)
    prompts = [[1, 5, 6, 7], [1, 8], [1, 9, 10]]
    # every id is a stop id: exactly one token each
    out = engine.generate(prompts, max_new_tokens=5, temperature=1.0, top_p=1.0,
                          stop_ids=list(range(len(tok))), seed=0)
    assert all(len(s.ids) == 1 and s.finish == "stop" for s in out)
    out = engine.generate(prompts, max_new_tokens=[1, 2, 3], temperature=1.0, top_p=1.0, stop_ids=[], seed=0)
    assert [len(s.ids) for s in out] == [1, 2, 3] and all(s.finish == "length" for s in out)
    # same seed, same samples
    again = engine.generate(prompts, max_new_tokens=[1, 2, 3], temperature=1.0, top_p=1.0, stop_ids=[], seed=0)
    assert [s.ids for s in out] == [s.ids for s in again]
    with pytest.raises(ValueError, match="empty prompt"):
        engine.generate([[]], max_new_tokens=2, temperature=1.0, top_p=1.0, stop_ids=[])


def test_sample_next_greedy_and_top_p():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    ids, raw, samp = sample_next(logits, 0.0, 1.0, None)
    assert torch.equal(ids, logits.argmax(-1))
    assert torch.allclose(raw, torch.log_softmax(logits, -1).gather(-1, ids[:, None])[:, 0])
    g = torch.Generator().manual_seed(0)
    ids, raw, samp = sample_next(logits, 1.0, 1e-6, g)  # tiny top-p: only the argmax survives
    assert torch.equal(ids, logits.argmax(-1)) and torch.allclose(samp, torch.zeros(4), atol=1e-6)
    ids, raw, samp = sample_next(logits, 0.5, 0.8, g)
    # recorded: the tempered distribution before top-p (what a trainer at T=0.5 scores)
    assert torch.allclose(raw, torch.log_softmax(logits / 0.5, -1).gather(-1, ids[:, None])[:, 0])
    assert (samp <= 0).all() and torch.isfinite(samp).all()


class Steered(torch.nn.Module):
    """A real tiny Qwen2 whose last-position logits get +bias on the scripted expert's
    next token, so sampled episodes search, read and answer like real agents (a random
    model only writes malformed actions). The bias is a pure function of the row's
    tokens so far, so `full_logits` can recompute it for a fresh unpadded forward."""

    def __init__(self, model, expert, bias):
        super().__init__()
        self.model, self.expert, self.bias, self.config = model, expert, bias, model.config
        self.rows, self.plen = [], []

    def target(self, prompt, generated):
        act = self.expert.act(prompt)
        return act[len(generated)] if len(generated) < len(act) else self.expert.tokens.eos

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, use_cache=None,
                logits_to_keep=0, **kw):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         cache=cache, use_cache=use_cache, logits_to_keep=logits_to_keep, **kw)
        if input_ids.shape[1] > 1:  # prefill
            self.rows = [input_ids[b][attention_mask[b].bool()].tolist() for b in range(input_ids.shape[0])]
            self.plen = [len(r) for r in self.rows]
        else:
            for b in range(input_ids.shape[0]):
                self.rows[b].append(int(input_ids[b, 0]))
        for b, row in enumerate(self.rows):
            out.logits[b, -1, self.target(row[: self.plen[b]], row[self.plen[b]:])] += self.bias
        return out

    def full_logits(self, prompt, action):
        with torch.no_grad():
            lg = self.model(input_ids=torch.tensor([prompt + action])).logits[0].float()
        n = len(prompt)
        for j in range(len(action)):
            lg[n - 1 + j, self.target(prompt, action[:j])] += self.bias
        return lg


@pytest.mark.parametrize("temperature,bias", [(0.0, 30.0), (1.0, 6.0)])
def test_exact_records_on_real_episodes(setup, temperature, bias):
    """Searches, observations, memory updates, episodes ending at different rounds."""
    world, tok, model = setup
    env = QAEnv.from_world(world, tok)
    steered = Steered(model, ScriptedExpert(tok), bias).eval()
    engine = HFEngine(steered, pad_id=tok.pad_token_id, batch_size=4)
    trajs = rollout(env, engine, world.sample_tasks(1, 2) + world.sample_tasks(3, 2), group_size=2,
                    temperature=temperature, seed=1)
    if temperature == 0.0:  # the steered greedy agent is the expert
        assert all(t.rewards["em_mean"] == 1.0 for t in trajs)
    assert any(t.info["turns"] > 2 for t in trajs)
    assert len({t.info["turns"] for t in trajs}) > 1  # episodes finish at different rounds
    worst = 0.0
    for tr in trajs:
        tr.validate(vocab_size=model.config.vocab_size)
        for inv in tr.invocations:
            lg = steered.full_logits(inv.prefix_ids + inv.context_ids, inv.action_ids)
            lp = torch.log_softmax(lg, -1)
            n = len(inv.prefix_ids) + len(inv.context_ids)
            ref = [float(lp[n - 1 + j, a]) for j, a in enumerate(inv.action_ids)]
            worst = max(worst, max(abs(a - b) for a, b in zip(ref, inv.sample_logprobs)))
    assert worst < 1e-5, worst
