"""Python face of the C++ row planner (`memopd._C.plan_rows`).

Assigns packable items (call segments or whole flattened trajectories) to rows under a
token budget, keeping each prefix group in as few rows as it can, since a row pays a
group's prefix once for any of its items. The algorithm (group chunking, then first-fit
decreasing of the chunks; deterministic, O(n log n)) is described once, in
docs/design.md §2.3.
"""
from __future__ import annotations

from typing import Sequence

__all__ = ["plan_rows", "rows_from_assignment"]


def _core():
    # in a source checkout without a core built in place, memopd's import hook supplies an
    # installed copy's core (memopd/__init__.py, _CheckoutFinder)
    try:
        from . import _C
    except ImportError as e:
        raise ImportError(
            "memopd._C (the C++ planner) is not built. Install the package with "
            "`pip install .` or `pip install -e .` so the extension compiles."
        ) from e
    return _C


def plan_rows(
    lengths: Sequence[int],
    groups: Sequence[int],
    group_cost: Sequence[int],
    budget: int,
) -> list[int]:
    """Row index of each item (rows numbered 0.. in the order they were opened).

    groups[i] = -1: no shared prefix; else its group id, an index into group_cost (the
    prefix length of that group). Raises ValueError if one item (plus its group's prefix)
    exceeds the budget, if a length is not positive, if a group has no (or a negative)
    group_cost entry, if the budget is not positive, or if lengths and groups differ
    in size.
    """
    return list(_core().plan_rows(list(map(int, lengths)), list(map(int, groups)), list(map(int, group_cost)), int(budget)))


def rows_from_assignment(row_of: Sequence[int]) -> list[list[int]]:
    """Items of each row, in ascending item order."""
    n_rows = (max(row_of) + 1) if len(row_of) else 0
    rows: list[list[int]] = [[] for _ in range(n_rows)]
    for i, r in enumerate(row_of):
        rows[r].append(i)
    return rows
