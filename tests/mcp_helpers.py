"""Toy skills for the MCP server, agent and skills-admin tests (no SAM, no torch needed).

`write_toy_skill(root)` creates `root/toy-skill/` with tools that cover what a real tool
does: a quick typed call, a long call that reports progress, an anticipated error
(OmskillsError), a crash (RuntimeError), a stage tool that runs its step through the engine's
`running_step` (so an interrupted step shows in the record), a reader whose path argument is
confined only by its `WorkspacePath` marker, and a writer that takes a path and prints on
stdout at both the Python and the file-descriptor level.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import yaml

TOY_SKILL = "toy-skill"

_SKILL_MD = """\
---
name: toy-skill
description: Toy tools for testing the omskills MCP server. Use in tests only.
---

# Toy skill

Call `toy_add` to add, `toy_slow` for a long job with progress, `toy_fail` for an
anticipated error, `toy_crash` for a crash, `toy_stage` to mark a stage done, `toy_write` to write a file,
`toy_read` to measure a file.
"""

_REFERENCE = "# Toy reference\n\nLoaded on demand.\n"

_TOOLS = {
    "toy_add": '''
        """Add two integers."""

        from pydantic import BaseModel

        from omskills.host.toolkit import tool_hints


        class Sum(BaseModel):
            total: int


        @tool_hints(title="Add two integers", read_only=True)
        def toy_add(a: int, b: int = 1) -> Sum:
            """Add a and b.

            Returns the total.
            """
            return Sum(total=a + b)
        ''',
    "toy_slow": '''
        """A long job that reports progress."""

        import time

        from pydantic import BaseModel

        from omskills.host.toolkit import tool_hints
        from omskills.progress import track


        class Slow(BaseModel):
            steps: int


        @tool_hints(title="Sleep with progress", read_only=True, long_running=True)
        def toy_slow(steps: int = 4, pause: float = 0.05) -> Slow:
            """Sleep `steps` times, reporting progress after each step."""
            done = 0
            for _ in track(range(steps), total=steps, desc="toy steps"):
                time.sleep(pause)
                done += 1
            return Slow(steps=done)
        ''',
    "toy_fail": '''
        """A tool that refuses its input the way engine tools do."""

        from pydantic import BaseModel

        from omskills.errors import InputError
        from omskills.host.toolkit import tool_hints


        class Never(BaseModel):
            ok: bool


        @tool_hints(title="Always refuse", read_only=True)
        def toy_fail(name: str) -> Never:
            """Always refuse, naming the argument."""
            raise InputError(f"argument 'name': no model called {name!r}")
        ''',
    "toy_crash": '''
        """A tool with a bug."""

        from pydantic import BaseModel

        from omskills.host.toolkit import tool_hints


        class Never(BaseModel):
            ok: bool


        @tool_hints(title="Crash", read_only=True)
        def toy_crash(x: int) -> Never:
            """Crash with an unexpected exception."""
            raise RuntimeError(f"boom at {x}")
        ''',
    "toy_stage": '''
        """A stage tool: writes its result into the task record, as the real stage tools do."""

        import time
        from pathlib import Path

        from pydantic import BaseModel

        from omskills import progress
        from omskills.host.toolkit import tool_hints
        from omskills.stages.steps import fingerprint, running_step


        class StageDone(BaseModel):
            stage: str


        @tool_hints(title="Mark a stage done", read_only=False, long_running=True)
        def toy_stage(task: str, stage: str = "toy_stage", seconds: float = 0.0) -> StageDone:
            """Work `seconds` (reporting progress, so it can be cancelled) inside the step `stage` of the task
            record `task`, as the real stage tools do: running while it works, then done (or failed)."""
            with running_step(Path(task), stage, fingerprint(stage, seconds)) as step:
                started = time.monotonic()
                while time.monotonic() - started < seconds:
                    progress.report(time.monotonic() - started, seconds, "toy work")
                    time.sleep(0.05)
                step.result.note = "toy"
            return StageDone(stage=stage)
        ''',
    "toy_read": '''
        """A reader whose path argument has no path-like name: only its WorkspacePath marker confines it."""

        from pathlib import Path

        from pydantic import BaseModel

        from omskills.host.toolkit import WorkspacePath, tool_hints


        class Size(BaseModel):
            bytes: int


        @tool_hints(title="Measure a file", read_only=True)
        def toy_read(source: WorkspacePath) -> Size:
            """The size of the file `source`, in bytes."""
            return Size(bytes=Path(source).stat().st_size)
        ''',
    "toy_write": '''
        """Write a text file, printing noise on stdout the way chatty libraries do."""

        import os
        import subprocess
        from pathlib import Path

        from pydantic import BaseModel

        from omskills.host.toolkit import tool_hints


        # Import-time noise: the server imports tool scripts before the transport starts.
        print("import-time noise on stdout")
        os.write(1, b"import-time fd noise on stdout\\n")


        class Written(BaseModel):
            out: str
            bytes: int


        @tool_hints(title="Write a text file", read_only=False)
        def toy_write(out: str, text: str) -> Written:
            """Write `text` to the file `out` and return where it went."""
            print("python-level noise on stdout")
            os.write(1, b"fd-level noise on stdout\\n")
            subprocess.run(["echo", "child-process noise on stdout"], check=True)
            path = Path(out)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            return Written(out=str(path), bytes=len(text.encode()))
        ''',
}

_CLI_TAIL = """

if __name__ == "__main__":
    import sys

    from omskills.host.toolkit import run_cli

    sys.exit(run_cli({name}))
"""


def write_tool(skill_dir: Path, name: str, body: str) -> Path:
    path = skill_dir / "scripts" / f"{name}.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(body).lstrip() + _CLI_TAIL.format(name=name))
    return path


def write_toy_skill(root: Path, tools: dict[str, str] | None = None) -> Path:
    skill = root / TOY_SKILL
    (skill / "references").mkdir(parents=True, exist_ok=True)
    (skill / "SKILL.md").write_text(_SKILL_MD)
    (skill / "references" / "toy.md").write_text(_REFERENCE)
    for name, body in (tools or _TOOLS).items():
        write_tool(skill, name, body)
    return skill


def toy_tool_names() -> list[str]:
    return sorted(_TOOLS)


def write_task_record(path: Path, record_id: str = "toy-task") -> Path:
    """A minimal valid task record (the intake a SAM 3 tiny run would have)."""
    data = {
        "id": record_id,
        "intake": {
            "model": {"family": "sam3", "builder": "sam3.model_builder:build_sam3_video_model", "scale": "tiny"},
            "inputs": {"video": "builtin:moving_square", "prompt": "a square", "frames": 2},
        },
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path
