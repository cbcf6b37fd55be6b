"""Record values that become file names or paths in a run folder, one rule each.

A graph or candidate name becomes a folder (`onnx/<graph>/`), a file (`om/<graph>/convert_<graph>.sh`)
and an ATC `--output`; a stored path is joined to the run folder. Both are checked when a record
loads and when a tool argument names one, so that no value a record or a client gives can lead a
file outside the run folder: `SafeName` is a plain file name, `RunPath` a relative path that never
climbs, `AtcArgv` a recorded ATC command whose path options are `RunPath`s, `InputPath` a file the
user names (confined where it is read). Names are checked wherever a value is built; stored paths
whenever a record or a bundle manifest is read or written (`STORED`). tests/test_record_fields.py
fails on a field that names a file and is typed plain `str`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import PurePosixPath
from typing import Annotated, TypeVar, get_args, get_origin

from pydantic import AfterValidator, ValidationInfo
from pydantic.fields import FieldInfo

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
        raise ValueError(f"{value!r} is not a path inside the run folder or bundle (relative, without '..')")
    return value


# ATC options whose value names a file or a folder: a recorded command holds them relative to the
# run folder (a bundle rewrites them relative to itself), so a record cannot point ATC, or the
# bundle copying its keep list, at a file outside.
ATC_PATH_OPTIONS = frozenset(
    {
        "--model",
        "--weight",
        "--output",
        "--keep_dtype",
        "--modify_mixlist",
        "--insert_op_conf",
        "--fusion_switch_file",
        "--op_name_map",
        "--compression_optimize_conf",
        "--customize_dtypes",
        "--op_precision_mode",
        "--op_debug_config",
        "--json",
        "--om",
        "--debug_dir",
        "--op_compiler_cache_dir",
    }
)
T = TypeVar("T")
_ATC_OPTION = re.compile(r"--[a-z][a-z0-9_]*(=[^\x00]*)?", re.DOTALL)


def atc_argv(value: list[str]) -> list[str]:
    """`value` when every argument after the program is a `--name[=value]` option (nothing else a
    shell would run) and every path option's value lies inside the run folder."""
    for arg in value[1:]:  # value[0] is `_atc_program`'s, checked always
        if not _ATC_OPTION.fullmatch(arg):
            raise ValueError(f"{arg[:60]!r} is not an ATC option (--name or --name=value)")
        key, sep, path = arg.partition("=")
        if sep and key in ATC_PATH_OPTIONS:
            try:
                run_relative(path)
            except ValueError as err:
                raise ValueError(f"{key}: {err}") from None
    return value


class InputPathMarker:
    """`Annotated` metadata: a path the user gives (a source checkout, a checkpoint, a driver file,
    a driver's input file), relative to the task record's folder. Read, never written; where it is
    read it must resolve inside the run folder or an allowed input root (`records.intake.confined_path`,
    which `models.registry.intake_paths` applies to every field so marked)."""

    def __repr__(self) -> str:
        return "InputPath"


def is_input_path(field: FieldInfo) -> bool:
    """Whether a field is typed `InputPath` (alone, or inside `| None` and other unions, where
    pydantic keeps the marker in the annotation rather than in the field's metadata)."""
    return any(isinstance(m, InputPathMarker) for m in field.metadata) or _marked(field.annotation)


def _marked(annotation: object) -> bool:
    if get_origin(annotation) is Annotated:
        base, *extra = get_args(annotation)
        return any(isinstance(m, InputPathMarker) for m in extra) or _marked(base)
    return any(_marked(arg) for arg in get_args(annotation))


def no_nul(value: str) -> str:
    if "\x00" in value:
        raise ValueError("a path holds a NUL byte")
    return value


# The validation context of a record or a bundle manifest read from, or written to, its file.
# Stored paths are checked there: an engine function returns the absolute paths it wrote, and the
# step that stores its result makes them relative to the run folder (`run_folder.RunFolder.stored`);
# whatever a step forgot, the save refuses, and whatever a file holds, the load does.
STORED = {"stored": True}


def _stored(check: Callable[[T], T]) -> Callable[[T, ValidationInfo], T]:
    def when_stored(value: T, info: ValidationInfo) -> T:
        return check(value) if isinstance(info.context, dict) and info.context.get("stored") else value

    when_stored.check = check  # type: ignore[attr-defined]  # what it applies (tests read it)
    return when_stored


def _atc_program(value: list[str]) -> list[str]:
    if value and value[0] != "atc":  # checked always: nothing but atc is ever recorded to run
        raise ValueError(f"an ATC command starts with 'atc', not {value[0][:60]!r}")
    return value


SafeName = Annotated[str, AfterValidator(safe_name)]
InputPath = Annotated[str, AfterValidator(no_nul), InputPathMarker()]
RunPath = Annotated[str, AfterValidator(_stored(run_relative))]
AtcArgv = Annotated[list[str], AfterValidator(_atc_program), AfterValidator(_stored(atc_argv))]
