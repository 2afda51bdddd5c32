"""Python face of the C++ row planner (`memopd._C.plan_rows`).

Assigns packable items (call segments or whole flattened trajectories) to rows under a
token budget: first-fit decreasing with prefix affinity (see csrc/planner.cpp). Items
of one prefix group pay that group's prefix once per row.
"""
from __future__ import annotations

from typing import Sequence

__all__ = ["plan_rows", "rows_from_assignment"]


def _core():
    try:
        from . import _C
    except ImportError as e:  # pragma: no cover - only when the extension was not built
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
    """Row index of each item. groups[i] = -1: no shared prefix; else its group id.

    Raises ValueError if one item (plus its group's prefix) exceeds the budget.
    """
    return list(_core().plan_rows(list(map(int, lengths)), list(map(int, groups)), list(map(int, group_cost)), int(budget)))


def rows_from_assignment(row_of: Sequence[int]) -> list[list[int]]:
    """Items of each row, in ascending item order."""
    n_rows = (max(row_of) + 1) if len(row_of) else 0
    rows: list[list[int]] = [[] for _ in range(n_rows)]
    for i, r in enumerate(row_of):
        rows[r].append(i)
    return rows
