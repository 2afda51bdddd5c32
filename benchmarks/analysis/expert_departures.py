"""Where a trained agent first departs from its expert, call by call.

`python benchmarks/analysis/expert_departures.py MODEL_DIR [--k 8] [--n 30] [--expert rational]
[--policy full] [--examples 5]` plays `n` held-out sets of k questions greedily with the
agent, asks the expert (the scripted one by default, or the info-gap world's rational
rule, in the world's answer order) what it would write at each of the agent's calls, and
classifies each episode by its first departure: at a label or tag (the decision to open
the next question's entry or to stop and answer), elsewhere (a value or a query word), or
none; and by the role of the expert's token there (memory notes, search, answer).
docs/design.md §10 uses it to show why the replication world's expert works from the last
question down; docs/research/replication.md, where the info-gap teacher leaves its rule.
"""
from __future__ import annotations

import argparse
import collections
import json
import re


def first_departures(model_dir: str, k: int, n: int, seed: int = 0, *, expert_name: str = "scripted",
                     policy: str | None = None, examples: int = 0) -> dict:
    import dataclasses

    import torch

    from memopd.env.qa import QAEnv
    from memopd.env.qa.evaluate import agent_engine, load_agent_env
    from memopd.env.qa.expert import make_expert
    from memopd.env.qa.protocol import ProtocolTokens
    from memopd.env.rollout import rollout
    from memopd.trainer.experiments.infogap import action_token_roles, common_prefix

    torch.set_num_threads(1)
    model, tok, env, world = load_agent_env(model_dir)
    if policy is not None:
        env = QAEnv.from_world(world, tok, dataclasses.replace(env.config, policy=policy, policy_kwargs={}))
    expert = make_expert(expert_name, tok, world.config)
    tokens = ProtocolTokens.from_tokenizer(tok)
    trajs = rollout(env, agent_engine(model, tok), world.sample_tasks(k, n, split="eval", seed=seed), temperature=0.0,
                    seed=seed)

    def words(ids):  # tags as words of their own
        return tok.decode(list(ids), skip_special_tokens=False).replace("<", " <").split()

    def is_decision(w: str) -> bool:
        return w == "<end>" or w.startswith("<") or re.fullmatch(r"x[a-z]{1,2}", w) is not None

    kinds, roles, shown = collections.Counter(), collections.Counter(), []
    for tr in trajs:
        for t, inv in enumerate(tr.invocations):
            want_ids = expert.act(list(tr.prefix_ids) + list(inv.context_ids))
            want, got = words(want_ids), words(inv.action_ids)
            if want != got:
                j = common_prefix(want, got)
                w = want[j] if j < len(want) else "<end>"
                g = got[j] if j < len(got) else "<end>"
                kinds["label or tag" if is_decision(w) or is_decision(g) else "value or query"] += 1
                got_ids = [int(x) for x in inv.action_ids]
                i = common_prefix(want_ids, got_ids)
                role_of = action_token_roles(want_ids, tokens)
                roles[role_of[i] if i < len(role_of) else "end"] += 1
                if len(shown) < examples:
                    shown.append({"task": tr.task_id, "call": t, "em": tr.rewards["em_mean"],
                                  "expert": tok.decode(want_ids, skip_special_tokens=False),
                                  "agent": tok.decode(got_ids, skip_special_tokens=False)})
                break
        else:
            kinds["none"] += 1
    out = {"episodes": len(trajs), "expert": expert_name, "policy": env.config.policy, "first_departure": dict(kinds),
           "first_departure_role": dict(roles), "em_mean": sum(t.rewards["em_mean"] for t in trajs) / max(1, len(trajs))}
    if examples:
        out["examples"] = shown
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir")
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--n", type=int, default=30)
    ap.add_argument("--expert", default="scripted", choices=("scripted", "rational"))
    ap.add_argument("--policy", default=None, help="memory policy to play under (default: the checkpoint's)")
    ap.add_argument("--examples", type=int, default=0, help="print the first departures of this many episodes")
    a = ap.parse_args()
    print(json.dumps(first_departures(a.model_dir, a.k, a.n, expert_name=a.expert, policy=a.policy,
                                      examples=a.examples), indent=1))


if __name__ == "__main__":
    main()
