"""The C++ row planner equals a slow, obvious Python reference, plan for plan, and it
beats the previous planner (global first-fit decreasing with prefix affinity) on tokens."""
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memopd.planner import plan_rows


def reference_plan(lengths, groups, group_cost, budget):
    """Group chunking, then first-fit decreasing of the chunks, written the plain way."""
    n = len(lengths)
    for i in range(n):
        if lengths[i] + (group_cost[groups[i]] if groups[i] >= 0 else 0) > budget:
            raise ValueError("over budget")
    # 1. the items of each group, longest first, first fit into chunks of budget - prefix
    chunks = []  # each: [cost, items]
    for g in range(len(group_cost)):
        members = sorted((i for i in range(n) if groups[i] == g), key=lambda i: (-lengths[i], i))
        mine = []
        for i in members:
            for c in mine:
                if c[0] - group_cost[g] + lengths[i] <= budget - group_cost[g]:
                    break
            else:
                c = [group_cost[g], []]
                mine.append(c)
            c[0] += lengths[i]
            c[1].append(i)
        chunks += mine
    chunks += [[lengths[i], [i]] for i in range(n) if groups[i] < 0]
    # 2. chunks by cost descending (ties: lowest item index), first fit into rows
    chunks.sort(key=lambda c: (-c[0], min(c[1])))
    used = []
    row_of = [None] * n
    for cost, items in chunks:
        for r in range(len(used)):
            if used[r] + cost <= budget:
                break
        else:
            used.append(0)
            r = len(used) - 1
        used[r] += cost
        for i in items:
            row_of[i] = r
    return row_of


def previous_plan(lengths, groups, group_cost, budget):
    """The previous C++ planner: first-fit decreasing with prefix affinity over all items.
    Kept to check that the current one is never worse on tokens."""
    def cost(i):
        return lengths[i] + (group_cost[groups[i]] if groups[i] >= 0 else 0)

    order = sorted(range(len(lengths)), key=lambda i: (-cost(i), i))
    rows = []  # each: [used, set_of_groups]
    row_of = [None] * len(lengths)
    for i in order:
        g = groups[i]
        chosen = None
        if g >= 0:
            for r, (used, gs) in enumerate(rows):
                if g in gs and used + lengths[i] <= budget:
                    chosen = r
                    break
        if chosen is None:
            for r, (used, gs) in enumerate(rows):
                extra = 0 if (g >= 0 and g in gs) else (group_cost[g] if g >= 0 else 0)
                if used + lengths[i] + extra <= budget:
                    chosen = r
                    break
        if chosen is None:
            rows.append([0, set()])
            chosen = len(rows) - 1
        if g >= 0 and g not in rows[chosen][1]:
            rows[chosen][0] += group_cost[g]
            rows[chosen][1].add(g)
        rows[chosen][0] += lengths[i]
        row_of[i] = chosen
    return row_of


def row_stats(row_of, lengths, groups, group_cost):
    """(tokens per row, prefix copies per group) of a plan."""
    rows = {}
    for i, r in enumerate(row_of):
        rows.setdefault(r, []).append(i)
    used, copies = {}, {}
    for r, items in rows.items():
        gs = {groups[i] for i in items if groups[i] >= 0}
        used[r] = sum(lengths[i] for i in items) + sum(group_cost[g] for g in gs)
        for g in gs:
            copies[g] = copies.get(g, 0) + 1
    return used, copies


def total_tokens(row_of, lengths, groups, group_cost):
    return sum(row_stats(row_of, lengths, groups, group_cost)[0].values())


def check_plan(row_of, lengths, groups, group_cost, budget):
    """Every item has a row, rows are numbered 0..R-1 and each respects the budget."""
    assert len(row_of) == len(lengths)
    assert sorted(set(row_of)) == list(range(len(set(row_of))))
    used, _ = row_stats(row_of, lengths, groups, group_cost)
    assert all(u <= budget for u in used.values()), used


@st.composite
def problems(draw):
    n_groups = draw(st.integers(0, 6))
    group_cost = [draw(st.integers(0, 40)) for _ in range(n_groups)]
    n = draw(st.integers(0, 60))
    budget = draw(st.integers(41 + 1, 300))
    lengths, groups = [], []
    for _ in range(n):
        g = draw(st.integers(-1, n_groups - 1))
        room = budget - (group_cost[g] if g >= 0 else 0)
        lengths.append(draw(st.integers(1, max(1, room))))
        groups.append(g)
    return lengths, groups, group_cost, budget


@st.composite
def grouped_problems(draw):
    """Rollout-shaped: a few groups (one prompt each) of many calls, sometimes with some
    ungrouped items; calls are short next to the budget, prefixes are not tiny."""
    n_groups = draw(st.integers(1, 8))
    budget = draw(st.integers(60, 600))
    group_cost = [draw(st.integers(1, budget // 4)) for _ in range(n_groups)]
    lengths, groups = [], []
    for g in range(n_groups):
        for _ in range(draw(st.integers(1, 30))):
            lengths.append(draw(st.integers(1, (budget - group_cost[g]) // draw(st.sampled_from([1, 2, 4, 8])))))
            groups.append(g)
    for _ in range(draw(st.integers(0, 5))):
        lengths.append(draw(st.integers(1, budget)))
        groups.append(-1)
    order = draw(st.permutations(range(len(lengths))))
    return [lengths[i] for i in order], [groups[i] for i in order], group_cost, budget


@settings(max_examples=400, deadline=None)
@given(problems())
def test_cpp_equals_reference(p):
    lengths, groups, group_cost, budget = p
    got = plan_rows(lengths, groups, group_cost, budget)
    assert got == reference_plan(lengths, groups, group_cost, budget)
    check_plan(got, lengths, groups, group_cost, budget)


@settings(max_examples=200, deadline=None)
@given(grouped_problems())
def test_cpp_equals_reference_grouped(p):
    got = plan_rows(*p)
    assert got == reference_plan(*p)
    check_plan(got, *p)


# Not a theorem (first fit has anomalies), so the examples are fixed (derandomize): a
# failure here is a real input on which the new planner spends more tokens than the old.
@settings(max_examples=500, deadline=None, derandomize=True)
@given(st.one_of(grouped_problems(), problems()))
def test_never_more_tokens_than_previous_planner(p):
    new = total_tokens(plan_rows(*p), *p[:3])
    old = total_tokens(previous_plan(*p), *p[:3])
    assert new <= old


@settings(max_examples=300, deadline=None)
@given(st.one_of(grouped_problems(), problems()))
def test_group_that_fits_one_row_gets_one_row(p):
    """One prefix copy for every group whose prefix plus items fit the budget; a larger
    group never has two rows that could have been one (two of its rows together, with one
    prefix, exceed the budget)."""
    lengths, groups, group_cost, budget = p
    row_of = plan_rows(*p)
    check_plan(row_of, *p)
    for g, p_g in enumerate(group_cost):
        mine = [i for i in range(len(lengths)) if groups[i] == g]
        if not mine:
            continue
        rows = {}
        for i in mine:
            rows[row_of[i]] = rows.get(row_of[i], 0) + lengths[i]
        if p_g + sum(lengths[i] for i in mine) <= budget:
            assert len(rows) == 1, (g, rows)
        else:
            # the fewest rows any plan can use for g
            assert len(rows) >= -(-sum(lengths[i] for i in mine) // (budget - p_g))
            loads = sorted(rows.values())
            assert p_g + loads[0] + loads[1] > budget


def test_ungrouped_items_are_plain_ffd():
    """Flatten layout (all -1): first-fit decreasing, the same plan as before."""
    rng = random.Random(0)
    for _ in range(50):
        budget = rng.randint(50, 500)
        lengths = [rng.randint(1, budget) for _ in range(rng.randint(1, 80))]
        args = (lengths, [-1] * len(lengths), [], budget)
        got = plan_rows(*args)
        assert got == previous_plan(*args)
        check_plan(got, *args)


def _q16_b16_shape(seed=0):
    """Like the benchmark's Q16-b16 batch (budget 4096): 16 trajectories of 21-30 calls in
    groups of 4, one prefix of ~117 ids per group, call segments of 44-138 ids."""
    rng = random.Random(seed)
    lengths, groups, group_cost = [], [], []
    for g in range(4):
        group_cost.append(117 + rng.randint(-5, 5))
        for _ in range(4):
            calls = rng.randint(21, 30)
            for t in range(calls):
                lengths.append(rng.randint(35, 60) + rng.randint(9, 20) + 2 * t)
                groups.append(g)
    return lengths, groups, group_cost, 4096


def test_q16_b16_shape_fewer_tokens_and_prefix_copies():
    p = _q16_b16_shape()
    lengths, groups, group_cost, budget = p
    new, old = plan_rows(*p), previous_plan(*p)
    check_plan(new, *p)
    check_plan(old, *p)
    new_copies = sum(row_stats(new, *p[:3])[1].values())
    old_copies = sum(row_stats(old, *p[:3])[1].values())
    # every group needs three rows (~9-10k tokens each) and gets them; the old plan
    # repeats (nearly) every prefix in every row
    fewest = [-(-sum(n for n, h in zip(lengths, groups) if h == g) // (budget - c))
              for g, c in enumerate(group_cost)]
    assert fewest == [3, 3, 3, 3]
    assert row_stats(new, *p[:3])[1] == {0: 3, 1: 3, 2: 3, 3: 3}
    assert new_copies == 12 and old_copies > 3 * new_copies
    new_tok, old_tok = total_tokens(new, *p[:3]), total_tokens(old, *p[:3])
    assert new_tok == sum(lengths) + 3 * sum(group_cost)
    assert new_tok < 0.95 * old_tok
    assert len(set(new)) <= len(set(old))


def test_group_kept_in_one_row_instead_of_mixed():
    # group 0 (prefix 20, calls 40 + 20 + 20) fills a row of 100 exactly; the old planner
    # put group 1's call (cost 5 + 35, as long as the others but first by index) next to
    # the first call, so group 0 spilled into a second row and paid its prefix twice
    args = ([40, 35, 20, 20], [0, 1, 0, 0], [20, 5], 100)
    assert plan_rows(*args) == [0, 1, 0, 0]
    assert previous_plan(*args) == [0, 0, 1, 1]
    assert total_tokens(plan_rows(*args), *args[:3]) == 140
    assert total_tokens(previous_plan(*args), *args[:3]) == 160


def test_deterministic():
    args = ([5, 9, 3, 9, 1, 7] * 20, [0, 1, -1, 0, 2, 1] * 20, [4, 6, 2], 64)
    assert plan_rows(*args) == plan_rows(*args)
    assert plan_rows(*args) == reference_plan(*args)


def test_over_budget_is_an_error():
    with pytest.raises(ValueError, match="item 1 needs 13 tokens, over the row budget of 12"):
        plan_rows([3, 10], [-1, 0], [3], 12)
    with pytest.raises(ValueError, match="budget must be positive"):
        plan_rows([1], [-1], [], 0)
    with pytest.raises(ValueError, match="no group_cost entry"):
        plan_rows([1], [2], [1], 10)
    with pytest.raises(ValueError, match="item 0 has group 0 with a negative group_cost"):
        plan_rows([1], [0], [-1], 10)
    with pytest.raises(ValueError, match="non-positive length"):
        plan_rows([0], [-1], [], 10)
    with pytest.raises(ValueError, match="differ in size"):
        plan_rows([1, 2], [-1], [], 10)


def test_empty():
    assert plan_rows([], [], [], 10) == []
    assert plan_rows([], [], [5, 6], 10) == []

