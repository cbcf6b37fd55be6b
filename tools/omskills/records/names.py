"""Record values that become file names or paths in a run folder, one rule each.

A graph or candidate name becomes a folder (`onnx/<graph>/`), a file (`om/<graph>/convert_<graph>.sh`)
and an ATC `--output`; a stored path is joined to the run folder. Both are checked when a record
loads and when a tool argument names one, so that no value a record or a client gives can lead a
file outside the run folder: `SafeName` is a plain file name, `RunPath` a relative path that never
climbs.
"""

from __future__ import annotations

import re
from pathlib import PurePosixPath
from typing import Annotated

from pydantic import AfterValidator

# Long enough for a dispatched graph's name, short enough that every file made from it (its
# weights' scratch file adds about 40 characters) stays within the file system's 255 bytes.
MAX_NAME = 160
_SAFE_NAME = re.compile(rf"[A-Za-z0-9_][A-Za-z0-9_.-]{{0,{MAX_NAME - 1}}}")


def safe_name(value: str) -> str:
    """`value` when it is a plain file name: letters, digits, `_`, `-`, `.`, no `..`, at most MAX_NAME."""
    if not _SAFE_NAME.fullmatch(value) or ".." in value:
        shown = value if len(value) <= 60 else value[:57] + "..."
        raise ValueError(
            f"{shown!r} is not a safe name: letters, digits, '_', '-' and '.' only (no '..'), "
            f"starting with a letter, a digit or '_', at most {MAX_NAME} characters"
        )
    return value


def run_relative(value: str) -> str:
    """`value` when it is a path inside the run folder: relative, no `..` part, no NUL byte."""
    if "\x00" in value:
        raise ValueError("a path holds a NUL byte")
    path = PurePosixPath(value.replace("\\", "/"))
    if path.is_absolute() or value.startswith("~") or ".." in path.parts or re.match(r"^[A-Za-z]:", value):
        raise ValueError(f"{value!r} is not a path inside the run folder (relative, without '..')")
    return value


SafeName = Annotated[str, AfterValidator(safe_name)]
RunPath = Annotated[str, AfterValidator(run_relative)]
