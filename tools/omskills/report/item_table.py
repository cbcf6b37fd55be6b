"""Per-item figures (one object's mask IoU, score, box on one step) as one table: a row per step
and item, a column per keyed check."""

from __future__ import annotations

from typing import NamedTuple

from omskills.records.verify import ItemFigure


class ItemRow(NamedTuple):
    step: int
    item: str
    cells: list[ItemFigure | None]  # one per column; None: that check has no figure for the item


class ItemTable(NamedTuple):
    key: str  # the output the items are matched by (e.g. object ids); "" when there are no rows
    columns: list[str]  # the checks' titles
    rows: list[ItemRow]


def item_table(figures: list[ItemFigure]) -> ItemTable:
    columns = list(dict.fromkeys(f.title for f in figures))
    cells: dict[tuple[int, str], list[ItemFigure | None]] = {}
    for figure in figures:
        row = cells.setdefault((figure.step, figure.item), [None] * len(columns))
        row[columns.index(figure.title)] = figure
    keys = list(dict.fromkeys(f.key for f in figures))
    rows = [
        ItemRow(step, item, row)
        for (step, item), row in sorted(cells.items(), key=lambda kv: (kv[0][0], _order(kv[0][1])))
    ]
    return ItemTable(key=", ".join(keys), columns=columns, rows=rows)


def _order(item: str) -> tuple[int, float | str]:
    """Numeric ids in numeric order (2 before 10), others after them by name."""
    try:
        return (0, float(item))
    except ValueError:
        return (1, item)
