"""Where a trained agent first departs from the scripted expert, call by call.

`python benchmarks/expert_departures.py MODEL_DIR [--k 8] [--n 30]` plays `n` held-out
sets of k questions greedily with the agent, asks the expert (in the world's answer
order) what it would write at each of the agent's calls, and classifies each episode by
its first departure: at a label or tag (the decision to open the next question's entry
or to stop and answer), elsewhere (a value or a query word), or none. docs/design.md §10
uses it to show why the replication world's expert works from the last question down.
"""
from __future__ import annotations

import argparse
import collections
import re


def first_departures(model_dir: str, k: int, n: int, seed: int = 0) -> dict:
    import torch

    from memopd.env.evaluate import agent_engine, load_agent_env
    from memopd.env.expert import ScriptedExpert, expert_options
    from memopd.env.rollout import rollout

    torch.set_num_threads(1)
    model, tok, env, world = load_agent_env(model_dir)
    expert = ScriptedExpert(tok, **expert_options(world.config))
    trajs = rollout(env, agent_engine(model, tok), world.sample_tasks(k, n, split="eval", seed=seed), temperature=0.0,
                    seed=seed)

    def words(ids):  # tags as words of their own
        return tok.decode(list(ids), skip_special_tokens=False).replace("<", " <").split()

    def is_decision(w: str) -> bool:
        return w == "<end>" or w.startswith("<") or re.fullmatch(r"x[a-z]{1,2}", w) is not None

    kinds = collections.Counter()
    for tr in trajs:
        for inv in tr.invocations:
            want = words(expert.act(list(tr.prefix_ids) + list(inv.context_ids)))
            got = words(inv.action_ids)
            if want != got:
                j = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
                w = want[j] if j < len(want) else "<end>"
                g = got[j] if j < len(got) else "<end>"
                kinds["label or tag" if is_decision(w) or is_decision(g) else "value or query"] += 1
                break
        else:
            kinds["none"] += 1
    return {"episodes": len(trajs), "first_departure": dict(kinds),
            "em_mean": sum(t.rewards["em_mean"] for t in trajs) / max(1, len(trajs))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir")
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--n", type=int, default=30)
    a = ap.parse_args()
    print(first_departures(a.model_dir, a.k, a.n))


if __name__ == "__main__":
    main()
