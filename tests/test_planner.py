"""The C++ row planner equals a slow, obvious Python reference, plan for plan."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memopd.planner import plan_rows


def reference_plan(lengths, groups, group_cost, budget):
    """First-fit decreasing with prefix affinity, written the plain way."""
    def cost(i):
        return lengths[i] + (group_cost[groups[i]] if groups[i] >= 0 else 0)

    for i in range(len(lengths)):
        if cost(i) > budget:
            raise ValueError("over budget")
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


@settings(max_examples=400, deadline=None)
@given(problems())
def test_cpp_equals_reference(p):
    lengths, groups, group_cost, budget = p
    got = plan_rows(lengths, groups, group_cost, budget)
    assert got == reference_plan(lengths, groups, group_cost, budget)
    # every row respects the budget, prefixes counted once per row
    rows = {}
    for i, r in enumerate(got):
        rows.setdefault(r, []).append(i)
    for items in rows.values():
        used = sum(lengths[i] for i in items) + sum(group_cost[g] for g in {groups[i] for i in items} if g >= 0)
        assert used <= budget


def test_deterministic():
    args = ([5, 9, 3, 9, 1, 7] * 20, [0, 1, -1, 0, 2, 1] * 20, [4, 6, 2], 64)
    assert plan_rows(*args) == plan_rows(*args)


def test_over_budget_is_an_error():
    with pytest.raises(ValueError, match="item 1 needs 13 tokens, over the row budget of 12"):
        plan_rows([3, 10], [-1, 0], [3], 12)
    with pytest.raises(ValueError, match="budget must be positive"):
        plan_rows([1], [-1], [], 0)
    with pytest.raises(ValueError, match="no group_cost entry"):
        plan_rows([1], [2], [1], 10)
