"""Prompts for the common jobs, and completions for their arguments.

- `adapt_task` ("Adapt this task record"): the stage order, the tools of each stage, the gates,
  and how to run the long tools without the client cutting them off;
- `why_candidate_failed` ("Why did this candidate fail?"): the candidate's steps and errors as
  the record has them now, and which tools and resources tell more.

The `task` argument completes to the task records in the workspace, `candidate` to the
candidates and graphs named in the chosen record.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import anyio.to_thread
import yaml
from mcp.server.mcpserver import MCPServer
from mcp.shared.exceptions import MCPError
from mcp_types import (
    INVALID_PARAMS,
    Completion,
    CompletionArgument,
    CompletionContext,
    PromptReference,
    ResourceTemplateReference,
)
from omskills.errors import InputError, one_line
from omskills.host import mcp_resources
from omskills.records.task import load_yaml
from pydantic import Field

ADAPT_PROMPT = "adapt_task"
WHY_PROMPT = "why_candidate_failed"
_MAX_COMPLETIONS = 100

TaskArgument = Annotated[
    str, Field(description="Workspace-relative path of the task record (YAML), e.g. runs/my-model-tiny/task.yaml.")
]
CandidateArgument = Annotated[
    str, Field(description="A plan candidate or graph named in the record (the plan lists them).")
]


def _stage_lines(record: Path, candidate: str) -> list[str]:
    """The record's steps about `candidate` ("export:vision_backbone", ...) with status and error."""
    try:
        data = load_yaml(record.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        return [f"(the record could not be read: {type(err).__name__})"]
    stages = data.get("stages") if isinstance(data, dict) else None
    lines = []
    for step, result in (stages or {}).items():
        if not isinstance(result, dict) or candidate not in str(step).split(":", 1)[-1]:
            continue
        line = f"- {step}: {result.get('status', '?')}"
        if result.get("error"):
            line += f" — {str(result['error']).splitlines()[0][:300]}"
        elif result.get("note"):
            line += f" — {str(result['note']).splitlines()[0][:200]}"
        lines.append(line)
    return lines or [f"- no step of the record names {candidate!r} yet"]


def register_prompts(server: MCPServer, workspace: Path) -> None:
    def record_of(task: str) -> Path:
        # An MCPError reaches the client with its message; the SDK hides any other error's behind
        # "Error rendering prompt".
        try:
            return mcp_resources.task_record_path(task, workspace)
        except (InputError, ValueError, OSError) as err:
            raise MCPError(INVALID_PARAMS, f"argument 'task': {one_line(err)}") from None

    @server.prompt(
        name=ADAPT_PROMPT,
        title="Adapt this task record",
        description="Take a task record through every stage to a verified delivery, with the right tool at each step.",
    )
    def adapt_task(task: TaskArgument) -> str:
        rel = record_of(task).relative_to(workspace).as_posix()
        return f"""Adapt the model of the task record `{rel}` to Ascend OM with the omskills tools.

1. Read the resource skill://om-deployer/SKILL.md (workflow and gates) and the record task://{rel}.
2. Call `check_environment` (task="{rel}") and run only the stages its `environment.stages` says can run here.
3. Stage 1: `inventory_entries`, `profile_main_path`, `plan_candidates`.
4. Stage 2, per selected candidate (skill://pipeline-adapter/SKILL.md): `capture_contracts`, `analyze_boundaries`.
5. Stage 3 (skill://onnx-atc-pipeline/SKILL.md): `export_onnx`, `probe_onnx`, `optimize_onnx`, `emulate_precision`,
   `precheck_ops`, `convert_atc` (without CANN it writes the ATC command; never claim an OM was built).
6. Stage 4: `verify_main_path`, then `write_delivery_doc` and `write_bundle`.

Long tools (model runs, exports, ONNX Runtime) take minutes at full scale. If your client cuts requests off
after a minute, run them with `start_job` (tool name and arguments) and poll `job_status` with wait_seconds
until the state is succeeded or failed; `cancel_job` stops one, and a rerun resumes where it stopped.
After each step read the record again: a step's status and error are under `stages`. When a candidate fails,
use the prompt {WHY_PROMPT} or read its logs (run:// resources). Finish by pointing the user to the
delivery note and the verification report of the run (listed as run:// resources)."""

    @server.prompt(
        name=WHY_PROMPT,
        title="Why did this candidate fail?",
        description=(
            "Find why a candidate failed a step (export, probe, optimise, precheck, ATC, verify) and what to change."
        ),
    )
    def why_candidate_failed(task: TaskArgument, candidate: CandidateArgument) -> str:
        record = record_of(task)
        rel = record.relative_to(workspace).as_posix()
        known = mcp_resources.candidate_names(record)
        if known and candidate not in known:
            raise MCPError(
                INVALID_PARAMS, f"argument 'candidate': {candidate!r} is not in the record (known: {', '.join(known)})"
            )
        steps = "\n".join(_stage_lines(record, candidate))
        run = record.parent.relative_to(workspace).as_posix()
        prefix = "" if run == "." else f"{run}/"
        return f"""Find out why the candidate `{candidate}` of the task record `{rel}` failed, and what would fix it.

Its steps in the record now:
{steps}

How to look:
1. Read task://{rel}: `stages` (status and error of each step), `boundaries.{candidate}` (exportable? why not),
   `exports.{candidate}`, `toolchain.{candidate}` (probes, variants, operator precheck, ATC) and `decisions`.
2. Read the step's log: run://{prefix}onnx/{candidate}/{candidate}.onnx.export.log for an export, the ATC log and
   script under the run folder for a conversion (run:// resources).
3. Ask the tools, with task="{rel}" and candidate="{candidate}": `inspect_onnx` (the graph), `probe_onnx` (ONNX Runtime
   vs PyTorch), `precheck_ops` (operators CANN lacks, known precision pitfalls), `emulate_precision` and
   `compare_layers` (where precision is lost), `analyze_boundaries` (what crosses the boundary).
4. Read the references of skill://onnx-atc-pipeline/SKILL.md and skill://pipeline-adapter/SKILL.md \
for the failure's kind.

Answer with the step that failed, the cause in one or two sentences with the evidence (log line, node, tensor), and the
change to make (export option, boundary, precision mode, driver) — or say plainly that the candidate should \
stay in PyTorch."""

    @server.completion()
    async def complete(
        ref: PromptReference | ResourceTemplateReference,
        argument: CompletionArgument,
        context: CompletionContext | None,
    ) -> Completion | None:
        if argument.name in {"task", "path"} and (isinstance(ref, PromptReference) or ref.uri.startswith("task://")):
            values = await anyio.to_thread.run_sync(_complete_task, workspace, argument.value)
        elif argument.name == "candidate" and isinstance(ref, PromptReference):
            task = (context.arguments or {}).get("task") if context else None
            values = await anyio.to_thread.run_sync(_complete_candidate, workspace, task, argument.value)
        else:
            return None
        return Completion(values=values[:_MAX_COMPLETIONS], total=len(values), has_more=len(values) > _MAX_COMPLETIONS)


def _complete_task(workspace: Path, typed: str) -> list[str]:
    records = [p.relative_to(workspace).as_posix() for p in mcp_resources.find_task_records(workspace)]
    return [r for r in records if r.startswith(typed)] or [r for r in records if typed in r]


def _complete_candidate(workspace: Path, task: str | None, typed: str) -> list[str]:
    if not task:
        return []
    try:
        record = mcp_resources.task_record_path(task, workspace)
    except InputError:
        return []
    names = mcp_resources.candidate_names(record)
    return [n for n in names if n.startswith(typed)] or [n for n in names if typed in n]
