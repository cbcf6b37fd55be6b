"""The MCP server: every skill tool, SKILL.md and task record, served to any MCP client.

This is the one engine module that knows MCP. Tools are found by
`toolkit.discover_tools()` (no hand-kept list); each becomes an MCP tool whose input
schema comes from the function signature and whose structured output comes from its
pydantic return type. Tool functions are synchronous and long, so each call runs in a
worker thread with `progress.reporting_to` forwarding progress to the client.

Three guarantees the clients rely on:
- stdout carries nothing but protocol: on stdio the SDK keeps the wire on a private
  duplicate of fd 1 and points fd 1 at stderr for the rest of the process (C-level and
  child-process prints land on stderr); on top of that Python's `sys.stdout` is stderr
  while serving, and tool imports at start-up run with both levels redirected.
- a tool error is a readable `is_error` result, never a dead server.
- path arguments are confined to the workspace root given at start.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import ipaddress
import logging
import os
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Callable, get_args, get_origin

import anyio
import anyio.from_thread
import anyio.to_thread
import yaml
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ResourceError, ToolError
from mcp.server.mcpserver.resources import FileResource
from omskills import __version__, progress
from omskills.errors import InputError, OmskillsError
from omskills.host.toolkit import TOOL_NAME, ToolInfo, WorkspacePathMarker, discover_tools, skills_root
from omskills.stdio import stdout_to_stderr

log = logging.getLogger("omskills.host.mcp_server")

SERVER_NAME = "omskills"
# The name under which the handler receives the MCP context; not a tool argument.
CONTEXT_PARAM = "omskills_ctx"
# Folders never searched for task records (big, or not the user's records).
_SKIPPED_DIRS = {".git", ".venv", "venv", "node_modules", "__pycache__", "site-packages", ".claude"}
_MAX_LISTED_RECORDS = 200


# --------------------------------------------------------------------------- paths


def is_path_parameter(name: str, annotation: Any) -> bool:
    """Whether a tool parameter holds file paths that must stay inside the workspace."""
    if name in {"task", "path", "paths", "out"} or name.endswith(("_path", "_dir", "_paths", "_dirs")):
        return True
    return _has_workspace_marker(annotation)


def _has_workspace_marker(annotation: Any) -> bool:
    if get_origin(annotation) is Annotated:
        base, *metadata = get_args(annotation)
        return any(isinstance(m, WorkspacePathMarker) for m in metadata) or _has_workspace_marker(base)
    return any(_has_workspace_marker(arg) for arg in get_args(annotation))


def confine_path(value: str, workspace: Path, argument: str) -> str:
    """Resolve `value` against the workspace; refuse anything that lands outside it."""
    candidate = Path(value).expanduser()
    if not candidate.is_absolute():
        candidate = workspace / candidate
    # resolve() follows symlinks, so a link inside the workspace cannot point out of it.
    resolved = candidate.resolve()
    if not resolved.is_relative_to(workspace):
        raise InputError(f"argument {argument!r}: path {value!r} is outside the workspace {workspace}")
    return str(resolved)


def confine_arguments(args: dict[str, Any], path_params: set[str], workspace: Path) -> dict[str, Any]:
    confined = dict(args)
    for name in path_params & set(args):
        value = args[name]
        if isinstance(value, str):
            confined[name] = confine_path(value, workspace, name)
        elif isinstance(value, (list, tuple)):
            confined[name] = [confine_path(v, workspace, name) if isinstance(v, str) else v for v in value]
    return confined


# --------------------------------------------------------------------------- tools


def _report_to_client(ctx: Context) -> progress.Reporter:
    """A progress reporter usable from the worker thread: hops to the event loop to send."""

    def forward(done: float, total: float | None, message: str) -> None:
        try:
            anyio.from_thread.run(functools.partial(ctx.report_progress, done, total, message))
        except Exception as err:  # progress is best effort; never fail the tool over it
            log.debug("progress notification not sent: %s", err)

    return forward


def _run_reporting(func: Callable[..., Any], args: dict[str, Any], reporter: progress.Reporter) -> Any:
    with progress.reporting_to(reporter):
        return func(**args)


def _as_tool_error(info: ToolInfo, err: BaseException) -> ToolError:
    if isinstance(err, OmskillsError):
        return ToolError(str(err))
    log.error("tool %s raised %s", info.name, type(err).__name__, exc_info=err)
    return ToolError(f"{type(err).__name__}: {err}")


def make_handler(info: ToolInfo, workspace: Path) -> Callable[..., Any]:
    """An async MCP handler with the tool's own typed signature plus the MCP context."""
    func = info.func
    signature = inspect.signature(func)
    hints = inspect.get_annotations(func, eval_str=True)
    path_params = {name for name in signature.parameters if is_path_parameter(name, hints.get(name))}

    async def handler(**kwargs: Any) -> Any:
        ctx: Context = kwargs.pop(CONTEXT_PARAM)
        try:
            args = confine_arguments(kwargs, path_params, workspace)
            call = functools.partial(_run_reporting, func, args, _report_to_client(ctx))
            return await anyio.to_thread.run_sync(call)
        except ToolError:
            raise
        except (Exception, SystemExit) as err:  # the server keeps serving whatever a tool does
            raise _as_tool_error(info, err) from err

    parameters = [p.replace(annotation=hints.get(name, p.annotation)) for name, p in signature.parameters.items()]
    parameters.append(inspect.Parameter(CONTEXT_PARAM, inspect.Parameter.KEYWORD_ONLY, annotation=Context))
    returns = hints.get("return", signature.return_annotation)
    handler.__signature__ = signature.replace(parameters=parameters, return_annotation=returns)  # type: ignore[attr-defined]
    handler.__annotations__ = {p.name: p.annotation for p in parameters} | {"return": returns}
    handler.__name__ = info.name
    handler.__doc__ = info.description
    return handler


def tool_description(info: ToolInfo) -> str:
    return f"[skill: {info.skill}] {info.description}"


def register_tool(server: MCPServer, info: ToolInfo, workspace: Path) -> None:
    if not TOOL_NAME.match(info.name):
        raise OmskillsError(f"{info.path}: tool name {info.name!r} is not valid for MCP/Anthropic ({TOOL_NAME.pattern})")
    server.add_tool(
        make_handler(info, workspace),
        name=info.name,
        description=tool_description(info),
        meta={"omskills/skill": info.skill, "omskills/script": f"{info.skill}/scripts/{info.path.name}"},
    )


def registration_problem(info: ToolInfo) -> str | None:
    """Why the server could not register this tool (schema, signature), or None."""
    try:
        register_tool(MCPServer(SERVER_NAME), info, Path.cwd())
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return None


# --------------------------------------------------------------------------- resources


def _skill_documents(root: Path) -> Iterator[tuple[str, Path]]:
    """(uri, path) of each SKILL.md and reference file, for progressive disclosure."""
    for skill_md in sorted(root.glob("*/SKILL.md")):
        skill = skill_md.parent.name
        yield f"skill://{skill}/SKILL.md", skill_md
        for ref in sorted((skill_md.parent / "references").glob("*")):
            if ref.is_file() and not ref.name.startswith("."):
                yield f"skill://{skill}/references/{ref.name}", ref


def _looks_like_task_record(path: Path) -> bool:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return False
    return isinstance(data, dict) and "intake" in data


def find_task_records(workspace: Path) -> list[Path]:
    found: list[Path] = []
    for folder, dirs, files in os.walk(workspace):
        dirs[:] = sorted(d for d in dirs if d not in _SKIPPED_DIRS and not d.startswith("."))
        for name in sorted(files):
            path = Path(folder) / name
            if path.suffix in {".yaml", ".yml"} and _looks_like_task_record(path):
                found.append(path)
                if len(found) >= _MAX_LISTED_RECORDS:
                    return found
    return found


def register_resources(server: MCPServer, root: Path, workspace: Path) -> None:
    for uri, path in _skill_documents(root):
        server.add_resource(FileResource(uri=uri, path=path.resolve(), name=uri.removeprefix("skill://"), mime_type="text/markdown"))
    for record in find_task_records(workspace):
        rel = record.relative_to(workspace).as_posix()
        server.add_resource(FileResource(uri=f"task://{rel}", path=record, name=f"task record {rel}", mime_type="application/yaml", encoding="utf-8"))

    # Records written after start-up are still readable through the template.
    @server.resource("task://{+path}", name="task record", mime_type="application/yaml", description="A task record (YAML) under the workspace, by relative path.")
    def read_task_record(path: str) -> str:
        try:
            target = Path(confine_path(path, workspace, "path"))
        except InputError as err:
            raise ResourceError(str(err)) from None
        if target.suffix not in {".yaml", ".yml"} or not target.is_file():
            raise ResourceError(f"no task record at {path!r} in the workspace")
        return target.read_text(encoding="utf-8")


# --------------------------------------------------------------------------- server


@dataclass(frozen=True)
class ServeOptions:
    workspace: Path
    skills_dir: Path | None = None
    http_host: str | None = None
    http_port: int | None = None


def build_server(workspace: Path, skills_dir: Path | None = None, *, quiet_stdout: bool = False, log_level: str = "INFO") -> MCPServer:
    """Discover the tools and documents and return a ready server (not yet running)."""
    workspace = workspace.resolve()
    if not workspace.is_dir():
        raise InputError(f"--workspace {workspace} is not a directory")
    root = (skills_dir or skills_root()).resolve()

    @contextlib.asynccontextmanager
    async def python_stdout_on_stderr(_: MCPServer) -> AsyncIterator[None]:
        # Only on stdio: over HTTP a lifespan runs per session and stdout is not the wire.
        with contextlib.redirect_stdout(sys.stderr):
            yield

    server = MCPServer(
        SERVER_NAME,
        title="omskills",
        version=__version__,
        instructions=(
            "Tools of the omskills skills (om-deployer, pipeline-adapter, onnx-atc-pipeline): adapt PyTorch "
            "models to Huawei Ascend OM. Read skill://om-deployer/SKILL.md first; tools that act on a task take "
            "`task`, the path of its task record. Paths must be inside the workspace " + str(workspace) + "."
        ),
        lifespan=python_stdout_on_stderr if quiet_stdout else None,
        log_level=log_level,  # type: ignore[arg-type]
    )
    tools = discover_tools(root)
    for _, info in tools.items():
        register_tool(server, info, workspace)
    register_resources(server, root, workspace)
    log.info("serving %d tools from %s, workspace %s", len(tools.names()), root, workspace)
    return server


def parse_http_address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise InputError(f"--http {text!r}: expected HOST:PORT, e.g. 127.0.0.1:8765")
    host = host.strip("[]") or "127.0.0.1"
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        # The server runs code on this machine and has no authentication: loopback only.
        raise InputError(f"--http {text!r}: only a loopback address is allowed (127.0.0.1, ::1, localhost)")
    return host, int(port)


def log_level() -> str:
    """$OMSKILLS_LOG_LEVEL (the orchestrator sets WARNING for the servers it starts), else INFO."""
    level = os.environ.get("OMSKILLS_LOG_LEVEL", "INFO").upper()
    if level not in {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}:
        raise InputError(f"OMSKILLS_LOG_LEVEL={level!r}: expected DEBUG, INFO, WARNING, ERROR or CRITICAL")
    return level


def serve(options: ServeOptions) -> None:
    level = log_level()
    logging.basicConfig(level=level, stream=sys.stderr, format="omskills serve: %(message)s")
    if options.http_host is None:
        # Tool scripts import the engine (torch, onnx, ...) before the transport owns fd 1.
        with stdout_to_stderr():
            server = build_server(options.workspace, options.skills_dir, quiet_stdout=True, log_level=level)
        server.run("stdio")
        return
    server = build_server(options.workspace, options.skills_dir, log_level=level)
    server.run("streamable-http", host=options.http_host, port=options.http_port or 8765)
