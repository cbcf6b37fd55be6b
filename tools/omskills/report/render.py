"""The Jinja2 environment every report template renders in (templates/ beside this module)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from jinja2 import Environment, FileSystemLoader, StrictUndefined, select_autoescape
from omskills.records.verify import figure
from omskills.report.wording import counted, plural

TEMPLATES = Path(__file__).resolve().parent / "templates"


def table_cell(value: object) -> str:
    """Text safe inside a Markdown table cell."""
    return str(value).replace("|", "\\|").replace("\n", " ")


def shell_line(argv: list[str]) -> str:
    """One shell command line: every argument quoted where the shell would split or expand it
    (`;` in ATC's --input_shape ends a command in bash unquoted)."""
    return shlex.join(argv)


def inline_code(value: object) -> str:
    """`value` as Markdown inline code, whatever backticks it holds (CommonMark: a longer fence)."""
    text = str(value).replace("\n", " ")
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * (longest + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def data_size(nbytes: float) -> str:
    """Bytes as a person reads them: 512 B, 3.4 KB, 12.0 MB, 1.25 GB (powers of 1000)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.3g} {unit}" if nbytes / scale < 100 else f"{nbytes / scale:.0f} {unit}"
    return f"{nbytes:.0f} B"


def template_environment(*, html: bool = False) -> Environment:
    """Strict (an unknown name is an error); HTML templates autoescape, Markdown ones trim blocks."""
    if html:
        env = Environment(
            loader=FileSystemLoader(TEMPLATES), undefined=StrictUndefined, autoescape=select_autoescape(["html", "j2"])
        )
    else:
        env = Environment(
            loader=FileSystemLoader(TEMPLATES),
            undefined=StrictUndefined,
            trim_blocks=True,
            lstrip_blocks=True,
            keep_trailing_newline=True,
        )
    env.filters["cell"] = table_cell
    env.filters["pct"] = lambda x: f"{100 * x:.1f}%"
    env.filters["figure"] = figure
    env.filters["code"] = inline_code
    env.filters["size"] = data_size
    env.filters["plural"] = plural  # {{ step_name | plural }}
    env.filters["counted"] = counted  # {{ steps | counted(step_name) }}
    return env
