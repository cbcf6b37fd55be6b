"""The Claude tool-use loop: the agent reads the skills and drives the tools through MCP.

The system prompt is om-deployer's SKILL.md (the entry skill); the sub-skills'
SKILL.md and references are read on demand through the local `load_skill` tool
(progressive disclosure), served from the MCP server's `skill://` resources. Every MCP
tool becomes an Anthropic tool definition. The loop is bounded by a turn limit and a
total token budget; the transcript (messages and every tool call with its arguments,
result, error flag and duration) is saved as JSON in the run folder after every turn,
and the agent's decisions and final summary go into the task record.

It survives what the API does in a long run: 429/529/5xx and lost connections are retried
with backoff (messages_api.py), any other error stops the run with a stop reason naming it
(`api_error_400`) and the error in the transcript and the record; a reply cut by
`max_tokens` is continued, and a tool call it cut is not run; the system prompt, the tools
and the conversation so far are prompt-cached; a tool result too long for one message
reaches the model as a valid-JSON outline it can page through (tool_results.py).

`ANTHROPIC_API_KEY` (or `ANTHROPIC_AUTH_TOKEN`) and `ANTHROPIC_BASE_URL` are read by the
Anthropic SDK as usual; the model is `--model`, else `$OMSKILLS_MODEL`, else DEFAULT_MODEL.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as _dt
import json
import os
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, Literal, TextIO

import anthropic
import anyio
import anyio.to_thread
from anthropic import AsyncAnthropic
from mcp.shared.exceptions import MCPError
from omskills.errors import OmskillsError, one_line
from omskills.files import atomic_write_text
from omskills.records.stages import Artifact, StageResult
from omskills.records.task import TaskRecord, now_iso, updating
from omskills.run_folder import RunFolder
from pydantic import BaseModel, Field

from .mcp_client import OmskillsClient, ResourceSpec, ToolCallOutcome, ToolSpec, connect
from .messages_api import ApiFailure, RetryNotice, RetryPolicy, cached_request, create_message
from .plan_runner import ToolCallDisplay
from .tool_results import PAGER_TOOL, ResultPager, pager_tool_definition

DEFAULT_MODEL = "claude-opus-5"
ENTRY_SKILL = "om-deployer"
LOAD_SKILL = "load_skill"
RECORD_DECISION = "record_decision"
# Tools the orchestrator answers itself, not through MCP.
LOCAL_TOOLS = (LOAD_SKILL, RECORD_DECISION, PAGER_TOOL)
# The task-record step under which an agent run files its transcript.
AGENT_STAGE = "agent"


class AgentSettings(BaseModel):
    model: str = DEFAULT_MODEL
    # One turn = one Messages API call.
    max_turns: int = Field(40, ge=1)
    # Total budget over the run: input + output tokens as the API reports them.
    max_tokens: int = Field(500_000, ge=1)
    # Cap on one response's output tokens.
    max_output_tokens: int = Field(8_192, ge=1)
    # A longer tool result reaches the model as an outline it pages through (the transcript keeps it whole).
    max_tool_result_chars: int = Field(30_000, ge=1_000)
    # Retries of a request the API answered 408/429/5xx or that lost its connection.
    api_retry: RetryPolicy = Field(default_factory=RetryPolicy)
    # Replies cut by the output cap that are continued in a row before the run stops (`max_tokens`).
    max_continuations: int = Field(3, ge=0)


def agent_settings(
    model: str | None = None,
    max_turns: int | None = None,
    max_tokens: int | None = None,
    retry_seconds: float | None = None,
) -> AgentSettings:
    """Settings from the command line, then the environment, then the defaults."""
    values: dict[str, Any] = {"model": model or os.environ.get("OMSKILLS_MODEL") or DEFAULT_MODEL}
    if max_turns is not None:
        values["max_turns"] = max_turns
    if max_tokens is not None:
        values["max_tokens"] = max_tokens
    retry = retry_seconds if retry_seconds is not None else os.environ.get("OMSKILLS_API_RETRY_SECONDS")
    if retry is not None:
        try:
            values["api_retry"] = RetryPolicy(total_seconds=float(retry))
        except ValueError:
            raise OmskillsError(
                "API retry time (--retry-seconds / OMSKILLS_API_RETRY_SECONDS): "
                f"{retry!r} is not a number of seconds >= 0"
            ) from None
    return AgentSettings(**values)


class TokenUsage(BaseModel):
    # Input tokens after the last cache breakpoint (neither read from nor written to the cache).
    input_tokens: int = 0
    output_tokens: int = 0
    # Input tokens read from the prompt cache (billed at a tenth) and written to it.
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0

    @property
    def total(self) -> int:
        """Every token the model read or wrote: what the run's budget counts, cached or not."""
        return self.input_tokens + self.cache_read_input_tokens + self.cache_creation_input_tokens + self.output_tokens

    def add(self, usage: anthropic.types.Usage) -> None:
        self.input_tokens += usage.input_tokens
        self.output_tokens += usage.output_tokens
        self.cache_read_input_tokens += usage.cache_read_input_tokens or 0
        self.cache_creation_input_tokens += usage.cache_creation_input_tokens or 0


class ToolCallRecord(BaseModel):
    turn: int
    tool_use_id: str
    name: str
    arguments: dict[str, Any]
    is_error: bool
    result: str
    seconds: float
    # Handled in the orchestrator (load_skill, record_decision, read_tool_result), not through MCP.
    local: bool = False


EventKind = Literal["retry", "api_error", "continued", "cut_tool_call"]


class LoopEvent(BaseModel):
    """Something in the run that is not a message: a retry, an API error, a cut reply."""

    # The API call (1-based over the session) it concerns.
    turn: int
    kind: EventKind
    detail: str


class Transcript(BaseModel):
    model: str
    task: str | None
    workspace: str
    started: str
    finished: str | None = None
    system: str
    tools: list[str]
    messages: list[dict[str, Any]] = Field(default_factory=list)
    tool_calls: list[ToolCallRecord] = Field(default_factory=list)
    turns: int = 0
    usage: TokenUsage = Field(default_factory=TokenUsage)
    # Why the last exchange ended: the API's stop_reason, max_turns / token_budget, or
    # api_error_<status> / api_connection_error when the API failed for good.
    stop: str | None = None
    # The API's error when the last exchange ended on one (the messages then end with the request it refused).
    error: str | None = None
    events: list[LoopEvent] = Field(default_factory=list)


class AgentResult(BaseModel):
    stop: str
    # The API's error when `stop` is api_error_* or api_connection_error.
    error: str | None = None
    final_text: str
    turns: int
    tool_calls: list[ToolCallRecord]
    usage: TokenUsage
    transcript_path: Path


def require_api_key() -> None:
    if not (os.environ.get("ANTHROPIC_API_KEY") or os.environ.get("ANTHROPIC_AUTH_TOKEN")):
        raise OmskillsError(
            "ANTHROPIC_API_KEY is not set: export it (and ANTHROPIC_BASE_URL for a proxy), or use `--agent plan`"
        )


# --------------------------------------------------------------------------- prompt and tools


def _frontmatter_description(text: str) -> str:
    from skills_ref.parser import parse_frontmatter

    try:
        metadata, _ = parse_frontmatter(text)
    except Exception:  # an invalid SKILL.md is `omskills validate`'s to report; here it just has no summary
        return ""
    return str(metadata.get("description", ""))


class SkillLibrary(BaseModel):
    """The SKILL.md files and references the server publishes as `skill://` resources."""

    documents: dict[str, str]  # skill -> SKILL.md text
    references: dict[str, list[str]]  # skill -> reference file names

    @classmethod
    async def load(cls, client: OmskillsClient) -> SkillLibrary:
        resources: list[ResourceSpec] = await client.list_resources()
        documents: dict[str, str] = {}
        references: dict[str, list[str]] = {}
        for res in resources:
            if not res.uri.startswith("skill://"):
                continue
            skill, _, rest = res.uri.removeprefix("skill://").partition("/")
            if rest == "SKILL.md":
                documents[skill] = await client.read_text(res.uri)
            elif rest.startswith("references/"):
                references.setdefault(skill, []).append(rest.removeprefix("references/"))
        return cls(documents=documents, references=references)


def system_prompt(library: SkillLibrary, task: Path | None, workspace: Path) -> str:
    others = [
        f"- {name}: {_frontmatter_description(text)}"
        for name, text in sorted(library.documents.items())
        if name != ENTRY_SKILL
    ]
    entry = library.documents.get(ENTRY_SKILL)
    task_line = (
        f"The task record is {task}; pass this path as `task` to every tool that takes one."
        if task
        else "No task record is open yet; ask for one or create it with the tools if the user wants to adapt a model."
    )
    parts = [
        "You are the omskills agent. You adapt PyTorch models (a model family with a driver, or the user's own code "
        "through a new driver) to Huawei Ascend NPUs along the "
        "OM route by calling the omskills tools, which read and update a task record (YAML) at every stage.",
        task_line,
        f"Workspace root: {workspace}. Every path you pass must be inside it.",
        "How to work:\n"
        f"- Follow the {ENTRY_SKILL} workflow below, in its order, respecting its gates.\n"
        f"- Before using another skill's tools, call `{LOAD_SKILL}` to read its SKILL.md; "
        "read a reference file only when you need its detail.\n"
        "- When a tool returns an error, read the message and change what it names; do not repeat an identical call.\n"
        "- This machine may have no Ascend NPU, CANN or atc: "
        "never claim an OM was built or run unless a tool result says so.\n"
        f"- Record each important choice with `{RECORD_DECISION}` (what, and why with the evidence).\n"
        "- End with a short summary: what ran, what was decided and why, what is left.",
    ]
    if others:
        parts.append("Other skills (load with `load_skill`):\n" + "\n".join(others))
    if entry:
        parts.append(f'<skill name="{ENTRY_SKILL}">\n{entry}\n</skill>')
    else:
        parts.append(f"(The {ENTRY_SKILL} skill has no SKILL.md in this installation; use the tools' descriptions.)")
    return "\n\n".join(parts)


def anthropic_tool(spec: ToolSpec) -> dict[str, Any]:
    return {"name": spec.name, "description": spec.description, "input_schema": spec.input_schema}


def local_tools(library: SkillLibrary, with_task: bool) -> list[dict[str, Any]]:
    skills = sorted(library.documents)
    refs = "; ".join(f"{s}: {', '.join(sorted(r))}" for s, r in sorted(library.references.items())) or "none"
    tools = [
        {
            "name": LOAD_SKILL,
            "description": (
                "Read a skill's SKILL.md (its workflow and which tools to call), or one of its reference files. "
                f"References: {refs}."
            ),
            "input_schema": {
                "type": "object",
                "properties": {
                    "skill": {"type": "string", "enum": skills, "description": "skill name"},
                    "reference": {
                        "type": "string",
                        "description": "a file name under the skill's references/ (omit for SKILL.md)",
                    },
                },
                "required": ["skill"],
            },
        }
    ]
    if with_task:
        tools.append(
            {
                "name": RECORD_DECISION,
                "description": "Write a decision into the task record: what was decided and why, with the evidence.",
                "input_schema": {
                    "type": "object",
                    "properties": {"what": {"type": "string"}, "why": {"type": "string"}},
                    "required": ["what", "why"],
                },
            }
        )
    return [*tools, pager_tool_definition()]


# --------------------------------------------------------------------------- the loop


class _ToolAnswer(BaseModel):
    text: str
    is_error: bool


TextSink = Callable[[str], None]

_CONTINUE = (
    "(omskills: your reply reached the output limit of {limit} tokens and was cut there; continue exactly "
    "where it stopped, without repeating what you already wrote.)"
)
_CALL_CUT = (
    "(omskills: your reply reached the output limit of {limit} tokens inside a call to {names}, so that call "
    "was not run. Make it again with shorter arguments, or split the work into smaller calls.)"
)


class _Exchange(BaseModel):
    """One `send` in progress: its turns, the text to report, why it stopped."""

    turns: int = 0
    final_text: str = ""
    # Set when the loop stops; a `send` that raises is saved as `orchestrator_error` or `interrupted`.
    stop: str = "end_turn"
    error: str | None = None
    # Replies cut by max_tokens in a row, and whether the next reply continues the last one's text.
    continuations: int = 0
    continuing_text: bool = False


def _said(blocks: list[dict[str, Any]]) -> str:
    """The reply's text as written (not stripped: a cut reply's trailing space joins the next part)."""
    return "\n".join(b["text"] for b in blocks if b.get("type") == "text")


class AgentSession:
    """One conversation: the MCP tools, the Anthropic client, the messages so far, the limits."""

    def __init__(
        self,
        client: OmskillsClient,
        llm: AsyncAnthropic,
        settings: AgentSettings,
        library: SkillLibrary,
        tool_specs: list[ToolSpec],
        task: Path | None,
        workspace: Path,
        run_dir: Path,
        on_text: TextSink,
        progress_stream: TextIO,
    ) -> None:
        self.client = client
        # The retry policy is ours (messages_api): SDK retries on top would multiply the waits.
        self.llm = llm.with_options(max_retries=0)
        self.settings = settings
        self.library = library
        self.task = task
        self.on_text = on_text
        self.progress_stream = progress_stream
        self.mcp_tools = {spec.name: spec for spec in tool_specs}
        self.tool_defs = [anthropic_tool(spec) for spec in tool_specs] + local_tools(library, task is not None)
        clash = set(LOCAL_TOOLS) & set(self.mcp_tools)
        if clash:
            raise OmskillsError(f"an MCP tool is named like an orchestrator tool: {sorted(clash)}")
        self.pager = ResultPager(settings.max_tool_result_chars)
        self.transcript_path = run_dir / "transcript.json"
        self.transcript = Transcript(
            model=settings.model,
            task=str(task) if task else None,
            workspace=str(workspace),
            started=now_iso(),
            system=system_prompt(library, task, workspace),
            tools=[t["name"] for t in self.tool_defs],
        )

    @classmethod
    async def open(
        cls,
        client: OmskillsClient,
        llm: AsyncAnthropic,
        settings: AgentSettings,
        task: Path | None,
        workspace: Path,
        run_dir: Path,
        on_text: TextSink,
        progress_stream: TextIO | None = None,
    ) -> AgentSession:
        library = await SkillLibrary.load(client)
        specs = await client.list_tools()
        return cls(
            client, llm, settings, library, specs, task, workspace, run_dir, on_text, progress_stream or sys.stderr
        )

    # ---- persistence and what the human sees

    def save(self) -> Path:
        self.transcript_path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(
            self.transcript_path, json.dumps(self.transcript.model_dump(mode="json"), indent=2, ensure_ascii=False)
        )
        return self.transcript_path

    def _tell(self, line: str) -> None:
        print(line, file=self.progress_stream, flush=True)

    def _event(self, kind: EventKind, detail: str, turn: int) -> None:
        self.transcript.events.append(LoopEvent(turn=turn, kind=kind, detail=detail))

    def _announce_retry(self, notice: RetryNotice) -> None:
        line = notice.line(self.settings.api_retry)
        self._tell(line)
        self._event("retry", line, self.transcript.turns + 1)

    # ---- one user message, answered to the end (or to a limit)

    def _append_user_text(self, text: str) -> None:
        messages = self.transcript.messages
        unanswered = _unanswered_tool_uses(messages)
        if unanswered:  # the last exchange was cancelled while its tools ran: the API needs their results
            messages.append(
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": use_id,
                            "is_error": True,
                            "content": "cancelled by the user (Ctrl-C)",
                        }
                        for use_id in unanswered
                    ],
                }
            )
        if messages and messages[-1]["role"] == "user":
            # The last exchange stopped after tool results or a refused request: keep user/assistant alternation.
            content = messages[-1]["content"]
            blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
            messages[-1]["content"] = [*blocks, {"type": "text", "text": text}]
        else:
            messages.append({"role": "user", "content": text})

    async def send(self, text: str) -> AgentResult:
        self._append_user_text(text)
        exchange = _Exchange()
        try:
            await self._run(exchange)
        except Exception as err:
            exchange.stop, exchange.error = "orchestrator_error", f"{type(err).__name__}: {err}"
            raise
        except BaseException:
            exchange.stop = "interrupted"
            raise
        finally:
            self.transcript.stop = exchange.stop
            self.transcript.error = exchange.error
            self.transcript.finished = now_iso()
            self.save()
        return AgentResult(
            stop=exchange.stop,
            error=exchange.error,
            final_text=exchange.final_text.strip(),
            turns=exchange.turns,
            tool_calls=list(self.transcript.tool_calls),
            usage=self.transcript.usage.model_copy(),
            transcript_path=self.transcript_path,
        )

    def _limit_reached(self, exchange: _Exchange) -> str | None:
        if exchange.turns >= self.settings.max_turns:
            return "max_turns"
        if self.settings.max_tokens - self.transcript.usage.total <= 0:
            return "token_budget"
        return None

    async def _run(self, exchange: _Exchange) -> None:
        while (limit := self._limit_reached(exchange)) is None:
            output_cap = min(self.settings.max_output_tokens, self.settings.max_tokens - self.transcript.usage.total)
            try:
                response = await self._ask(output_cap)
            except ApiFailure as failure:
                exchange.stop, exchange.error = failure.stop, failure.message
                self._event("api_error", failure.message, self.transcript.turns + 1)
                return
            exchange.turns += 1
            self.transcript.turns += 1
            blocks = [block.model_dump(mode="json", exclude_none=True) for block in response.content]
            if response.stop_reason == "max_tokens":
                if not self._continue_cut_reply(blocks, output_cap, exchange):
                    exchange.stop = "max_tokens"
                    return
                self.save()
                continue
            self.transcript.messages.append({"role": "assistant", "content": blocks})
            self._show(_said(blocks), exchange)
            exchange.continuations = 0
            uses = [b for b in blocks if b.get("type") == "tool_use"]
            if response.stop_reason == "pause_turn":
                continue
            if response.stop_reason != "tool_use" or not uses:
                exchange.stop = response.stop_reason or "end_turn"
                return
            results = [await self._answer(use, self.transcript.turns) for use in uses]
            self.transcript.messages.append({"role": "user", "content": results})
            self.save()
        exchange.stop = limit

    def _show(self, said: str, exchange: _Exchange) -> None:
        if not said.strip():
            return
        # The reply after a cut one goes on with its text: the summary is the two together.
        exchange.final_text = exchange.final_text + said if exchange.continuing_text else said
        exchange.continuing_text = False
        self.on_text(said.strip())

    def _continue_cut_reply(self, blocks: list[dict[str, Any]], output_cap: int, exchange: _Exchange) -> bool:
        """Keep what a reply cut by max_tokens said, drop its half-written tool calls, ask for the rest.

        False when the replies were cut too many times in a row: the run stops (`max_tokens`).
        """
        turn = self.transcript.turns
        cut_calls = [b for b in blocks if b.get("type") == "tool_use"]
        kept = [
            b for b in blocks if b.get("type") != "tool_use" and not (b.get("type") == "text" and not b.get("text"))
        ]
        if kept:
            self.transcript.messages.append({"role": "assistant", "content": kept})
        self._show(_said(kept), exchange)
        names = ", ".join(f"`{b.get('name')}`" for b in cut_calls)
        if cut_calls:
            self._event(
                "cut_tool_call", f"reply cut at {output_cap} output tokens inside a call to {names}: not run", turn
            )
            self._tell(f"[turn {turn}] reply cut by the output limit ({output_cap} tokens) inside {names}: not run")
        if exchange.continuations >= self.settings.max_continuations:
            return False
        exchange.continuations += 1
        exchange.continuing_text = not cut_calls
        nudge = _CALL_CUT.format(limit=output_cap, names=names) if cut_calls else _CONTINUE.format(limit=output_cap)
        self._append_user_text(nudge)
        self._event(
            "continued", f"continuation {exchange.continuations} of at most {self.settings.max_continuations}", turn
        )
        return True

    async def _ask(self, max_tokens: int) -> anthropic.types.Message:
        request = cached_request(self.transcript.system, self.tool_defs, self.transcript.messages)
        response = await create_message(
            self.llm,
            self.settings.api_retry,
            self._announce_retry,
            {"model": self.settings.model, "max_tokens": max_tokens, **request},
        )
        self.transcript.usage.add(response.usage)
        return response

    # ---- tool calls

    async def _answer(self, use: dict[str, Any], turn: int) -> dict[str, Any]:
        name, arguments = use["name"], dict(use.get("input") or {})
        started = time.perf_counter()
        local = name in LOCAL_TOOLS
        if name in self.mcp_tools:
            answer = await self._mcp_tool(name, arguments, turn)
        else:
            if local:
                answer = await self._local_tool(name, arguments)
            else:
                answer = _ToolAnswer(
                    text=f"unknown tool {name!r}; available: {', '.join(t['name'] for t in self.tool_defs)}",
                    is_error=True,
                )
            self._show_call(turn, name, arguments, answer, time.perf_counter() - started)
        self.transcript.tool_calls.append(
            ToolCallRecord(
                turn=turn,
                tool_use_id=use["id"],
                name=name,
                arguments=arguments,
                is_error=answer.is_error,
                result=answer.text,
                seconds=round(time.perf_counter() - started, 3),
                local=local,
            )
        )
        return {
            "type": "tool_result",
            "tool_use_id": use["id"],
            "content": self.pager.fit(use["id"], answer.text),
            "is_error": answer.is_error,
        }

    def _show_call(self, turn: int, name: str, arguments: dict[str, Any], answer: _ToolAnswer, seconds: float) -> None:
        """One line for a call the orchestrator answered itself (MCP calls have ToolCallDisplay)."""
        shown = one_line(json.dumps(arguments, ensure_ascii=False), 200)
        status = f"FAILED — {one_line(answer.text, 300)}" if answer.is_error else f"ok in {seconds:.1f}s"
        self._tell(f"[turn {turn}] {name} {shown}: {status}")

    async def _mcp_tool(self, name: str, arguments: dict[str, Any], turn: int) -> _ToolAnswer:
        display = ToolCallDisplay(
            f"[turn {turn}] {name}", json.dumps(arguments, ensure_ascii=False)[:200], self.progress_stream
        )
        started = time.perf_counter()
        try:
            outcome = await self.client.call(name, arguments, on_progress=display.on_progress)
        except MCPError as err:
            # The server answered with a protocol error or is gone (killed for memory?): the model reads it
            # as a failed call.
            outcome = ToolCallOutcome(
                name=name,
                arguments=arguments,
                is_error=True,
                seconds=round(time.perf_counter() - started, 3),
                text=f"the tool server failed during {name}: {err}",
            )
        finally:
            display.close()  # a cancel (Ctrl-C in chat) too: its status line must not outlive the call
        display.finish(outcome)
        return _ToolAnswer(text=outcome.text, is_error=outcome.is_error)

    async def _local_tool(self, name: str, arguments: dict[str, Any]) -> _ToolAnswer:
        try:
            if name == LOAD_SKILL:
                return await self._load_skill(arguments)
            if name == PAGER_TOOL:
                page = self.pager.read(arguments)
                return _ToolAnswer(text=page.text, is_error=page.is_error)
            return self._record_decision(arguments)
        except (OmskillsError, MCPError) as err:
            return _ToolAnswer(text=f"{name} failed: {err}", is_error=True)

    async def _load_skill(self, arguments: dict[str, Any]) -> _ToolAnswer:
        skill = str(arguments.get("skill", ""))
        if skill not in self.library.documents:
            return _ToolAnswer(
                text=f"no skill {skill!r}; skills: {', '.join(sorted(self.library.documents))}", is_error=True
            )
        reference = arguments.get("reference")
        if not reference:
            return _ToolAnswer(text=self.library.documents[skill], is_error=False)
        known = self.library.references.get(skill, [])
        if reference not in known:
            return _ToolAnswer(
                text=f"skill {skill!r} has no reference {reference!r}; it has: {', '.join(known) or 'none'}",
                is_error=True,
            )
        return _ToolAnswer(text=await self.client.read_text(f"skill://{skill}/references/{reference}"), is_error=False)

    def _record_decision(self, arguments: dict[str, Any]) -> _ToolAnswer:
        if self.task is None:
            return _ToolAnswer(text="record_decision needs a task record, and this session has none", is_error=True)
        what, why = str(arguments.get("what", "")).strip(), str(arguments.get("why", "")).strip()
        if not what or not why:
            return _ToolAnswer(text="record_decision needs both `what` and `why`", is_error=True)
        with updating(self.task) as record:
            record.decide(by="agent", what=what, why=why)
        return _ToolAnswer(text="recorded", is_error=False)


# --------------------------------------------------------------------------- entry points


SERVER_LOG = "server.log"


@contextlib.asynccontextmanager
async def served_with_log(
    workspace: Path, skills_dir: str | Path | None, folder: Path
) -> AsyncIterator[tuple[OmskillsClient, Path]]:
    """`omskills serve` for `workspace`, its stderr appended to `folder`/server.log: the server's own
    messages (warnings, library logs, a tool's prints, which stdio moves off stdout) would otherwise
    land among the progress lines and the chat's prompt. A server that fails to start names the log."""
    folder.mkdir(parents=True, exist_ok=True)
    server_log = folder / SERVER_LOG
    with server_log.open("a", encoding="utf-8") as errlog:
        try:
            async with connect(workspace, skills_dir, errlog=errlog) as mcp:
                yield mcp, server_log
        except OmskillsError as err:
            raise OmskillsError(f"{err} (the server's messages: {server_log})") from None


def default_workspace(task: Path | None) -> Path:
    """cwd, unless the task record lies outside it: then the record's folder."""
    cwd = Path.cwd().resolve()
    if task is not None and not task.resolve().is_relative_to(cwd):
        return task.resolve().parent
    return cwd


def new_run_dir(task: Path | None, workspace: Path, kind: str) -> Path:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    base = TaskRecord.workdir(task) if task is not None else workspace / ".omskills"
    return base / "agent_runs" / f"{stamp}-{kind}"


def file_run_in_record(task: Path, result: AgentResult, settings: AgentSettings, started: str, seconds: float) -> None:
    """The agent's summary as a decision, and the transcript as the agent step's artifact."""
    finished = result.stop == "end_turn"
    why = result.final_text or "(the agent gave no summary)"
    if result.error:
        why = f"the API failed: {result.error}" + (
            f". The agent's last text: {result.final_text}" if result.final_text else ""
        )
    usage = result.usage
    with updating(task) as record:
        record.decide(
            by="agent",
            what=(
                f"agent run with {settings.model} ended ({result.stop}) after {result.turns} turn(s) "
                f"and {len(result.tool_calls)} tool call(s)"
            ),
            why=why,
        )
        record.stages[AGENT_STAGE] = StageResult(
            status="done" if finished else "failed",
            started=started,
            seconds=round(seconds, 3),
            # Relative to the run folder, like every path in the record, so a moved run still finds it.
            artifacts=[Artifact(path=RunFolder.of_record(task).stored(result.transcript_path))],
            error=None if finished else f"stopped: {result.stop}" + (f": {result.error}" if result.error else ""),
            note=(
                f"tokens in/out {usage.input_tokens}/{usage.output_tokens}, "
                f"cache read/written {usage.cache_read_input_tokens}/{usage.cache_creation_input_tokens}"
            ),
        )


def adapt_goal(task: Path) -> str:
    return (
        f"Adapt the model described in the task record {task} to Ascend OM, following the {ENTRY_SKILL} workflow "
        "from the main-path inventory to verification. Resume from what the record shows as done."
    )


def _make_llm(llm: AsyncAnthropic | None) -> AsyncAnthropic:
    if llm is not None:
        return llm
    require_api_key()
    # No SDK retries: messages_api's policy is the only one.
    return AsyncAnthropic(max_retries=0)


async def run_agent(
    task_path: str | Path | None,
    goal: str | None = None,
    *,
    settings: AgentSettings | None = None,
    workspace: str | Path | None = None,
    skills_dir: str | Path | None = None,
    client: OmskillsClient | None = None,
    llm: AsyncAnthropic | None = None,
    run_dir: str | Path | None = None,
    on_text: TextSink | None = None,
    progress_stream: TextIO | None = None,
) -> AgentResult:
    """Let Claude work on `goal` (default: adapt the task's model) until it ends its turn or hits a limit.

    Without `client` an `omskills serve` is started for `workspace`, its messages in the run's
    server.log (named once on `progress_stream`); without `llm` an AsyncAnthropic client is made
    from the environment (OmskillsError without a key). Tool calls, retries and cut replies are
    reported on `progress_stream` (default stderr).
    """
    settings = settings or agent_settings()
    task = Path(task_path).resolve() if task_path else None
    llm = _make_llm(llm)
    root = Path(workspace).resolve() if workspace else default_workspace(task)
    folder = Path(run_dir) if run_dir else new_run_dir(task, root, "adapt")
    goal = goal or (adapt_goal(task) if task else "List the omskills tools and what each skill does.")
    sink = on_text or (lambda text: print(f"agent: {text}", file=sys.stderr, flush=True))
    started, clock = now_iso(), time.perf_counter()

    async def with_client(mcp: OmskillsClient) -> AgentResult:
        session = await AgentSession.open(mcp, llm, settings, task, root, folder, sink, progress_stream)
        return await session.send(goal)

    if client is not None:
        result = await with_client(client)
    else:
        async with served_with_log(root, skills_dir, folder) as (mcp, server_log):
            print(f"the tool server's messages go to {server_log}", file=progress_stream or sys.stderr, flush=True)
            result = await with_client(mcp)
    if task is not None:
        file_run_in_record(task, result, settings, started, time.perf_counter() - clock)
    return result


def _unanswered_tool_uses(messages: list[dict[str, Any]]) -> list[str]:
    """The ids of the last assistant message's tool uses when no tool results follow it."""
    if not messages or messages[-1]["role"] != "assistant" or isinstance(messages[-1]["content"], str):
        return []
    return [block["id"] for block in messages[-1]["content"] if block.get("type") == "tool_use"]


@contextlib.contextmanager
def _on_ctrl_c(handler: Callable[[], None]) -> Iterator[None]:
    """`handler` runs on SIGINT while inside (the terminal's Ctrl-C); elsewhere than the main
    thread (a test's event loop) nothing is installed."""
    loop = asyncio.get_running_loop()
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    loop.add_signal_handler(signal.SIGINT, handler)
    try:
        yield
    finally:
        loop.remove_signal_handler(signal.SIGINT)


def _quit_now(session: AgentSession, stdout: TextIO) -> None:
    session.save()
    print(f"\n(quit; transcript {session.transcript_path})", file=stdout, flush=True)
    os._exit(130)  # the read of the prompt sits in a thread nothing can interrupt; the server ends with us


async def _send_cancellable(session: AgentSession, line: str, stdout: TextIO) -> AgentResult | None:
    """`session.send(line)`, which a first Ctrl-C cancels (the running tool is cancelled on the
    server and its step recorded so) and a second quits; None when it was cancelled."""
    sending = asyncio.ensure_future(session.send(line))
    presses = 0

    def on_ctrl_c() -> None:
        nonlocal presses
        presses += 1
        if presses > 1:
            _quit_now(session, stdout)
        print(
            "\n(cancelling: the running tool stops at its next progress point; Ctrl-C again quits)",
            file=stdout,
            flush=True,
        )
        sending.cancel()

    with _on_ctrl_c(on_ctrl_c):
        try:
            return await sending
        except asyncio.CancelledError:
            if presses and not asyncio.current_task().cancelling():
                return None
            raise


async def _read_line(stream: TextIO) -> str | None:
    line = await anyio.to_thread.run_sync(stream.readline)
    return None if line == "" else line.strip()


def _stopped_line(result: AgentResult) -> str:
    why = f"{result.stop}: {result.error}" if result.error else result.stop
    return f"(stopped: {why}; transcript {result.transcript_path}; type again to go on)"


async def chat(
    task_path: str | Path | None,
    *,
    workspace: str | Path | None = None,
    settings: AgentSettings | None = None,
    skills_dir: str | Path | None = None,
    llm: AsyncAnthropic | None = None,
    stdin: TextIO = sys.stdin,
    stdout: TextIO = sys.stdout,
    progress_stream: TextIO | None = None,
    client: OmskillsClient | None = None,
) -> Path:
    """An interactive conversation over the same loop; returns the transcript path.

    A line whose run stops early (an API error, a limit) says why, files the run in the
    record, and the conversation goes on: the next line continues it. Without `client` an
    `omskills serve` is started for `workspace`.
    """
    settings = settings or agent_settings()
    task = Path(task_path).resolve() if task_path else None
    llm = _make_llm(llm)
    root = Path(workspace).resolve() if workspace else default_workspace(task)
    folder = new_run_dir(task, root, "chat")

    def show(text: str) -> None:
        print(f"\nclaude> {text}\n", file=stdout, flush=True)

    async def converse(mcp: OmskillsClient, server_log: Path | None = None) -> Path:
        session = await AgentSession.open(mcp, llm, settings, task, root, folder, show, progress_stream)
        logged = f"; the server's messages go to {server_log}" if server_log else ""
        print(
            f"omskills chat ({settings.model}, {len(session.mcp_tools)} tools); `exit` to quit, Ctrl-C cancels a "
            f"running tool{logged}",
            file=stdout,
            flush=True,
        )
        while True:
            print("you> ", end="", file=stdout, flush=True)
            with _on_ctrl_c(lambda: _quit_now(session, stdout)):
                line = await _read_line(stdin)
            if line is None or line.lower() in {"exit", "quit"}:
                break
            if not line:
                continue
            started, clock = now_iso(), time.perf_counter()
            try:
                last = await _send_cancellable(session, line, stdout)
                if last is not None and task is not None:
                    file_run_in_record(task, last, settings, started, time.perf_counter() - clock)
            except OmskillsError as err:  # e.g. the task record became unreadable: say so, keep the conversation
                print(f"(error: {err}; type again to go on)", file=stdout, flush=True)
                continue
            if last is None:
                print("(cancelled; type again to go on)", file=stdout, flush=True)
                continue
            if last.stop != "end_turn":
                print(_stopped_line(last), file=stdout, flush=True)
        return session.save()

    if client is not None:
        return await converse(client)
    async with served_with_log(root, skills_dir, folder) as (mcp, server_log):
        return await converse(mcp, server_log)
