"""The Claude tool-use loop: the agent reads the skills and drives the tools through MCP.

The system prompt is om-deployer's SKILL.md (the entry skill); the sub-skills'
SKILL.md and references are read on demand through the local `load_skill` tool
(progressive disclosure), served from the MCP server's `skill://` resources. Every MCP
tool becomes an Anthropic tool definition. The loop is bounded by a turn limit and a
total token budget; the transcript (messages and every tool call with its arguments,
result, error flag and duration) is saved as JSON in the run folder after every turn,
and the agent's decisions and final summary go into the task record.

`ANTHROPIC_API_KEY` (or `ANTHROPIC_AUTH_TOKEN`) and `ANTHROPIC_BASE_URL` are read by the
Anthropic SDK as usual; the model is `--model`, else `$OMSKILLS_MODEL`, else DEFAULT_MODEL.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import anthropic
import anyio
import anyio.to_thread
from anthropic import AsyncAnthropic
from omskills.errors import OmskillsError
from omskills.records.stages import Artifact, StageResult
from omskills.records.task import TaskRecord, now_iso, updating
from pydantic import BaseModel, Field

from .mcp_client import OmskillsClient, ResourceSpec, ToolSpec, connect
from .plan_runner import ToolCallDisplay

DEFAULT_MODEL = "claude-opus-5"
ENTRY_SKILL = "om-deployer"
LOAD_SKILL = "load_skill"
RECORD_DECISION = "record_decision"
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
    # Longer tool results are cut before they reach the model (the transcript keeps them whole).
    max_tool_result_chars: int = Field(30_000, ge=1_000)


def agent_settings(model: str | None = None, max_turns: int | None = None, max_tokens: int | None = None) -> AgentSettings:
    """Settings from the command line, then the environment, then the defaults."""
    values: dict[str, Any] = {"model": model or os.environ.get("OMSKILLS_MODEL") or DEFAULT_MODEL}
    if max_turns is not None:
        values["max_turns"] = max_turns
    if max_tokens is not None:
        values["max_tokens"] = max_tokens
    return AgentSettings(**values)


class TokenUsage(BaseModel):
    input_tokens: int = 0
    output_tokens: int = 0

    @property
    def total(self) -> int:
        return self.input_tokens + self.output_tokens


class ToolCallRecord(BaseModel):
    turn: int
    tool_use_id: str
    name: str
    arguments: dict[str, Any]
    is_error: bool
    result: str
    seconds: float
    # Handled in the orchestrator (load_skill, record_decision), not through MCP.
    local: bool = False


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
    # Why the last exchange ended: the API's stop_reason, or max_turns / token_budget.
    stop: str | None = None


class AgentResult(BaseModel):
    stop: str
    final_text: str
    turns: int
    tool_calls: list[ToolCallRecord]
    usage: TokenUsage
    transcript_path: Path


def require_api_key() -> None:
    if not (os.environ.get("ANTHROPIC_API_KEY") or os.environ.get("ANTHROPIC_AUTH_TOKEN")):
        raise OmskillsError("ANTHROPIC_API_KEY is not set: export it (and ANTHROPIC_BASE_URL for a proxy), or use `--agent plan`")


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
    others = [f"- {name}: {_frontmatter_description(text)}" for name, text in sorted(library.documents.items()) if name != ENTRY_SKILL]
    entry = library.documents.get(ENTRY_SKILL)
    task_line = f"The task record is {task}; pass this path as `task` to every tool that takes one." if task else "No task record is open yet; ask for one or create it with the tools if the user wants to adapt a model."
    parts = [
        "You are the omskills agent. You adapt PyTorch models (a model family with a driver, or the user's own code through a new driver) to Huawei Ascend NPUs along the "
        "OM route by calling the omskills tools, which read and update a task record (YAML) at every stage.",
        task_line,
        f"Workspace root: {workspace}. Every path you pass must be inside it.",
        "How to work:\n"
        f"- Follow the {ENTRY_SKILL} workflow below, in its order, respecting its gates.\n"
        f"- Before using another skill's tools, call `{LOAD_SKILL}` to read its SKILL.md; read a reference file only when you need its detail.\n"
        "- When a tool returns an error, read the message and change what it names; do not repeat an identical call.\n"
        "- This machine may have no Ascend NPU, CANN or atc: never claim an OM was built or run unless a tool result says so.\n"
        f"- Record each important choice with `{RECORD_DECISION}` (what, and why with the evidence).\n"
        "- End with a short summary: what ran, what was decided and why, what is left.",
    ]
    if others:
        parts.append("Other skills (load with `load_skill`):\n" + "\n".join(others))
    if entry:
        parts.append(f"<skill name=\"{ENTRY_SKILL}\">\n{entry}\n</skill>")
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
            "description": f"Read a skill's SKILL.md (its workflow and which tools to call), or one of its reference files. References: {refs}.",
            "input_schema": {
                "type": "object",
                "properties": {
                    "skill": {"type": "string", "enum": skills, "description": "skill name"},
                    "reference": {"type": "string", "description": "a file name under the skill's references/ (omit for SKILL.md)"},
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
    return tools


# --------------------------------------------------------------------------- the loop


class _ToolAnswer(BaseModel):
    text: str
    is_error: bool


TextSink = Callable[[str], None]


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
        self.llm = llm
        self.settings = settings
        self.library = library
        self.task = task
        self.on_text = on_text
        self.progress_stream = progress_stream
        self.mcp_tools = {spec.name: spec for spec in tool_specs}
        self.tool_defs = [anthropic_tool(spec) for spec in tool_specs] + local_tools(library, task is not None)
        clash = {LOAD_SKILL, RECORD_DECISION} & set(self.mcp_tools)
        if clash:
            raise OmskillsError(f"an MCP tool is named like an orchestrator tool: {sorted(clash)}")
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
        progress_stream: TextIO = sys.stderr,
    ) -> AgentSession:
        library = await SkillLibrary.load(client)
        specs = await client.list_tools()
        return cls(client, llm, settings, library, specs, task, workspace, run_dir, on_text, progress_stream)

    # ---- persistence

    def save(self) -> Path:
        self.transcript_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.transcript_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.transcript.model_dump(mode="json"), indent=2, ensure_ascii=False))
        tmp.replace(self.transcript_path)
        return self.transcript_path

    # ---- one user message, answered to the end (or to a limit)

    def _append_user_text(self, text: str) -> None:
        messages = self.transcript.messages
        if messages and messages[-1]["role"] == "user" and isinstance(messages[-1]["content"], list):
            # The last exchange stopped after tool results: keep user/assistant alternation.
            messages[-1]["content"].append({"type": "text", "text": text})
        else:
            messages.append({"role": "user", "content": text})

    async def send(self, text: str) -> AgentResult:
        self._append_user_text(text)
        turns = 0
        final_text = ""
        stop = "end_turn"
        try:
            while True:
                remaining = self.settings.max_tokens - self.transcript.usage.total
                if turns >= self.settings.max_turns:
                    stop = "max_turns"
                    break
                if remaining <= 0:
                    stop = "token_budget"
                    break
                response = await self._ask(min(self.settings.max_output_tokens, remaining))
                turns += 1
                self.transcript.turns += 1
                blocks = [block.model_dump(mode="json", exclude_none=True) for block in response.content]
                self.transcript.messages.append({"role": "assistant", "content": blocks})
                said = "\n".join(b["text"] for b in blocks if b.get("type") == "text").strip()
                if said:
                    final_text = said
                    self.on_text(said)
                uses = [b for b in blocks if b.get("type") == "tool_use"]
                if response.stop_reason == "pause_turn":
                    continue
                if response.stop_reason != "tool_use" or not uses:
                    stop = response.stop_reason or "end_turn"
                    break
                results = [await self._answer(use, self.transcript.turns) for use in uses]
                self.transcript.messages.append({"role": "user", "content": results})
                self.save()
        finally:
            self.transcript.stop = stop
            self.transcript.finished = now_iso()
            self.save()
        return AgentResult(
            stop=stop,
            final_text=final_text,
            turns=turns,
            tool_calls=list(self.transcript.tool_calls),
            usage=self.transcript.usage.model_copy(),
            transcript_path=self.transcript_path,
        )

    async def _ask(self, max_tokens: int) -> anthropic.types.Message:
        try:
            response = await self.llm.messages.create(
                model=self.settings.model,
                max_tokens=max_tokens,
                system=self.transcript.system,
                messages=self.transcript.messages,  # type: ignore[arg-type]
                tools=self.tool_defs,  # type: ignore[arg-type]
            )
        except anthropic.APIStatusError as err:
            raise OmskillsError(f"Anthropic API error {err.status_code} for model {self.settings.model!r}: {err.message}") from None
        except anthropic.APIConnectionError as err:
            raise OmskillsError(f"cannot reach the Anthropic API ({err}); check ANTHROPIC_BASE_URL and the network") from None
        self.transcript.usage.input_tokens += response.usage.input_tokens
        self.transcript.usage.output_tokens += response.usage.output_tokens
        return response

    async def _answer(self, use: dict[str, Any], turn: int) -> dict[str, Any]:
        name, arguments = use["name"], dict(use.get("input") or {})
        started = time.perf_counter()
        local = name in {LOAD_SKILL, RECORD_DECISION}
        if local:
            answer = await self._local_tool(name, arguments)
        elif name in self.mcp_tools:
            display = ToolCallDisplay(f"[turn {turn}] {name}", json.dumps(arguments, ensure_ascii=False)[:200], self.progress_stream)
            outcome = await self.client.call(name, arguments, on_progress=display.on_progress)
            display.finish(outcome)
            answer = _ToolAnswer(text=outcome.text, is_error=outcome.is_error)
        else:
            answer = _ToolAnswer(text=f"unknown tool {name!r}; available: {', '.join(t['name'] for t in self.tool_defs)}", is_error=True)
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
        text = answer.text
        limit = self.settings.max_tool_result_chars
        if len(text) > limit:
            text = text[:limit] + f"\n[... {len(text) - limit} more characters cut; the transcript has the whole result]"
        return {"type": "tool_result", "tool_use_id": use["id"], "content": text, "is_error": answer.is_error}

    async def _local_tool(self, name: str, arguments: dict[str, Any]) -> _ToolAnswer:
        if name == LOAD_SKILL:
            skill = str(arguments.get("skill", ""))
            if skill not in self.library.documents:
                return _ToolAnswer(text=f"no skill {skill!r}; skills: {', '.join(sorted(self.library.documents))}", is_error=True)
            reference = arguments.get("reference")
            if not reference:
                return _ToolAnswer(text=self.library.documents[skill], is_error=False)
            known = self.library.references.get(skill, [])
            if reference not in known:
                return _ToolAnswer(text=f"skill {skill!r} has no reference {reference!r}; it has: {', '.join(known) or 'none'}", is_error=True)
            return _ToolAnswer(text=await self.client.read_text(f"skill://{skill}/references/{reference}"), is_error=False)
        # record_decision
        what, why = str(arguments.get("what", "")).strip(), str(arguments.get("why", "")).strip()
        if not what or not why:
            return _ToolAnswer(text="record_decision needs both `what` and `why`", is_error=True)
        assert self.task is not None
        with updating(self.task) as record:
            record.decide(by="agent", what=what, why=why)
        return _ToolAnswer(text="recorded", is_error=False)


# --------------------------------------------------------------------------- entry points


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
    with updating(task) as record:
        record.decide(
            by="agent",
            what=f"agent run with {settings.model} ended ({result.stop}) after {result.turns} turn(s) and {len(result.tool_calls)} tool call(s)",
            why=result.final_text or "(the agent gave no summary)",
        )
        record.stages[AGENT_STAGE] = StageResult(
            status="done" if result.stop == "end_turn" else "failed",
            started=started,
            finished=now_iso(),
            seconds=round(seconds, 3),
            artifacts=[Artifact(path=str(result.transcript_path))],
            error=None if result.stop == "end_turn" else f"stopped: {result.stop}",
            note=f"tokens in/out {result.usage.input_tokens}/{result.usage.output_tokens}",
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
    return AsyncAnthropic()


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
) -> AgentResult:
    """Let Claude work on `goal` (default: adapt the task's model) until it ends its turn or hits a limit.

    Without `client` an `omskills serve` is started for `workspace`; without `llm` an
    AsyncAnthropic client is made from the environment (OmskillsError without a key).
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
        session = await AgentSession.open(mcp, llm, settings, task, root, folder, sink)
        return await session.send(goal)

    if client is not None:
        result = await with_client(client)
    else:
        async with connect(root, skills_dir) as mcp:
            result = await with_client(mcp)
    if task is not None:
        file_run_in_record(task, result, settings, started, time.perf_counter() - clock)
    return result


async def _read_line(stream: TextIO) -> str | None:
    line = await anyio.to_thread.run_sync(stream.readline)
    return None if line == "" else line.strip()


async def chat(
    task_path: str | Path | None,
    *,
    workspace: str | Path | None = None,
    settings: AgentSettings | None = None,
    skills_dir: str | Path | None = None,
    llm: AsyncAnthropic | None = None,
    stdin: TextIO = sys.stdin,
    stdout: TextIO = sys.stdout,
) -> Path:
    """An interactive conversation over the same loop; returns the transcript path."""
    settings = settings or agent_settings()
    task = Path(task_path).resolve() if task_path else None
    llm = _make_llm(llm)
    root = Path(workspace).resolve() if workspace else default_workspace(task)
    folder = new_run_dir(task, root, "chat")

    def show(text: str) -> None:
        print(f"\nclaude> {text}\n", file=stdout, flush=True)

    async with connect(root, skills_dir) as mcp:
        session = await AgentSession.open(mcp, llm, settings, task, root, folder, show)
        print(f"omskills chat ({settings.model}, {len(session.mcp_tools)} tools); `exit` to quit", file=stdout, flush=True)
        last: AgentResult | None = None
        while True:
            print("you> ", end="", file=stdout, flush=True)
            line = await _read_line(stdin)
            if line is None or line.lower() in {"exit", "quit"}:
                break
            if not line:
                continue
            started, clock = now_iso(), time.perf_counter()
            last = await session.send(line)
            if last.stop != "end_turn":
                print(f"(stopped: {last.stop})", file=stdout, flush=True)
            if task is not None:
                file_run_in_record(task, last, settings, started, time.perf_counter() - clock)
        return session.save()
