"""Run a deterministic plan — a list of tool calls — through the MCP server.

`omskills adapt --agent plan` builds the steps; this runs them over the same MCP path
the Claude agent uses, shows progress on stderr, and stops at the first error with its
message. Nothing here knows what the tools do.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from mcp.shared.exceptions import MCPError
from omskills.progress import is_heartbeat, without_elapsed
from pydantic import BaseModel, Field
from tqdm import tqdm

from .mcp_client import OmskillsClient, ProgressFn, ToolCallOutcome, connect


class PlanStep(BaseModel):
    """One tool call of the plan."""

    tool: str
    args: dict[str, Any] = Field(default_factory=dict)
    # The task-record step this call produces ("main_path", "export:vision_backbone", ...).
    stage: str
    # What a person reads in the progress output.
    label: str


class StepOutcome(BaseModel):
    step: PlanStep
    outcome: ToolCallOutcome

    @property
    def ok(self) -> bool:
        return not self.outcome.is_error


class PlanResult(BaseModel):
    ok: bool
    completed: list[StepOutcome] = Field(default_factory=list)
    # The step that failed and the tool's message, when one did; later steps did not run.
    failed: StepOutcome | None = None
    skipped: list[PlanStep] = Field(default_factory=list)

    @property
    def error(self) -> str | None:
        return self.failed.outcome.text if self.failed else None


class ToolCallDisplay:
    """A start line, the tool's progress, an end line (on stderr).

    The server's progress value is elapsed seconds and its message the current phase, with
    heartbeats ("<tool>: running for N s; last: ...") in between (both worded by
    `omskills.progress`). On a terminal one status line shows the elapsed time and the phase; in a
    log file each new phase is a line of its own, its elapsed time shown once (heartbeats are left
    out: they repeat the phase). The status line is cleared when the call ends, however it ends:
    `close()` in a `finally` (a bar left to the garbage collector clears whatever line the
    terminal is on by then, such as the chat's next `you>` prompt).
    """

    def __init__(self, prefix: str, tool: str, stream: TextIO) -> None:
        self.prefix = prefix
        self.stream = stream
        self.bar: tqdm | None = None
        self.last_phase: str | None = None
        self.on_terminal = bool(getattr(stream, "isatty", lambda: False)())
        print(f"{self.prefix}: {tool} ...", file=stream, flush=True)

    async def on_progress(self, done: float, total: float | None, message: str | None) -> None:
        phase = without_elapsed(message) if message else None
        if not self.on_terminal:
            if phase and phase != self.last_phase and not is_heartbeat(phase):
                self.last_phase = phase
                print(f"{self.prefix}: [{done:6.1f} s] {phase}", file=self.stream, flush=True)
            return
        if self.bar is None:
            self.bar = tqdm(
                total=total,
                desc=self.prefix,
                file=self.stream,
                leave=False,
                dynamic_ncols=True,
                bar_format=_status_format(total, ""),
            )
        if total is not None:
            self.bar.total = total
            self.bar.n = done
        if phase and not is_heartbeat(phase):
            self.bar.bar_format = _status_format(self.bar.total, self._shown(phase))
        self.bar.refresh()

    def _shown(self, phase: str) -> str:
        """The phase without the tool's name when the prefix already ends with it ("[turn 3] export_onnx")."""
        tool, sep, rest = phase.partition(": ")
        return rest if sep and self.prefix.endswith(f" {tool}") else phase

    def close(self) -> None:
        """Clear the status line (idempotent)."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def finish(self, outcome: ToolCallOutcome) -> None:
        self.close()
        failed = failed_graphs(outcome)
        skipped = outcome.structured.get("skipped") if isinstance(outcome.structured, dict) else None
        status = "FAILED" if outcome.is_error else (f"ok, {len(failed)} graph(s) FAILED" if failed else "ok")
        if skipped and not outcome.is_error:
            status += f" ({len(skipped)} graph(s) skipped: an earlier step of theirs failed)"
        line = f"{self.prefix}: {status} in {outcome.seconds:.1f}s"
        if outcome.is_error:
            line += f" — {outcome.text}"
        print(line, file=self.stream, flush=True)
        for graph, error in failed:
            print(f"{self.prefix}:   {graph} failed: {error}", file=self.stream, flush=True)


def _status_format(total: float | None, phase: str) -> str:
    """The status line's tqdm format: the phase is written into it, as tqdm's postfix would start it with ", "."""
    head = "{desc}: {elapsed}" if total is None else "{l_bar}{bar}| {elapsed}"
    return f"{head} {phase.replace('{', '{{').replace('}', '}}')}".rstrip()


def failed_graphs(outcome: ToolCallOutcome) -> list[tuple[str, str]]:
    """The graphs a per-graph step reports as failed (its `failed` list), while the others went on."""
    structured = outcome.structured if isinstance(outcome.structured, dict) else {}
    failed = structured.get("failed")
    return (
        [(str(f.get("candidate")), str(f.get("error"))) for f in failed if isinstance(f, dict)]
        if isinstance(failed, list)
        else []
    )


async def _run_steps(steps: Sequence[PlanStep], client: OmskillsClient, stream: TextIO) -> PlanResult:
    result = PlanResult(ok=True)
    for index, step in enumerate(steps, start=1):
        display = ToolCallDisplay(f"[{index}/{len(steps)}] {step.label}", step.tool, stream)
        progress: ProgressFn = display.on_progress
        try:
            outcome = await client.call(step.tool, step.args, on_progress=progress)
        except MCPError as err:
            # The server process is gone (e.g. killed for memory); say so instead of a traceback.
            outcome = ToolCallOutcome(
                name=step.tool,
                arguments=step.args,
                is_error=True,
                seconds=0.0,
                structured=None,
                text=f"the tool server stopped during {step.tool} ({err}); it may have been "
                "killed (out of memory?). The task record keeps what finished: rerun to resume.",
            )
        finally:
            display.close()  # an interrupt too: the status line must not outlive the call
        display.finish(outcome)
        done = StepOutcome(step=step, outcome=outcome)
        if outcome.is_error:
            result.ok = False
            result.failed = done
            result.skipped = list(steps[index:])
            return result
        result.completed.append(done)
    return result


async def run_plan(
    steps: Sequence[PlanStep],
    client: OmskillsClient | None = None,
    *,
    workspace: str | Path | None = None,
    skills_dir: str | Path | None = None,
    stream: TextIO = sys.stderr,
) -> PlanResult:
    """Run `steps` in order through MCP; stop at the first error.

    With `client` the steps go through that session; without, a server is started for
    `workspace` (default: cwd) for the duration of the plan.
    """
    if client is not None:
        return await _run_steps(steps, client, stream)
    async with connect(Path(workspace or Path.cwd()), skills_dir) as started:
        return await _run_steps(steps, started, stream)
