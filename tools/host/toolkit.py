"""The skill-tool convention, and finding tools without a hand-kept list.

A tool is a file `skills/<skill>/scripts/<name>.py` defining a function `<name>` with a
typed signature and a docstring, returning a pydantic model (or JSON-able value). The same
file is a CLI: `python <file> --task X` or `--args '{...}'`, printing JSON on stdout.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Callable

from omskills.errors import OmskillsError
from omskills.registry import Registry
from pydantic import BaseModel, TypeAdapter, ValidationError

TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


class WorkspacePathMarker:
    """`Annotated` metadata: this argument is a file path the MCP server confines to its workspace.

    Parameters named `task`, `path`, `out`, `*_path`, `*_dir` are confined by name; use
    `WorkspacePath` for a path argument with any other name.
    """

    def __repr__(self) -> str:
        return "WorkspacePath"


WorkspacePath = Annotated[str, WorkspacePathMarker()]


class ToolHints(BaseModel):
    """What a client may assume about a tool: shown as its MCP `title` and `annotations`.

    Declared in the script with `@tool_hints(...)`; the server maps it onto MCP's
    ToolAnnotations (the engine itself knows nothing of MCP).
    """

    title: str
    # Reads only: no task record, file or folder is written.
    read_only: bool
    # May delete or overwrite what a user made (not: adds results to a run folder).
    destructive: bool = False
    # Calling again with the same arguments changes nothing more (a rerun resumes or reuses).
    idempotent: bool = True
    # Reaches outside this machine (network, hub): never for omskills' own tools.
    open_world: bool = False
    # Runs a model, an export or ONNX Runtime: minutes at full scale; offered start-then-poll too.
    long_running: bool = False


def tool_hints(**hints: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator for a tool function: `@tool_hints(title="Profile the main path", read_only=False, long_running=True)`."""
    parsed = ToolHints(**hints)

    def attach(func: Callable[..., Any]) -> Callable[..., Any]:
        func.__omskills_hints__ = parsed  # type: ignore[attr-defined]
        return func

    return attach


def skills_root() -> Path:
    """Where the skill folders are: $OMSKILLS_SKILLS_DIR, else the checkout's skills/."""
    env = os.environ.get("OMSKILLS_SKILLS_DIR")
    if env:
        return Path(env).resolve()
    package = Path(__file__).resolve().parent.parent
    # A checkout (editable install) has skills/ beside tools/; a wheel ships them as omskills/_skills.
    for candidate in (package.parent / "skills", package / "_skills"):
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
    def hints(self) -> ToolHints | None:
        """The script's `@tool_hints`, or None when it declares none (`omskills validate` says so)."""
        return getattr(self.func, "__omskills_hints__", None)


def load_tool(path: Path) -> ToolInfo:
    """Import one script file and return the function named after the file."""
    name = path.stem
    skill = path.parent.parent.name
    spec = importlib.util.spec_from_file_location(f"omskills_skill_{skill.replace('-', '_')}_{name}", path)
    if spec is None or spec.loader is None:
        raise OmskillsError(f"cannot import tool script {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    func = getattr(module, name, None)
    if not callable(func):
        raise OmskillsError(f"{path}: defines no function named {name!r} (a tool file defines a function of its own name)")
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


def validate_arguments(func: Callable[..., Any], args: dict[str, Any]) -> dict[str, Any]:
    """Check arguments against the signature; one readable error naming the argument."""
    sig = inspect.signature(func)
    unknown = set(args) - set(sig.parameters)
    if unknown:
        raise OmskillsError(f"unknown argument(s) {sorted(unknown)}; expected {list(sig.parameters)}")
    hints = inspect.get_annotations(func, eval_str=True)
    bound: dict[str, Any] = {}
    for pname, param in sig.parameters.items():
        if pname not in args:
            if param.default is inspect.Parameter.empty:
                raise OmskillsError(f"missing required argument {pname!r}")
            continue
        try:
            bound[pname] = TypeAdapter(hints.get(pname, Any)).validate_python(args[pname])
        except ValidationError as err:
            first = err.errors()[0]
            raise OmskillsError(f"argument {pname!r}: {first['msg']}") from None
    return bound


def call_tool(func: Callable[..., Any], args: dict[str, Any]) -> Any:
    return func(**validate_arguments(func, args))


def to_jsonable(result: Any) -> Any:
    if isinstance(result, BaseModel):
        return result.model_dump(mode="json")
    return TypeAdapter(type(result)).dump_python(result, mode="json") if result is not None else None


def run_cli(func: Callable[..., Any], argv: list[str] | None = None, prog: str | None = None) -> int:
    """Run a tool function as a CLI: one flag per parameter, or --args JSON; the result is printed
    as JSON on stdout, an error as one line on stderr (exit 2)."""
    parser = argparse.ArgumentParser(prog=prog or func.__name__, description=inspect.getdoc(func))
    parser.add_argument("--args", help="all arguments as one JSON object")
    sig = inspect.signature(func)
    for pname, param in sig.parameters.items():
        parser.add_argument(f"--{pname.replace('_', '-')}", dest=pname, help=f"(default: {param.default!r})" if param.default is not inspect.Parameter.empty else "(required)")
    ns = parser.parse_args(argv)
    try:
        args: dict[str, Any] = json.loads(ns.args) if ns.args else {}
    except json.JSONDecodeError as err:
        print(f"error: --args is not valid JSON: {err}", file=sys.stderr)
        return 2
    if not isinstance(args, dict):
        print(f"error: --args must be a JSON object, not {type(args).__name__}", file=sys.stderr)
        return 2
    for pname in sig.parameters:
        value = getattr(ns, pname)
        if value is not None:
            try:
                args[pname] = json.loads(value)
            except json.JSONDecodeError:
                args[pname] = value
    try:
        result = call_tool(func, args)
    except OmskillsError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(to_jsonable(result), indent=2))
    return 0
