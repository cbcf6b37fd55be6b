"""The skill-tool convention, and finding tools without a hand-kept list.

A tool is a file `skills/<skill>/scripts/<name>.py` defining a function `<name>` with a
typed signature and a docstring, returning a pydantic model (or JSON-able value). The same
file is a CLI: `python <file> --task X` or `--args '{...}'`, printing JSON on stdout.

Every parameter is `Annotated[T, Field(description=...)]` (`Literal[...]` where the values are
known) and the function carries `@tool_hints(...)`. Discovery imports every script, so a script's
top level imports only light modules (this one, pydantic, typing, `omskills.records`): the engine
function, which brings torch or onnx, is imported inside the tool function.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os
import re
import shutil
import sys
import textwrap
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from omskills.errors import InputError, OmskillsError, one_line
from omskills.registry import Registry
from pydantic import BaseModel, Field, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo

TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


class WorkspacePathMarker:
    """`Annotated` metadata: this argument is a file path the MCP server confines to its workspace.

    Parameters named `task`, `path`, `out`, `*_path`, `*_dir` are confined by name; use
    `WorkspacePath` for a path argument with any other name.
    """

    def __repr__(self) -> str:
        return "WorkspacePath"


WorkspacePath = Annotated[str, WorkspacePathMarker()]
# The argument almost every tool takes.
TaskPath = Annotated[
    WorkspacePath, Field(description="Path of the task record (YAML), relative to the workspace or absolute inside it.")
]


class ToolHints(BaseModel):
    """What a client may assume about a tool: shown as its MCP `title` and `annotations`.

    Declared in the script with `@tool_hints(...)`; the server maps it onto MCP's
    ToolAnnotations (the engine itself knows nothing of MCP).
    """

    title: str
    # Reads only: no task record, file or folder is written.
    read_only: bool
    # May delete or overwrite what a user or an earlier step made (MCP destructiveHint: not only additive):
    # a rewritten DELIVERY.md, a replaced bundle, results dropped by a re-export or a changed SoC.
    destructive: bool = False
    # Calling again with the same arguments changes nothing more than timestamps (a rerun reuses, or
    # writes the same result without a new decision).
    idempotent: bool = True
    # Reaches outside this machine (network, hub): never for omskills' own tools.
    open_world: bool = False
    # Runs a model, an export or ONNX Runtime: minutes at full scale; offered start-then-poll too.
    long_running: bool = False


def tool_hints(**hints: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator for a tool function:
    `@tool_hints(title="Profile the main path", read_only=False, long_running=True)`."""
    parsed = ToolHints(**hints)

    def attach(func: Callable[..., Any]) -> Callable[..., Any]:
        func.__omskills_hints__ = parsed  # type: ignore[attr-defined]
        return func

    return attach


def hints_of(func: Callable[..., Any]) -> ToolHints | None:
    """The `@tool_hints` a tool function declares, or None."""
    return getattr(func, "__omskills_hints__", None)


def skills_root() -> Path:
    """Where the skill folders are: $OMSKILLS_SKILLS_DIR, else the checkout's skills/."""
    env = os.environ.get("OMSKILLS_SKILLS_DIR")
    if env:
        return Path(env).resolve()
    package = Path(__file__).resolve().parent.parent
    # A checkout has skills/ beside tools/ (this file is tools/omskills/host/toolkit.py); a wheel
    # ships them as omskills/_skills.
    for candidate in (package.parents[1] / "skills", package / "_skills"):
        if candidate.is_dir():
            return candidate
    raise OmskillsError("cannot find the skills folder: set OMSKILLS_SKILLS_DIR")


def repo_root() -> Path:
    return skills_root().parent


@dataclass(frozen=True)
class ToolInfo:
    name: str
    skill: str
    path: Path
    func: Callable[..., Any]

    @property
    def description(self) -> str:
        return inspect.getdoc(self.func) or ""

    @property
    def summary(self) -> str:
        """The docstring's first paragraph on one line: what `tool --list` shows."""
        return first_paragraph(self.description)

    @property
    def hints(self) -> ToolHints | None:
        """The script's `@tool_hints`, or None when it declares none (`omskills validate` says so)."""
        return hints_of(self.func)


def first_paragraph(text: str) -> str:
    return " ".join(text.strip().split("\n\n", 1)[0].split())


def parameter_description(annotation: Any) -> str | None:
    """The `Field(description=...)` inside a parameter's `Annotated[...]`, or None."""
    if get_origin(annotation) is Annotated:
        for meta in reversed(get_args(annotation)[1:]):
            if isinstance(meta, FieldInfo) and meta.description:
                return meta.description
        return parameter_description(get_args(annotation)[0])
    return None


def load_tool(path: Path) -> ToolInfo:
    """Import one script file and return the function named after the file."""
    name = path.stem
    skill = path.parent.parent.name
    spec = importlib.util.spec_from_file_location(f"omskills_skill_{skill.replace('-', '_')}_{name}", path)
    if spec is None or spec.loader is None:
        raise OmskillsError(f"cannot import tool script {path}")
    module = importlib.util.module_from_spec(spec)
    # Registered first, as importlib's recipe does: pydantic resolves a model's postponed
    # annotations (`from __future__ import annotations`) through sys.modules.
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(spec.name, None)
        raise
    func = getattr(module, name, None)
    if not callable(func):
        raise OmskillsError(
            f"{path}: defines no function named {name!r} (a tool file defines a function of its own name)"
        )
    return ToolInfo(name=name, skill=skill, path=path, func=func)


def tool_files(root: Path | None = None) -> list[Path]:
    root = root or skills_root()
    return sorted(p for p in root.glob("*/scripts/*.py") if not p.name.startswith("_"))


def discover_tools(root: Path | None = None) -> Registry[ToolInfo]:
    """Every skill tool under `root` (default: the skills folder), by name."""
    tools: Registry[ToolInfo] = Registry("tool")
    paths: dict[str, Path] = {}
    for path in tool_files(root):
        info = load_tool(path)
        if not TOOL_NAME.match(info.name):
            raise OmskillsError(f"{path}: tool name {info.name!r} is not valid for MCP/Anthropic ({TOOL_NAME.pattern})")
        if info.name in paths:
            raise OmskillsError(f"tool name {info.name!r} is defined twice: {paths[info.name]} and {path}")
        paths[info.name] = path
        tools.register(info.name, info)
    return tools


def tool_listing(tools: list[ToolInfo], width: int | None = None) -> str:
    """Each tool's name, skill and title, then its whole summary (the docstring's first paragraph), wrapped."""
    width = width or min(shutil.get_terminal_size((100, 24)).columns, 120)
    blocks = []
    for info in tools:
        title = f" - {info.hints.title}" if info.hints else ""
        head = f"{info.name}  [{info.skill}]{title}"
        # file names such as verify/report-emulated.json are not split at their hyphens
        body = textwrap.fill(
            info.summary,
            width=width,
            initial_indent="    ",
            subsequent_indent="    ",
            break_on_hyphens=False,
            break_long_words=False,
        )
        blocks.append(f"{head}\n{body}" if body else head)
    return "\n\n".join(blocks)


def _problem(error: Any) -> str:
    """One pydantic error as plain words (no URL, no input dump)."""
    if error["type"] == "literal_error":
        return f"must be one of {error['ctx']['expected']}"
    message = str(error["msg"])
    return message[0].lower() + message[1:] if message.startswith("Input should") else message


def _where(pname: str, loc: tuple[Any, ...]) -> str:
    # The type-adapter's own loc names union arms ("str", "none"); keep only list indexes and keys.
    inner = "".join(f"[{part!r}]" for part in loc if isinstance(part, int))
    return f"argument {pname!r}{inner}"


def argument_problems(
    func: Callable[..., Any], args: dict[str, Any], *, ignored: Iterable[str] = ()
) -> tuple[dict[str, Any], list[str]]:
    """The validated arguments and every problem with them, one readable line per argument.

    `ignored`: parameters that are not the caller's to give (the MCP server's context argument).
    """
    skipped = set(ignored)
    parameters = {name: p for name, p in inspect.signature(func).parameters.items() if name not in skipped}
    hints = inspect.get_annotations(func, eval_str=True)
    problems = [
        f"argument {name!r}: unknown (this tool takes {', '.join(parameters) or 'no arguments'})"
        for name in args
        if name not in parameters
    ]
    bound: dict[str, Any] = {}
    for pname, param in parameters.items():
        if pname not in args:
            if param.default is inspect.Parameter.empty:
                problems.append(f"argument {pname!r}: required")
            continue
        try:
            bound[pname] = TypeAdapter(hints.get(pname, Any)).validate_python(args[pname])
        except ValidationError as err:
            problems.append(_argument_problem(pname, err))
    return bound, problems


def _argument_problem(pname: str, err: ValidationError) -> str:
    """One line for one argument; a union reports an error per arm, each distinct one said once."""
    by_place: dict[str, list[str]] = {}
    for error in err.errors():
        by_place.setdefault(_where(pname, error["loc"]), []).append(_problem(error))
    return "; ".join(f"{where}: {' or '.join(dict.fromkeys(found))}" for where, found in by_place.items())


def validate_arguments(func: Callable[..., Any], args: dict[str, Any]) -> dict[str, Any]:
    """Check arguments against the signature; one error listing every bad, missing or unknown
    argument, one line each ("argument 'mode': must be one of ...")."""
    bound, problems = argument_problems(func, args)
    if problems:
        raise InputError("\n".join(problems))
    return bound


def call_tool(func: Callable[..., Any], args: dict[str, Any]) -> Any:
    return func(**validate_arguments(func, args))


def to_jsonable(result: Any) -> Any:
    if isinstance(result, BaseModel):
        return result.model_dump(mode="json")
    return TypeAdapter(type(result)).dump_python(result, mode="json") if result is not None else None


def takes_text(hint: Any) -> bool:
    """Whether a parameter takes text only (a name, a path, a choice of words): its flag's value
    is then the string given, never decoded as JSON."""
    origin = get_origin(hint)
    if origin is Annotated:
        return takes_text(get_args(hint)[0])
    if origin in (Union, types.UnionType):
        return all(takes_text(arg) for arg in get_args(hint) if arg is not type(None))
    if origin is Literal:
        return all(isinstance(arg, str) for arg in get_args(hint))
    return isinstance(hint, type) and issubclass(hint, (str, PurePath))


def run_cli(func: Callable[..., Any], argv: list[str] | None = None, prog: str | None = None) -> int:
    """Run a tool function as a CLI: one flag per parameter, or --args JSON; the result is printed
    as JSON on stdout; a refused input is reported on stderr, one line per problem (exit 2)."""
    parser = argparse.ArgumentParser(
        prog=prog or func.__name__,
        description=inspect.getdoc(func),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--args", help="all arguments as one JSON object")
    sig = inspect.signature(func)
    hints = inspect.get_annotations(func, eval_str=True)
    for pname, param in sig.parameters.items():
        default = f"(default: {param.default!r})" if param.default is not inspect.Parameter.empty else "(required)"
        described = parameter_description(hints.get(pname))
        parser.add_argument(
            f"--{pname.replace('_', '-')}", dest=pname, help=f"{described} {default}" if described else default
        )
    ns = parser.parse_args(argv)
    try:
        args: dict[str, Any] = json.loads(ns.args) if ns.args else {}
    except json.JSONDecodeError as err:
        print(f"error: --args is not valid JSON: {err}", file=sys.stderr)
        return 2
    except RecursionError:
        print("error: --args is nested too deeply to be a tool's arguments", file=sys.stderr)
        return 2
    if not isinstance(args, dict):
        print(f"error: --args must be a JSON object, not {type(args).__name__}", file=sys.stderr)
        return 2
    for pname in sig.parameters:
        value = getattr(ns, pname)
        if value is None:
            continue
        if takes_text(hints.get(pname)):
            args[pname] = value  # a name like 123, true or null is a name
            continue
        try:
            args[pname] = json.loads(value)
        except (json.JSONDecodeError, RecursionError):
            args[pname] = value
    try:
        result = call_tool(func, args)
    except OmskillsError as err:
        for line in str(err).splitlines():
            print(f"error: {line}", file=sys.stderr)
        return 2
    except OSError as err:  # a path the system refuses (too long, a full disk): the user's to act on
        print(f"error: {one_line(err)}", file=sys.stderr)
        return 2
    try:
        print(json.dumps(to_jsonable(result), indent=2), flush=True)
    except BrokenPipeError:  # the reader (e.g. `| head`) stopped early: not an error of the tool
        # Point stdout at /dev/null so Python's flush at exit does not fail a second time.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
