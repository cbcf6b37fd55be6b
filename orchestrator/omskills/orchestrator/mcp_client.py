"""An MCP client session with `omskills serve`, started over stdio with the real SDK client.

Everything the orchestrator does to the skills goes through here: list the tools, call
one with a progress callback, read a SKILL.md or task record resource. The plan runner
and the Claude loop share it, so `--agent plan` and `--agent claude` take the same path.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TextIO

import anyio
import mcp_types as types
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from omskills.errors import OmskillsError
from pydantic import BaseModel

# Called as progress notifications arrive: (done, total or None, message or None).
ProgressFn = Callable[[float, float | None, str | None], Awaitable[None]]

_SERVE_ENTRY = "import sys; from omskills.orchestrator.cli import main; sys.exit(main())"

# A job_status poll that times out (a busy machine) is asked again this many times before call_as_job gives up.
POLL_TIMEOUT_RETRIES = 3

# Secrets the tool server has no use for stay out of its environment.
_WITHHELD_ENV_PREFIXES = ("ANTHROPIC_",)


class ToolSpec(BaseModel):
    """One tool as the server lists it."""

    name: str
    description: str
    input_schema: dict[str, Any]
    skill: str | None = None


class ToolCallOutcome(BaseModel):
    """What one tool call returned: text for a model to read, structured data for code."""

    name: str
    arguments: dict[str, Any]
    is_error: bool
    text: str
    structured: Any = None
    seconds: float
    # The error is the user's to act on (a bad argument, record field or input a driver's check
    # refused): what the tool's CLI exits 2 for. The server says so in the result's `_meta`.
    users_error: bool = False


class ResourceSpec(BaseModel):
    uri: str
    name: str
    mime_type: str | None = None


class OmskillsClient:
    """A connected MCP session; create it with `connect()` or `connect_http()`."""

    def __init__(self, session: ClientSession) -> None:
        self.session = session
        self._tools: list[ToolSpec] | None = None

    async def list_tools(self) -> list[ToolSpec]:
        """The skill tools, without the server's own start_job/job_status/...

        The orchestrator calls tools directly (it holds a request as long as the tool runs, with
        progress) or through `call_as_job`, so a model it drives needs no start-then-poll tools.
        """
        if self._tools is None:
            listed = await self.session.list_tools()
            self._tools = [
                ToolSpec(
                    name=t.name,
                    description=t.description or "",
                    input_schema=t.input_schema,
                    skill=(t.meta or {}).get("omskills/skill"),
                )
                for t in listed.tools
            ]
        return [t for t in self._tools if t.skill is not None]

    async def call(
        self, name: str, arguments: dict[str, Any], on_progress: ProgressFn | None = None
    ) -> ToolCallOutcome:
        """Call a tool. A tool failure is an outcome with `is_error`, not an exception."""
        started = time.perf_counter()
        result = await self.session.call_tool(name, arguments, progress_callback=on_progress)
        text = "\n".join(block.text for block in result.content if isinstance(block, types.TextContent))
        structured = result.structured_content
        if structured is not None and (not text or _same_document(text, structured)):
            # the server's text is the same document indented: the model reads it compact (fewer tokens)
            text = json.dumps(structured, ensure_ascii=False, separators=(",", ":"))
        return ToolCallOutcome(
            name=name,
            arguments=arguments,
            is_error=bool(result.is_error),
            text=text,
            structured=structured,
            seconds=round(time.perf_counter() - started, 3),
            users_error=bool(result.is_error and _users_error(result.meta)),
        )

    async def call_as_job(
        self, name: str, arguments: dict[str, Any], on_progress: ProgressFn | None = None, poll_seconds: float = 5.0
    ) -> ToolCallOutcome:
        """Call a tool through start_job / job_status: no request lasts longer than `poll_seconds`
        (plus the answer's way back), for sessions with a short `read_timeout_seconds`.

        A poll that times out is asked again (up to POLL_TIMEOUT_RETRIES times in a row): the job
        goes on meanwhile. The job is cancelled only when this coroutine is cancelled; any other
        error is raised with the job left running (job_status / cancel_job still reach it)."""
        started = time.perf_counter()
        job = await self.call("start_job", {"tool": name, "arguments": arguments}, on_progress)
        if job.is_error:
            return job.model_copy(update={"name": name, "arguments": arguments})
        status = job.structured
        try:
            timeouts = 0
            while status["state"] == "running":
                try:
                    polled = await self.call(
                        "job_status", {"job_id": status["job_id"], "wait_seconds": poll_seconds}, on_progress
                    )
                except MCPError as err:
                    if err.code == types.CONNECTION_CLOSED:
                        await self._cancel_job(status["job_id"])  # over HTTP the server may outlive the link
                    if err.code != types.REQUEST_TIMEOUT or timeouts >= POLL_TIMEOUT_RETRIES:
                        raise
                    timeouts += 1
                    continue
                timeouts = 0
                if polled.is_error:
                    return polled.model_copy(update={"name": name, "arguments": arguments})
                status = polled.structured
        except anyio.get_cancelled_exc_class():
            await self._cancel_job(status["job_id"])
            raise
        except (KeyboardInterrupt, SystemExit):
            await self._cancel_job(status["job_id"])
            raise
        failed = status["state"] != "succeeded"
        structured = status["result"]
        return ToolCallOutcome(
            name=name,
            arguments=arguments,
            is_error=failed,
            text=(status["error"] or status["state"]) if failed else json.dumps(structured),
            structured=None if failed else structured,
            seconds=round(time.perf_counter() - started, 3),
        )

    async def _cancel_job(self, job_id: str) -> None:
        """Best effort: tell the server to stop the job (the connection may already be gone)."""
        with anyio.CancelScope(shield=True), anyio.move_on_after(10), contextlib.suppress(Exception):
            await self.session.call_tool("cancel_job", {"job_id": job_id, "wait_seconds": 0})

    async def list_resources(self) -> list[ResourceSpec]:
        listed = await self.session.list_resources()
        return [ResourceSpec(uri=str(r.uri), name=r.name, mime_type=r.mime_type) for r in listed.resources]

    async def read_text(self, uri: str) -> str:
        result = await self.session.read_resource(uri)
        parts = [c.text for c in result.contents if isinstance(c, types.TextResourceContents)]
        if not parts:
            raise OmskillsError(f"resource {uri} has no text content")
        return "\n".join(parts)


def server_parameters(
    workspace: Path, skills_dir: Path | None = None, env: dict[str, str] | None = None
) -> StdioServerParameters:
    """How to start `omskills serve` with this interpreter (works without the console script)."""
    # `-c` rather than `-m omskills.orchestrator.cli`: run as __main__, cli.py would be a second
    # module instance whose command table the subcommand modules never register into.
    args = ["-c", _SERVE_ENTRY, "serve", "--workspace", str(workspace)]
    if skills_dir is not None:
        args += ["--skills-dir", str(skills_dir)]
    # The SDK passes only a few safe variables by default; the tools need the rest
    # (PATH, LD_LIBRARY_PATH and ASCEND_* for CANN, OMSKILLS_*, thread counts).
    inherited = {k: v for k, v in os.environ.items() if not k.startswith(_WITHHELD_ENV_PREFIXES)}
    # The server's own log stays quiet unless asked: the orchestrator reports every outcome itself.
    inherited.setdefault("OMSKILLS_LOG_LEVEL", "WARNING")
    # The server ends with us (parent-death signal, parent pid watch); with our pid it also knows
    # whether we died before it started watching.
    inherited["OMSKILLS_PARENT_PID"] = str(os.getpid())
    return StdioServerParameters(command=sys.executable, args=args, env=inherited | (env or {}), cwd=str(workspace))


async def _initialized(session: ClientSession, server: str) -> OmskillsClient:
    try:
        await session.initialize()
    except MCPError as err:
        raise OmskillsError(
            f"the MCP server ({server}) did not start: {err.error.message} (its stderr says why)"
        ) from None
    return OmskillsClient(session)


def _only_omskills_error(group: BaseExceptionGroup) -> OmskillsError | None:
    """The single OmskillsError inside nested task-group errors, if that is all there is."""
    leaves = []
    stack: list[BaseException] = [group]
    while stack:
        err = stack.pop()
        if isinstance(err, BaseExceptionGroup):
            stack.extend(err.exceptions)
        else:
            leaves.append(err)
    return leaves[0] if len(leaves) == 1 and isinstance(leaves[0], OmskillsError) else None


@contextlib.asynccontextmanager
async def connect(
    workspace: str | Path,
    skills_dir: str | Path | None = None,
    *,
    env: dict[str, str] | None = None,
    errlog: TextIO = sys.stderr,
    read_timeout_seconds: float | None = None,
) -> AsyncIterator[OmskillsClient]:
    """Start `omskills serve --workspace WORKSPACE` as a child process and connect over stdio.

    `read_timeout_seconds`: give up on any request after this long (and tell the server to
    cancel it), as clients with short timeouts do; None (the default) waits as long as a tool runs.
    """
    params = server_parameters(Path(workspace).resolve(), Path(skills_dir).resolve() if skills_dir else None, env)
    try:
        async with stdio_client(params, errlog=errlog) as (read, write):
            async with ClientSession(read, write, read_timeout_seconds=read_timeout_seconds) as session:
                yield await _initialized(session, "omskills serve")
    except BaseExceptionGroup as group:
        if (err := _only_omskills_error(group)) is not None:
            raise err from None
        raise


@contextlib.asynccontextmanager
async def connect_http(url: str) -> AsyncIterator[OmskillsClient]:
    """Connect to a running `omskills serve --http HOST:PORT` (url like http://127.0.0.1:8765/mcp)."""
    try:
        async with streamable_http_client(url) as (read, write):
            async with ClientSession(read, write) as session:
                yield await _initialized(session, url)
    except BaseExceptionGroup as group:
        if (err := _only_omskills_error(group)) is not None:
            raise err from None
        raise


def _users_error(meta: dict[str, Any] | None) -> bool:
    """Whether a failed call's `_meta` says the error is the user's to act on."""
    from omskills.host.mcp_server import USERS_ERROR_META  # the server's word for it (imported when needed)

    return bool((meta or {}).get(USERS_ERROR_META))


def _same_document(text: str, structured: Any) -> bool:
    try:
        return json.loads(text) == structured
    except ValueError:
        return False
