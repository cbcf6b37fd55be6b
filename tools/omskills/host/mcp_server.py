"""The MCP server: every skill tool, SKILL.md, task record and run output, served to any MCP client.

This is the one engine module that knows MCP. Tools are found by
`toolkit.discover_tools()` (no hand-kept list); each becomes an MCP tool whose input
schema comes from the function signature and whose structured output comes from its
pydantic return type. Tool functions are synchronous and long, so each call runs as a job
(`host/jobs.py`) in a worker thread of its own, with its progress forwarded to the client.

Long work that clients can hold:
- every call sends a progress notification at once ("<tool>: started"), then each phase the
  engine reports, and a heartbeat (elapsed time and the last phase) at least every
  HEARTBEAT_SECONDS; the progress value is the elapsed time, so it only grows;
- clients that cut requests off (a minute or less) use the server's own job tools:
  `start_job(tool, arguments)` answers with a job id at once, `job_status(job_id,
  wait_seconds)` polls (and sends progress while it waits), `cancel_job`, `list_jobs`;
- `notifications/cancelled`, a client gone (HTTP session ended, stdin closed, parent process
  dead) and `cancel_job` stop the work at its next progress point (`progress.Cancelled`);
- tools that write or run a model take turns (`takes_turns`, `jobs.Turns`): one at a time, in
  call order; a waiting call says for whom it waits.

Guarantees the clients rely on:
- stdout carries nothing but protocol: on stdio the SDK keeps the wire on a private
  duplicate of fd 1 and points fd 1 at stderr for the rest of the process (C-level and
  child-process prints land on stderr); on top of that Python's `sys.stdout` is stderr
  while serving, and tool imports at start-up run with both levels redirected.
- a tool error is a readable `is_error` result, never a dead server; a bad argument is
  one line per argument, and unknown arguments are refused as the CLI refuses them.
- path arguments and resources are confined to the workspace root given at start.
- on stdio the server ends with its parent (`host/parent_watch.py`).
"""

from __future__ import annotations

import contextlib
import inspect
import ipaddress
import logging
import math
import os
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

import anyio
import anyio.to_thread
import mcp_types
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ResourceError, ToolError
from mcp.server.mcpserver.resources import FileResource
from mcp.server.transport_security import TransportSecuritySettings
from omskills import progress
from omskills.errors import InputError, OmskillsError, one_line
from omskills.host import mcp_resources
from omskills.host.job_store import JobStore
from omskills.host.jobs import Job, JobList, JobRegistry, JobStatus
from omskills.host.mcp_prompts import register_prompts
from omskills.host.toolkit import (
    TOOL_NAME,
    ToolInfo,
    WorkspacePathMarker,
    argument_problems,
    discover_tools,
    skills_root,
    to_jsonable,
)
from omskills.records.intake import confined_path
from omskills.stdio import stdout_to_stderr
from omskills.version import __version__
from pydantic import Field

log = logging.getLogger("omskills.host.mcp_server")

SERVER_NAME = "omskills"
# The name under which the handler receives the MCP context; not a tool argument.
CONTEXT_PARAM = "omskills_ctx"
# A progress notification at least this often while a tool runs (clients reset their timeouts on it).
HEARTBEAT_SECONDS = 2.0
# How often a waiting request looks at its job.
_POLL_SECONDS = 0.1
# The longest job_status / cancel_job may wait: under every client's request timeout we know of.
MAX_WAIT_SECONDS = 50.0
# How often a waiting request asks whether its HTTP client is still connected.
_CONNECTION_CHECK_SECONDS = 1.0
# After a cancel, how long a request waits for its job to stop before it lets go.
_CANCEL_GRACE_SECONDS = 5.0
JOB_TOOLS = ("start_job", "job_status", "cancel_job", "list_jobs")


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
    """Resolve `value` against the workspace (symlinks followed); refuse anything that lands outside it."""
    return str(
        confined_path(
            value, f"argument {argument!r}", workspace, [workspace], root_name="the workspace", widened_by_env=False
        )
    )


def confine_arguments(args: dict[str, Any], path_params: set[str], workspace: Path) -> dict[str, Any]:
    confined = dict(args)
    for name in path_params & set(args):
        value = args[name]
        if isinstance(value, str):
            confined[name] = confine_path(value, workspace, name)
        elif isinstance(value, (list, tuple)):
            confined[name] = [confine_path(v, workspace, name) if isinstance(v, str) else v for v in value]
    return confined


def path_parameters(func: Callable[..., Any]) -> set[str]:
    hints = inspect.get_annotations(func, eval_str=True)
    return {name for name in inspect.signature(func).parameters if is_path_parameter(name, hints.get(name))}


# --------------------------------------------------------------------------- following a job


class _ProgressSender:
    """Progress notifications for one request; the value is the job's elapsed time, so it only grows."""

    def __init__(self, ctx: Context, job: Job) -> None:
        self.ctx, self.job = ctx, job
        self.last_value = -1.0
        self.last_sent = 0.0

    async def send(self, message: str) -> None:
        value = max(round(self.job.elapsed, 3), self.last_value + 0.001)
        self.last_value, self.last_sent = value, time.monotonic()
        try:
            await self.ctx.report_progress(value, None, message)
        except anyio.get_cancelled_exc_class():
            raise
        except Exception as err:  # progress is best effort; never fail the call over it
            log.debug("progress notification not sent: %s", err)


def _phase_line(job: Job) -> str:
    p = job.progress
    counts = f" ({p.done:g}/{p.total:g})" if p.done is not None and p.total else ""
    return progress.phase_line(job.tool, f"{p.message}{counts}", job.elapsed)


def heartbeat_seconds() -> float:
    """$OMSKILLS_HEARTBEAT_SECONDS (a positive number), else HEARTBEAT_SECONDS."""
    text = os.environ.get("OMSKILLS_HEARTBEAT_SECONDS")
    return HEARTBEAT_SECONDS if text is None else parse_heartbeat_seconds(text)


def parse_heartbeat_seconds(text: str) -> float:
    """A value of OMSKILLS_HEARTBEAT_SECONDS (install-client checks the one it writes here too)."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < math.inf:
        raise InputError(f"OMSKILLS_HEARTBEAT_SECONDS={text!r}: expected a positive number of seconds")
    return value


def _heartbeat_line(job: Job) -> str:
    return progress.heartbeat_line(job.tool, job.elapsed, job.progress.message)


async def _client_gone(ctx: Context) -> bool:
    """Whether the HTTP client of this request has disconnected (always False on stdio).

    The SDK keeps serving a request whose POST stream the client dropped (its session stays
    open while a request is in flight), so a disconnect is only seen by asking the connection.
    """
    request = getattr(ctx.request_context, "request", None)
    is_disconnected = getattr(request, "is_disconnected", None)
    if is_disconnected is None:
        return False
    try:
        return bool(await is_disconnected())
    except Exception:  # a transport that cannot tell: keep serving
        return False


async def follow(job: Job, ctx: Context, *, seconds: float | None = None, announce: bool = False) -> bool:
    """Forward the job's progress to this request until it ends (or `seconds` pass), with heartbeats.

    Returns False if the client disconnected first (HTTP), True otherwise.
    """
    sender = _ProgressSender(ctx, job)
    heartbeat = getattr(ctx.mcp_server, "heartbeat_seconds", HEARTBEAT_SECONDS)
    if announce:
        await sender.send(f"{job.tool}: started")
    seen = job.reports
    deadline = None if seconds is None else time.monotonic() + seconds
    next_connection_check = time.monotonic() + _CONNECTION_CHECK_SECONDS
    while not job.finished.is_set():
        if deadline is not None and time.monotonic() >= deadline:
            return True
        if time.monotonic() >= next_connection_check:
            if await _client_gone(ctx):
                return False
            next_connection_check = time.monotonic() + _CONNECTION_CHECK_SECONDS
        await anyio.sleep(_POLL_SECONDS)
        if job.reports != seen:
            seen = job.reports
            await sender.send(_phase_line(job))
        elif time.monotonic() - sender.last_sent >= heartbeat and not job.finished.is_set():
            await sender.send(_heartbeat_line(job))
    return True


async def _wait_stopped(job: Job, seconds: float) -> None:
    with anyio.move_on_after(seconds):
        while not job.finished.is_set():
            await anyio.sleep(_POLL_SECONDS)


async def run_followed(job: Job, ctx: Context) -> None:
    """Follow a direct call's job; if the request is cancelled (client cancel, disconnect), cancel the job."""
    try:
        if not await follow(job, ctx, announce=True):
            log.info("call of %s: the client disconnected; cancelling job %s", job.tool, job.id)
            job.cancel()
            await _wait_stopped(job, _CANCEL_GRACE_SECONDS)
    except anyio.get_cancelled_exc_class():
        job.cancel()
        with anyio.CancelScope(shield=True):
            await _wait_stopped(job, _CANCEL_GRACE_SECONDS)
        log.info("call of %s cancelled by the client (job %s: %s)", job.tool, job.id, job.state)
        raise


# --------------------------------------------------------------------------- tools


def _registry_of(ctx: Context) -> JobRegistry:
    server = ctx.mcp_server
    registry = getattr(server, "jobs", None)
    if registry is None:  # a plain MCPServer (registration checks) still runs calls
        registry = server.jobs = JobRegistry()  # type: ignore[attr-defined]
    return registry


def _task_of(args: dict[str, Any], workspace: Path) -> tuple[Path | None, str | None]:
    task = args.get("task")
    if not isinstance(task, str):
        return None, None
    path = Path(task)
    return path, (path.relative_to(workspace).as_posix() if path.is_relative_to(workspace) else task)


def start_tool_job(
    registry: JobRegistry, info: ToolInfo, args: dict[str, Any], workspace: Path, origin: Literal["start_job", "call"]
) -> Job:
    """Confine the path arguments and start the tool as a job (arguments already validated)."""
    confined = confine_arguments(args, path_parameters(info.func), workspace)
    task, label = _task_of(confined, workspace)
    return registry.start(
        info.name,
        info.func,
        confined,
        origin=origin,
        task=task,
        task_label=label,
        exclusive=takes_turns(info),
        to_json=to_jsonable,
    )


def takes_turns(info: ToolInfo) -> bool:
    """Whether the tool runs only when no other such tool runs (see jobs.Turns): it writes, or it runs a
    model (long_running: the process-wide model cache and build patches), or it declares no hints."""
    hints = info.hints
    return hints is None or not hints.read_only or hints.long_running


# In a failed call's `_meta`: the error is the user's to act on (a bad argument, record field or
# input a driver's check refused), the kind the tool's CLI exits 2 for; `omskills adapt` does too.
USERS_ERROR_META = "omskills/users_error"


def users_error(text: str) -> mcp_types.CallToolResult:
    """A failed call whose error the user acts on: `text` as the client reads it, marked as such."""
    return mcp_types.CallToolResult(
        content=[mcp_types.TextContent(type="text", text=text)], is_error=True, _meta={USERS_ERROR_META: True}
    )


def _tool_error_text(tool: str, message: str) -> str:
    """What the SDK makes of a `ToolError` a tool raises: the text every other failed call carries."""
    return f"Error executing tool {tool}: {message}"


def make_handler(info: ToolInfo, workspace: Path) -> Callable[..., Any]:
    """An async MCP handler with the tool's own typed signature plus the MCP context."""
    func = info.func
    signature = inspect.signature(func)
    hints = inspect.get_annotations(func, eval_str=True)

    async def handler(**kwargs: Any) -> Any:
        ctx: Context = kwargs.pop(CONTEXT_PARAM)
        try:
            job = start_tool_job(_registry_of(ctx), info, kwargs, workspace, "call")
        except (OmskillsError, ValueError, OSError) as err:  # any other error would reach the client without its reason
            return users_error(_tool_error_text(info.name, one_line(err)))
        await run_followed(job, ctx)
        if job.state == "succeeded":
            return job.result
        # The same one-line error a start_job client reads in job_status.
        error = job.error or f"{info.name} ended: {job.state}"
        if job.state == "failed" and job.users_error:
            return users_error(_tool_error_text(info.name, error))
        raise ToolError(error)

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
    """Serve one tool, with its title and annotations from the script's `@tool_hints`."""
    if not TOOL_NAME.match(info.name):
        raise OmskillsError(
            f"{info.path}: tool name {info.name!r} is not valid for MCP/Anthropic ({TOOL_NAME.pattern})"
        )
    hints = info.hints
    if hints is None:
        # Served without annotations: MCP clients then assume the worst (may write, destroy, repeat
        # differently) and ask before calling. `omskills validate` reports the missing hints.
        log.warning("%s: tool %r declares no @tool_hints; served without a title or annotations", info.path, info.name)
    server.add_tool(
        make_handler(info, workspace),
        name=info.name,
        title=hints.title if hints else None,
        description=tool_description(info),
        annotations=None
        if hints is None
        else mcp_types.ToolAnnotations(
            title=hints.title,
            read_only_hint=hints.read_only,
            destructive_hint=hints.destructive,
            idempotent_hint=hints.idempotent,
            open_world_hint=hints.open_world,
        ),
        meta={
            "omskills/skill": info.skill,
            "omskills/script": f"{info.skill}/scripts/{info.path.name}",
            "omskills/long_running": bool(hints and hints.long_running),
        },
    )


def registration_problem(info: ToolInfo) -> str | None:
    """Why the server could not register this tool (schema, signature), or None."""
    try:
        register_tool(MCPServer(SERVER_NAME), info, Path.cwd())
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return None


# --------------------------------------------------------------------------- job tools


def _job_tool_signature(fn: Callable[..., Any], tool_names: Iterable[str]) -> None:
    """Give start_job's `tool` parameter the served tool names as its enum."""
    names = tuple(sorted(tool_names))
    annotation = Annotated[Literal.__getitem__(names), Field(description="The tool to run, as tools/list names it.")]  # type: ignore[attr-defined]
    hints = inspect.get_annotations(fn, eval_str=True) | {"tool": annotation}
    sig = inspect.signature(fn)
    fn.__annotations__ = hints
    fn.__signature__ = sig.replace(
        parameters=[p.replace(annotation=hints[p.name]) for p in sig.parameters.values()],
        return_annotation=hints["return"],
    )  # type: ignore[attr-defined]


def register_job_tools(server: OmskillsServer, workspace: Path) -> None:
    """start_job / job_status / cancel_job / list_jobs: long tools for clients with short request timeouts."""
    registry = server.jobs

    async def start_job(
        tool: str,
        arguments: Annotated[
            dict[str, Any], Field(description="The tool's arguments, exactly as a direct call takes them.")
        ] = {},  # noqa: B006
        *,
        ctx: Context,
    ) -> JobStatus:
        """Start a tool as a job and answer at once with its id: for long tools (model runs, exports,
        ONNX Runtime) in clients that cut requests off after a minute or less. Arguments are checked and
        confined exactly as in a direct call. The job runs in a process of its own and outlives this
        server: any server on the same workspace follows it with job_status (which waits up to wait_seconds
        and sends progress meanwhile) and stops it with cancel_job. One job per task record at a time."""
        info = server.tool_infos.get(tool)
        if info is None:
            raise ToolError(f"argument 'tool': {tool!r} cannot be started as a job")
        try:
            # The server checked them already (OmskillsServer.call_tool); this binds them to the function.
            validated, problems = argument_problems(info.func, server.parsed_arguments(tool, arguments))
            if problems:
                raise InputError("\n".join(f"{tool}: {line}" for line in problems))
            confined = confine_arguments(validated, path_parameters(info.func), workspace)
            task, label = _task_of(confined, workspace)
            job = registry.start_detached(
                tool,
                confined,
                skills_dir=server.skills_dir or skills_root(),
                task=task,
                task_label=label,
                exclusive=takes_turns(info),
            )
        except OmskillsError as err:
            raise ToolError(str(err)) from None
        await follow(job, ctx, seconds=0.3, announce=True)  # a quick tool (or a bad record) answers at once
        return job.status()

    _job_tool_signature(start_job, server.tool_infos)

    async def job_status(
        job_id: Annotated[str, Field(description="The job id start_job returned, e.g. job-20261203-190512-3f9a1c.")],
        wait_seconds: Annotated[
            float,
            Field(
                ge=0,
                le=MAX_WAIT_SECONDS,
                description=(
                    "Wait up to this many seconds for the job to end before answering (progress notifications are sent "
                    "meanwhile); 0 answers at once. Keep it under your client's request timeout."
                ),
            ),
        ] = 5.0,
        *,
        ctx: Context,
    ) -> JobStatus:
        """The state of a job (running, succeeded, failed, cancelled), its last progress and elapsed time; on
        success the tool's structured result, on failure its one-line error."""
        try:
            job = registry.get(job_id)
        except OmskillsError as err:
            raise ToolError(str(err)) from None
        await follow(job, ctx, seconds=wait_seconds)
        return job.status()

    async def cancel_job(
        job_id: Annotated[str, Field(description="The job id start_job returned.")],
        wait_seconds: Annotated[
            float, Field(ge=0, le=MAX_WAIT_SECONDS, description=("Wait up to this many seconds for the job to stop."))
        ] = 5.0,
    ) -> JobStatus:
        """Cancel a job: it stops at its next progress point, the step it was in is recorded as failed (never
        done) and a rerun of the tool redoes it. Answers with the job's state (cancelled once it stopped)."""
        try:
            job = registry.get(job_id)
        except OmskillsError as err:
            raise ToolError(str(err)) from None
        job.cancel()
        await _wait_stopped(job, wait_seconds)
        return job.status()

    async def list_jobs() -> JobList:
        """Every running job (started ones and direct calls in progress) and the recent finished ones, newest
        first, without their results (job_status gives a job's result)."""
        return JobList(jobs=[job.status(with_result=False) for job in registry.all()])

    annotations = {
        "start_job": (
            "Start a tool as a job",
            dict(read_only_hint=False, destructive_hint=False, idempotent_hint=False),
        ),
        "job_status": ("Status of a job", dict(read_only_hint=True, destructive_hint=False, idempotent_hint=True)),
        "cancel_job": ("Cancel a job", dict(read_only_hint=False, destructive_hint=False, idempotent_hint=True)),
        "list_jobs": ("List jobs", dict(read_only_hint=True, destructive_hint=False, idempotent_hint=True)),
    }
    for fn in (start_job, job_status, cancel_job, list_jobs):
        title, hints = annotations[fn.__name__]
        server.add_tool(
            fn,
            name=fn.__name__,
            title=title,
            description=f"[server: jobs] {inspect.getdoc(fn)}",
            annotations=mcp_types.ToolAnnotations(title=title, open_world_hint=False, **hints),
            meta={"omskills/skill": None},
        )


# --------------------------------------------------------------------------- the server


class OmskillsServer(MCPServer):
    """MCPServer with the omskills runtime: jobs, arguments checked like the CLI, resources listed live."""

    def __init__(self, *args: Any, workspace: Path, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.workspace = workspace
        self.jobs = JobRegistry(JobStore(workspace))
        self.skills_dir: Path | None = None
        self.tool_infos: dict[str, ToolInfo] = {}
        self.heartbeat_seconds = heartbeat_seconds()

    async def call_tool(self, name: str, arguments: dict[str, Any], context: Context | None = None) -> Any:
        problems = self.argument_problems(name, arguments)
        if problems:
            return users_error("\n".join(problems))
        return await super().call_tool(name, arguments, context)

    def argument_problems(self, name: str, arguments: dict[str, Any]) -> list[str]:
        """One line per bad argument, each starting with the tool it is for (start_job's `arguments`
        are checked against the tool they start, exactly as a direct call would be).

        The arguments are read as the SDK will read them (JSON strings parsed first), then checked by
        the toolkit's one check, the CLI's, for skill tools and the server's job tools alike.
        """
        tool = self._tool_manager.get_tool(name)
        if tool is None:
            return []  # the SDK answers "unknown tool"
        parsed = self.parsed_arguments(name, arguments)
        info = self.tool_infos.get(name)
        func, ignored = (info.func, ()) if info is not None else (tool.fn, tuple(filter(None, [tool.context_kwarg])))
        problems = argument_problems(func, parsed, ignored=ignored)[1]
        if problems:
            return [f"{name}: {line}" for line in problems]
        started, started_arguments = parsed.get("tool"), parsed.get("arguments", {})
        if name == "start_job" and started in self.tool_infos and isinstance(started_arguments, dict):
            return self.argument_problems(started, started_arguments)
        return []

    def parsed_arguments(self, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
        """Arguments as the SDK reads them: a list or object sent as a JSON string (some model clients
        do) is parsed first, so the check here accepts what the call itself accepts."""
        tool = self._tool_manager.get_tool(name)
        return tool.fn_metadata.pre_parse_json(arguments) if tool is not None else arguments

    async def list_resources(self) -> list[mcp_types.Resource]:
        """The skill documents, and the task records and run outputs as found now (walked in a thread)."""
        static = await super().list_resources()
        found = await anyio.to_thread.run_sync(mcp_resources.listed_workspace, self.workspace)
        return static + [
            mcp_types.Resource(
                uri=item.uri,
                name=item.name,
                title=item.title,
                description=item.description,
                mime_type=item.mime_type,
                size=item.size,
            )
            for item in found
        ]


def _resource_reader(workspace: Path, resolve: Callable[[str, Path], Path]) -> Callable[[str], str | bytes]:
    def read(path: str) -> str | bytes:
        try:
            return mcp_resources.read_file(resolve(path, workspace))
        except InputError as err:
            raise ResourceError(str(err)) from None
        except (OSError, UnicodeDecodeError) as err:
            raise ResourceError(f"{path!r}: cannot be read ({type(err).__name__})") from None

    return read


def _settled_task_record(value: str, workspace: Path) -> Path:
    """A task record's path, its text first brought up to date when a step it says is running has
    no process any more (read as interrupted, with the command that redoes it). A record that
    cannot be loaded or written is served as it is."""
    from omskills.records.task import settle_on_disk

    path = mcp_resources.task_record_path(value, workspace)
    with contextlib.suppress(OmskillsError, OSError):
        settle_on_disk(path)
    return path


# (URI template, name, MIME type, description); the first template matching a URI reads it.
RUN_TEMPLATES: list[tuple[str, str, str, str]] = [
    (
        "run://{+path}/DELIVERY.md",
        "delivery note",
        "text/markdown",
        "The delivery note of a run (path: the run folder): boundary, environment, ATC commands, "
        "validation figures, limits.",
    ),
    (
        "run://{+path}.html",
        "report",
        "text/html",
        "An HTML report of a run, e.g. verify/<name>.html: the verification report (report.html) with its pictures.",
    ),
    (
        "run://{+path}.png",
        "picture",
        "image/png",
        "A picture a run drew (overlays per step, compute-share chart), as a PNG blob.",
    ),
    (
        "run://{+path}.json",
        "run result",
        "application/json",
        "A JSON result of a run: verify/*.json (output checks, parity, latency), study/main_path.json.",
    ),
    ("run://{+path}.md", "note", "text/markdown", "A Markdown note of a run: plan, contracts, boundaries, inventory."),
    ("run://{+path}.log", "log", "text/plain", "A step's log (export, optimisation, ATC)."),
    ("run://{+path}.sh", "script", "text/x-shellscript", "A shell script a run wrote (the ATC command lines)."),
    ("run://{+path}.yaml", "YAML file", "application/yaml", "A YAML file of a run."),
]


def register_resources(server: MCPServer, root: Path, workspace: Path) -> None:
    """Skill documents (listed now), task records and run outputs (templates; listed when asked)."""
    for doc in mcp_resources.skill_documents(root):
        server.add_resource(
            FileResource(
                uri=doc.uri,
                path=doc.path,
                name=doc.name,
                title=doc.title,
                description=doc.description,
                mime_type="text/markdown",
            )
        )

    server.resource(
        "task://{+path}",
        name="task record",
        title="Task record",
        mime_type="application/yaml",
        description="A task record (YAML) by workspace-relative path: intake, stage statuses, every stage's results.",
    )(_resource_reader(workspace, _settled_task_record))

    for template, name, mime, description in RUN_TEMPLATES:
        suffix = "/DELIVERY.md" if template.endswith("/DELIVERY.md") else template.removeprefix("run://{+path}")

        def resolve(path: str, ws: Path, suffix: str = suffix) -> Path:
            return mcp_resources.run_file_path(path + suffix, ws)

        server.resource(template, name=name, title=name.capitalize(), mime_type=mime, description=description)(
            _resource_reader(workspace, resolve)
        )


# --------------------------------------------------------------------------- server


@dataclass(frozen=True)
class ServeOptions:
    workspace: Path
    skills_dir: Path | None = None
    http_host: str | None = None
    http_port: int | None = None


def build_server(
    workspace: Path, skills_dir: Path | None = None, *, quiet_stdout: bool = False, log_level: str = "INFO"
) -> OmskillsServer:
    """Discover the tools and documents and return a ready server (not yet running).

    Nothing here walks the workspace or imports a tool's engine: `initialize` must come fast.
    """
    workspace = workspace.resolve()
    if not workspace.is_dir():
        raise InputError(f"--workspace {workspace} is not a directory")
    root = (skills_dir or skills_root()).resolve()

    @contextlib.asynccontextmanager
    async def python_stdout_on_stderr(_: MCPServer) -> AsyncIterator[None]:
        # Only on stdio: over HTTP a lifespan runs per session and stdout is not the wire.
        with contextlib.redirect_stdout(sys.stderr):
            yield

    server = OmskillsServer(
        SERVER_NAME,
        title="omskills",
        version=__version__,
        instructions=(
            "Tools of the omskills skills (om-deployer, pipeline-adapter, onnx-atc-pipeline): adapt PyTorch "
            "models to Huawei Ascend OM. Read skill://om-deployer/SKILL.md first; tools that act on a task take "
            "`task`, the path of its task record. Paths must be inside the workspace " + str(workspace) + ". "
            "Long tools send progress; if your client cuts requests off, run them with start_job and poll job_status."
        ),
        lifespan=python_stdout_on_stderr if quiet_stdout else None,
        log_level=log_level,  # type: ignore[arg-type]
        workspace=workspace,
    )
    tools = discover_tools(root)
    if not tools.names():
        raise OmskillsError(f"no tools found under {root} (a tool is <skill>/scripts/<name>.py)")
    for name, info in tools.items():
        if name in JOB_TOOLS:
            raise OmskillsError(
                f"{info.path}: the tool name {name!r} is the server's own (job tools: {', '.join(JOB_TOOLS)})"
            )
        register_tool(server, info, workspace)
        server.tool_infos[name] = info
    server.skills_dir = root
    register_job_tools(server, workspace)
    register_resources(server, root, workspace)
    register_prompts(server, workspace)
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
    if not 1 <= int(port) <= 65535:
        raise InputError(f"--http {text!r}: port {port} is not a TCP port (1-65535)")
    return host, int(port)


def http_security(host: str, port: int) -> TransportSecuritySettings:
    """DNS-rebinding protection for the bound loopback address, however it was spelled: only
    requests whose Host (and Origin, when sent) name this address and port are served. A page
    on another site that rebinds its name to 127.0.0.1 sends its own name, and is refused."""
    names = {host, "localhost", "127.0.0.1", "::1"}
    if host != "localhost":
        names.add(str(ipaddress.ip_address(host)))  # 0:0:0:0:0:0:0:1 is also ::1
    hosts = sorted(f"[{name}]:{port}" if ":" in name else f"{name}:{port}" for name in names)
    return TransportSecuritySettings(
        enable_dns_rebinding_protection=True, allowed_hosts=hosts, allowed_origins=[f"http://{h}" for h in hosts]
    )


def _port_free(host: str, port: int) -> None:
    """One line now, rather than a traceback from the web server once it has started."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as err:
            raise InputError(f"--http {host}:{port}: cannot listen there ({err.strerror or err})") from None


def log_level() -> str:
    """$OMSKILLS_LOG_LEVEL (the orchestrator sets WARNING for the servers it starts), else INFO."""
    return parse_log_level(os.environ.get("OMSKILLS_LOG_LEVEL", "INFO"))


def parse_log_level(text: str) -> str:
    """A value of OMSKILLS_LOG_LEVEL, upper-cased (install-client checks the one it writes here too)."""
    level = text.upper()
    if level not in {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}:
        raise InputError(f"OMSKILLS_LOG_LEVEL={level!r}: expected DEBUG, INFO, WARNING, ERROR or CRITICAL")
    return level


def _interrupt_jobs(server: OmskillsServer, why: str) -> None:
    """Record the steps this server runs as interrupted, then cancel every job. The process may exit
    before a job deep in a model call reaches its next progress point (or be killed right after):
    the record says why either way, and a job that stops in time records its own end over that."""
    from omskills.records.task import record_interrupted_here

    record_interrupted_here(f"the tool server stopped ({why})")
    server.jobs.cancel_all()


def _stop_jobs(server: OmskillsServer, seconds: float, why: str) -> None:
    """Cancel every job (their steps recorded as interrupted), give them `seconds` to stop, end the
    processes they started."""
    from omskills.host.parent_watch import end_descendants

    _interrupt_jobs(server, why)
    stopped = server.jobs.wait_all(seconds)
    end_descendants()
    if not stopped:
        # A job deep in a model call would hold the interpreter's exit; record saves are atomic.
        sys.stderr.flush()
        os._exit(0)


def serve(options: ServeOptions) -> None:
    level = log_level()
    logging.basicConfig(level=level, stream=sys.stderr, format="omskills serve: %(message)s")
    if options.http_host is None:
        from omskills.host.parent_watch import exit_with_parent

        # The client is our parent: when it dies, so do we (and our children), whatever we are doing,
        # start-up included.
        started: list[OmskillsServer] = []
        exit_with_parent(before_exit=lambda why: [(_interrupt_jobs(s, why), s.jobs.wait_all(1.0)) for s in started])
        # Tool scripts import the engine (torch, onnx, ...) before the transport owns fd 1.
        with stdout_to_stderr():
            server = build_server(options.workspace, options.skills_dir, quiet_stdout=True, log_level=level)
        started.append(server)
        try:
            server.run("stdio")
        finally:
            # stdin closed or stdout broken: the client is gone.
            _stop_jobs(server, 3.0, "its client is gone")
        return
    port = options.http_port or 8765
    _port_free(options.http_host, port)
    server = build_server(options.workspace, options.skills_dir, log_level=level)
    try:
        server.run(
            "streamable-http",
            host=options.http_host,
            port=port,
            transport_security=http_security(options.http_host, port),
        )
    finally:
        _stop_jobs(server, 3.0, "it was stopped")
