"""Where a teacher's top-1 differs between the views at the information-gap calls.

The manipulation check (`memopd.trainer.experiments.manipulation`) reports shares; this script shows
the tokens behind them. On the SFT student's rollouts of the check (the first `--tasks`
Q2 sets of the training stream, `--group` samples each at temperature 1, seed 0, as the
check draws them), for every information-gap call (`memopd.trainer.experiments.infogap.information_gap_calls`)
it forwards the teacher once on the compact call and once on the flattened history, each
followed by the student's recorded action, and compares the two top-1 tokens at every
action position. It prints a few calls in full (the student's action, the rule's action
under each view, the differing positions), then the totals: action tokens, differing
tokens, the recorded tokens at which they differ, and the rule's step after the memory
span under each view (same search, or search against answer).

    python benchmarks/analysis/infogap_gap_tokens.py STUDENT_DIR TEACHER_DIR [--tasks 32] [--show 6]
"""
from __future__ import annotations

import argparse
import collections
import sys

import torch


def _step_after_memory(text: str) -> str:
    rest = text.split("</mem>", 1)[1] if "</mem>" in text else text
    return "answer" if rest.startswith("<answer>") else "search" if rest.startswith("<search>") else "other"


def main(argv: list[str] | None = None) -> int:
    from memopd.env.qa.evaluate import agent_engine, load_agent, load_agent_env
    from memopd.env.qa.expert import make_expert
    from memopd.env.qa.sft import flattened_prompt
    from memopd.trainer.experiments.infogap import information_gap_calls
    from memopd.trainer.experiments.manipulation import check_rollouts

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("student")
    p.add_argument("teacher")
    p.add_argument("--tasks", type=int, default=32, help="Q2 sets of the training stream (default 32, as the protocol)")
    p.add_argument("--group", type=int, default=4, help="samples per set (default 4)")
    p.add_argument("--show", type=int, default=6, help="calls printed in full")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    student, tok, env, world = load_agent_env(args.student)
    teacher, _, _ = load_agent(args.teacher)
    engine = agent_engine(student, tok)
    trajs = check_rollouts(env, engine, world, k=2, tasks=args.tasks, group_size=args.group, temperature=1.0, seed=0)
    rule = make_expert("rational", tok, world.config)
    V = engine.vocab_size

    def top1(state, action):
        ids = torch.tensor([list(state) + list(action)])
        with torch.no_grad():
            logits = teacher(input_ids=ids).logits[0, len(state) - 1:len(state) + len(action) - 1, :V]
        return logits.argmax(-1).tolist()

    at = collections.Counter()
    steps = collections.Counter()
    n_tok = n_diff = n_calls = n_hit = shown = 0
    for tr, flags in zip(trajs, information_gap_calls(trajs, rule)):
        for t, gap in enumerate(flags):
            if not gap:
                continue
            inv = tr.invocations[t]
            a = [int(x) for x in inv.action_ids]
            compact = list(inv.prefix_ids) + list(inv.context_ids)
            flat = flattened_prompt(tr, t)
            tc, tf = top1(compact, a), top1(flat, a)
            rc, rf = rule.action_text(compact), rule.action_text(flat)
            steps[(_step_after_memory(rc), _step_after_memory(rf), rc.split("</mem>")[-1] == rf.split("</mem>")[-1])] += 1
            diff = [j for j in range(len(a)) if tc[j] != tf[j]]
            n_calls += 1
            n_tok += len(a)
            n_diff += len(diff)
            n_hit += bool(diff)
            at.update(tok.decode(a[j:j + 1]).strip() for j in diff)
            if shown < args.show:
                shown += 1
                print(f"student          : {tok.decode(a)}")
                print(f"rule, compact    : {rc}")
                print(f"rule, flattened  : {rf}")
                print("differ at        : " + ", ".join(
                    f"#{j} {tok.decode(a[j:j + 1]).strip()!r} (compact {tok.decode([tc[j]]).strip()!r}, "
                    f"flattened {tok.decode([tf[j]]).strip()!r})" for j in diff) + "\n")
    if not n_calls:
        print("no information-gap call in these rollouts")
        return 0
    print(f"{n_calls} information-gap calls, {n_tok} action tokens; the teacher's top-1 differs at {n_diff} "
          f"({100 * n_diff / n_tok:.1f}%), at some token in {n_hit} of the calls; one token per call would be "
          f"{100 * n_calls / n_tok:.1f}%")
    print("recorded tokens where it differs: " + ", ".join(f"{k!r} {v}" for k, v in at.most_common(10)))
    print("the rule's step after the memory span (compact, flattened, same step):")
    for (c, f, same), v in steps.most_common():
        print(f"  {c} / {f}{' (the same)' if same else ''}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
