"""The Jinja2 environment every report template renders in (templates/ beside this module)."""

from __future__ import annotations

from pathlib import Path

from jinja2 import Environment, FileSystemLoader, StrictUndefined, select_autoescape

from omskills.records.verify import figure

TEMPLATES = Path(__file__).resolve().parent / "templates"


def table_cell(value: object) -> str:
    """Text safe inside a Markdown table cell."""
    return str(value).replace("|", "\\|").replace("\n", " ")


def template_environment(*, html: bool = False) -> Environment:
    """Strict (an unknown name is an error); HTML templates autoescape, Markdown ones trim blocks."""
    if html:
        env = Environment(loader=FileSystemLoader(TEMPLATES), undefined=StrictUndefined, autoescape=select_autoescape(["html", "j2"]))
    else:
        env = Environment(loader=FileSystemLoader(TEMPLATES), undefined=StrictUndefined, trim_blocks=True,
                          lstrip_blocks=True, keep_trailing_newline=True)
    env.filters["cell"] = table_cell
    env.filters["pct"] = lambda x: f"{100 * x:.1f}%"
    env.filters["figure"] = figure
    return env
