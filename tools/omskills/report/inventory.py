"""The inventory report: inventory, profile and plan as Markdown, with a compute-share chart."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from omskills.records.inventory import Inventory
from omskills.records.profile import ProfileReport
from omskills.report.charts import bar_chart_compute_share, plan_group
from omskills.report.render import template_environment


class PlanRow(NamedTuple):
    """One candidate line of the plan as the report shows it."""

    name: str
    share: float  # inclusive compute share of the main path, 0..1
    status: str
    reason: str


def render_inventory_report(
    inventory: Inventory | None,
    profile: ProfileReport | None,
    plan_rows: Sequence[tuple[str, float, str, str]],
    out_dir: Path,
    top_modules: int = 15,
) -> Path:
    """Write inventory_report.md (and compute_share.png when there are plan rows); return the .md path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = [PlanRow(*row) for row in plan_rows]
    chart = None
    if rows:
        chart = bar_chart_compute_share(
            [(r.name, r.share, plan_group(r.status, r.status == "selected")) for r in rows],
            out_dir / "compute_share.png",
        )
    top = sorted(profile.nodes, key=lambda n: n.inclusive_s, reverse=True)[:top_modules] if profile else []
    portability = inventory.portability if inventory else []
    text = (
        template_environment()
        .get_template("inventory_report.md.j2")
        .render(
            inventory=inventory,
            profile=profile,
            top=top,
            rows=rows,
            chart=chart.name if chart else None,
            runtime_seen=sum(f.seen_at_runtime for f in portability),
            kinds=Counter(f.kind for f in portability).most_common(),
        )
    )
    path = out_dir / "inventory_report.md"
    path.write_text(text)
    return path
