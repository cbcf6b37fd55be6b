"""Contributing a skill: `new-skill` scaffolds one the server serves at once, `validate` is
the gate (spec + tool rules, with reasons), `install-skills` copies skills for Claude Code and
never overwrites a local edit without --force."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
import skills_ref
from mcp_helpers import write_task_record, write_tool
from omskills.errors import InputError
from omskills.host.toolkit import skills_root
from omskills.orchestrator.mcp_client import connect
from omskills.orchestrator.skills_admin import INSTALL_MANIFEST, install_skills, new_skill, validate_skills

CLI = [sys.executable, "-c", "import sys; from omskills.orchestrator.cli import main; sys.exit(main())"]


def omskills(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=300, cwd=cwd, stdin=subprocess.DEVNULL)


@pytest.fixture()
def skills_copy(tmp_path: Path) -> Path:
    copy = tmp_path / "skills"
    shutil.copytree(skills_root(), copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def test_new_skill_is_served_and_callable_with_no_other_change(skills_copy, tmp_path):
    made = omskills(
        "new-skill", "demo-model", "--description", "Demo: adapt the demo model.", "--skills-dir", str(skills_copy)
    )
    assert made.returncode == 0, made.stderr
    folder = skills_copy / "demo-model"
    tool = "demo_model_task_summary"
    assert sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()) == [
        "SKILL.md",
        "references/README.md",
        f"scripts/{tool}.py",
        f"tests/test_{tool}.py",
    ]
    workspace = tmp_path / "ws"
    task = write_task_record(workspace / "task.yaml", record_id="demo")

    async def list_and_call():
        async with connect(workspace, skills_copy) as client:
            names = {t.name: t.skill for t in await client.list_tools()}
            return names, await client.call(tool, {"task": "task.yaml"})

    names, outcome = anyio.run(list_and_call)
    assert names[tool] == "demo-model"
    assert not outcome.is_error, outcome.text
    assert outcome.structured == {"task_id": "demo", "model_family": "sam3", "stages": [], "decisions": 0}
    assert task.exists()


def test_the_scaffold_passes_the_gate_and_its_own_tests(tmp_path):
    created = new_skill("demo-model", "Demo: adapt the demo model.", tmp_path)
    report = validate_skills([created.folder])
    assert report.ok, report.problems
    assert (report.skills, report.tools) == (["demo-model"], 1)
    tests = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(created.folder / "tests")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert tests.returncode == 0, tests.stdout + tests.stderr
    assert "2 passed" in tests.stdout


def test_new_skill_refuses_a_bad_name_and_an_existing_folder(tmp_path):
    with pytest.raises(InputError, match="lowercase"):
        new_skill("Demo_Model", None, tmp_path)
    new_skill("demo", None, tmp_path)
    with pytest.raises(InputError, match="already exists"):
        new_skill("demo", None, tmp_path)


def test_validate_passes_on_the_shipped_skills():
    shipped = [d for d in sorted(skills_root().iterdir()) if (d / "SKILL.md").is_file()]
    assert shipped, "no shipped skill has a SKILL.md yet"
    report = validate_skills(shipped)
    assert report.ok, "\n".join(f"{p.where}: {p.message}" for p in report.problems)


def test_the_workflow_that_starts_the_adaptation_must_name_the_plan_in_its_order(tmp_path):
    shipped = skills_root() / "om-deployer"
    skill = tmp_path / "om-deployer"
    shutil.copytree(shipped, skill, ignore=shutil.ignore_patterns("__pycache__"))
    text = (shipped / "SKILL.md").read_text()
    swapped = text.replace("`precheck_ops`, `convert_atc`", "`convert_atc`, `precheck_ops`", 1)
    assert swapped != text
    (skill / "SKILL.md").write_text(swapped)
    [problem] = validate_skills([skill], run_help=False).problems
    assert "name the plan's tools in the order" in problem.message
    assert "convert_atc -> precheck_ops" in problem.message and "precheck_ops -> convert_atc" in problem.message
    dropped = text.replace("then `check_precision_plan`", "then the precision plan", 1)
    assert dropped != text
    (skill / "SKILL.md").write_text(dropped)
    [problem] = validate_skills([skill], run_help=False).problems
    assert "never name ['check_precision_plan']" in problem.message


# ---- each way a skill can be broken, and the reason the gate gives


def _break_frontmatter_name(skill: Path) -> None:
    md = skill / "SKILL.md"
    md.write_text(md.read_text().replace("name: demo-model", "name: Demo_Model", 1))


def _untyped_parameter(skill: Path) -> None:
    write_tool(
        skill,
        "demo_model_task_summary",
        '''
        def demo_model_task_summary(task) -> dict:
            """Summarise."""
            return {}
        ''',
    )


def _untyped_return(skill: Path) -> None:
    write_tool(
        skill,
        "demo_model_task_summary",
        '''
        def demo_model_task_summary(task: str):
            """Summarise."""
            return {}
        ''',
    )


def _no_docstring(skill: Path) -> None:
    write_tool(
        skill,
        "demo_model_task_summary",
        """
        from omskills.host.toolkit import TaskPath, tool_hints

        @tool_hints(title="Summarise", read_only=True)
        def demo_model_task_summary(task: TaskPath) -> dict:
            return {}
        """,
    )


def _duplicate_tool_name(skill: Path) -> None:
    other = new_skill("other-model", None, skill.parent)
    write_tool(
        other.folder,
        "demo_model_task_summary",
        '''
        def demo_model_task_summary(task: str) -> dict:
            """Same name as demo-model's tool."""
            return {}
        ''',
    )


def _unnamed_in_skill_md(skill: Path) -> None:
    write_tool(
        skill,
        "extra_tool",
        '''
        from typing import Annotated

        from pydantic import Field

        from omskills.host.toolkit import tool_hints

        @tool_hints(title="Extra", read_only=True)
        def extra_tool(x: Annotated[int, Field(description="A number.")]) -> int:
            """A tool SKILL.md never mentions."""
            return x
        ''',
    )


def _invalid_tool_name(skill: Path) -> None:
    (skill / "scripts" / "bad.name.py").write_text("def f(): pass\n")


def _help_fails(skill: Path) -> None:
    script = skill / "scripts" / "demo_model_task_summary.py"
    script.write_text(script.read_text().replace("sys.exit(run_cli(demo_model_task_summary))", "sys.exit(3)"))


BREAKAGES = {
    "bad frontmatter name": (_break_frontmatter_name, "SKILL.md", "Skill name 'Demo_Model' must be lowercase"),
    "untyped parameter": (_untyped_parameter, "demo_model_task_summary.py", "parameter 'task' has no type annotation"),
    "untyped return": (_untyped_return, "demo_model_task_summary.py", "the return type is not annotated"),
    "missing docstring": (_no_docstring, "demo_model_task_summary.py", "has no docstring"),
    "duplicate tool name": (
        _duplicate_tool_name,
        "demo_model_task_summary.py",
        "tool name 'demo_model_task_summary' is also defined in",
    ),
    "SKILL.md not naming a tool": (_unnamed_in_skill_md, "SKILL.md", "does not name the tool 'extra_tool'"),
    "invalid tool name": (_invalid_tool_name, "bad.name.py", "is not valid for MCP/Anthropic"),
    "CLI --help failing": (_help_fails, "demo_model_task_summary.py", "--help` failed (exit 3)"),
}


@pytest.mark.parametrize("breakage", list(BREAKAGES))
def test_validate_fails_with_the_reason(tmp_path, breakage):
    created = new_skill("demo-model", "Demo: adapt the demo model.", tmp_path)
    damage, where, reason = BREAKAGES[breakage]
    damage(created.folder)
    report = validate_skills([created.folder], run_help=breakage == "CLI --help failing")
    assert not report.ok
    matching = [p for p in report.problems if reason in p.message]
    assert matching, report.problems
    assert matching[0].where.endswith(where)


def test_validate_cli_exits_non_zero_and_lists_the_problems(tmp_path):
    created = new_skill("demo-model", None, tmp_path)
    _no_docstring(created.folder)
    _unnamed_in_skill_md(created.folder)
    proc = omskills("validate", str(tmp_path))
    assert proc.returncode == 1
    lines = proc.stdout.strip().splitlines()
    assert any("has no docstring" in line for line in lines)
    assert any("does not name the tool 'extra_tool'" in line for line in lines)
    assert lines[-1].startswith("FAILED: 1 skill(s), 2 tool(s), 2 problem(s)")


def test_install_skills_copies_skill_md_references_and_scripts(tmp_path):
    source = tmp_path / "skills"
    new_skill("demo-model", None, source)
    target = tmp_path / "claude" / "skills"
    assert install_skills(target, source).installed == [target / "demo-model"]
    installed = sorted(p.relative_to(target).as_posix() for p in target.rglob("*") if p.is_file())
    assert installed == [
        "demo-model/.omskills-install.json",
        "demo-model/SKILL.md",
        "demo-model/references/README.md",
        "demo-model/scripts/demo_model_task_summary.py",
    ]
    # An update of the source reaches an install nobody edited, without --force; the rest is not touched.
    (source / "demo-model" / "references" / "README.md").write_text("# Updated upstream\n")
    os.utime(target / "demo-model" / "SKILL.md", ns=(1, 1))  # copying it again would restore the source's time
    update = install_skills(target, source)
    assert update.written and [(c.path.name, c.change, c.local_edit) for c in update.skills[0].changes] == [
        ("README.md", "update", False)
    ]
    assert (target / "demo-model" / "references" / "README.md").read_text() == "# Updated upstream\n"
    assert (target / "demo-model" / "SKILL.md").stat().st_mtime_ns == 1
    # A folder that is not a skill is left alone.
    shutil.rmtree(target / "demo-model")
    (target / "demo-model").mkdir()
    (target / "demo-model" / "notes.txt").write_text("mine")
    with pytest.raises(InputError, match="not an installed skill"):
        install_skills(target, source)


def test_install_skills_never_overwrites_local_edits_silently(tmp_path):
    source = tmp_path / "skills"
    new_skill("demo-model", None, source)
    target = tmp_path / "claude" / "skills"
    install_skills(target, source)
    skill_md = target / "demo-model" / "SKILL.md"
    skill_md.write_text(skill_md.read_text() + "My own note.\n")
    (target / "demo-model" / "scripts" / "mine.py").write_text("print('mine')\n")

    refused = install_skills(target, source)
    assert not refused.written and refused.installed == []
    assert sorted((c.path.name, c.change) for c in refused.local_edits) == [
        ("SKILL.md", "update"),
        ("mine.py", "remove"),
    ]
    assert "My own note." in skill_md.read_text() and (target / "demo-model" / "scripts" / "mine.py").exists()
    diff = next(c.diff for c in refused.local_edits if c.path == skill_md)
    assert diff.startswith(f"--- {skill_md} (installed)\n+++ {skill_md} (omskills ") and "\n-My own note.\n" in diff

    forced = install_skills(target, source, force=True)
    assert forced.written and "My own note." not in skill_md.read_text()
    assert not (target / "demo-model" / "scripts" / "mine.py").exists()
    assert install_skills(target, source).skills[0].changes == []  # now identical: nothing to do


def test_install_skills_never_writes_through_a_symlink_inside_an_installed_skill(tmp_path):
    source = tmp_path / "skills"
    new_skill("demo-model", None, source)
    target = tmp_path / "claude" / "skills"
    install_skills(target, source)
    outside = tmp_path / "outside"
    shutil.move(target / "demo-model" / "references", outside)  # the user's own folder, linked in
    (target / "demo-model" / "references").symlink_to(outside)
    (outside / "README.md").write_text("my notes\n")
    (source / "demo-model" / "references" / "README.md").write_text("# Updated upstream\n")

    for force in (False, True):
        with pytest.raises(InputError, match="references is a symbolic link: install-skills never writes through one"):
            install_skills(target, source, force=force)
    assert (outside / "README.md").read_text() == "my notes\n"


def test_install_skills_cli_user_scope_diff_and_force(tmp_path):
    home = tmp_path / "home"
    env = {**os.environ, "HOME": str(home)}

    def run(*args):
        return subprocess.run(
            [*CLI, "install-skills", *args],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
            cwd=tmp_path,
            stdin=subprocess.DEVNULL,
        )

    first = run("--user")
    assert first.returncode == 0, first.stderr
    installed = home / ".claude" / "skills"
    assert sorted(p.name for p in installed.iterdir()) == sorted(
        p.name for p in skills_root().iterdir() if (p / "SKILL.md").is_file()
    )
    skill_md = installed / "om-deployer" / "SKILL.md"
    assert "## Running the scripts" in skill_md.read_text()  # the installed skills say how to run their tools
    assert run("--user").stdout.count("already up to date") == len(list(installed.iterdir()))

    skill_md.write_text(skill_md.read_text().replace("## Running the scripts", "## How I run them"))
    refused = run("--user")
    assert refused.returncode == 1 and "rerun with --force" in refused.stderr
    assert f"--- {skill_md} (installed)" in refused.stdout and "-## How I run them" in refused.stdout
    assert "## How I run them" in skill_md.read_text()
    forced = run("--user", "--force")
    assert forced.returncode == 0 and f"overwrote local edits: {skill_md} (update)" in forced.stdout
    assert "## Running the scripts" in skill_md.read_text()

    # Installed by an omskills that wrote no manifest, and older than this one: it says so, not "local edits".
    (skill_md.parent / INSTALL_MANIFEST).unlink()
    skill_md.write_text(skill_md.read_text().replace("## Running the scripts", "## Scripts (older wording)"))
    older = run("--user")
    assert older.returncode == 1 and "local edits" not in older.stderr
    assert older.stderr.strip() == (
        f"omskills: error: {skill_md.parent} installed by an older omskills (no install manifest, "
        "diff above): nothing was installed; rerun with --force to update"
    )


def test_installed_skills_name_the_python_that_runs_their_scripts(tmp_path):
    """An installed SKILL.md says which interpreter runs its scripts: the one `install-skills` ran
    with, where omskills is installed; that interpreter runs an installed script as said."""
    target = tmp_path / "claude-skills"
    installed = omskills("install-skills", "--target", str(target), cwd=tmp_path)
    assert installed.returncode == 0, installed.stderr

    skill = target / "om-deployer"
    text = (skill / "SKILL.md").read_text()
    source = (skills_root() / "om-deployer" / "SKILL.md").read_text()
    assert text.startswith(source) and "## The Python environment of this installation" in text[len(source) :]
    [python] = re.findall(r"^- Python: `([^`]+)`", text, re.MULTILINE)
    assert python == str(Path(sys.executable).absolute())  # the installing interpreter, its venv link kept
    assert skills_ref.validate(skill) == []  # still a valid skill
    ran = subprocess.run(
        [python, str(skill / "scripts" / "list_drivers.py"), "--help"], capture_output=True, text=True, timeout=300
    )
    assert ran.returncode == 0 and "usage:" in ran.stdout, ran.stderr[-2000:]
    again = omskills("install-skills", "--target", str(target), cwd=tmp_path)
    assert again.stdout.count("already up to date") == 3  # what it wrote is what it installs: no local edit


def test_a_scaffolded_skills_tests_run_with_the_suite_and_pass_its_lint(tmp_path):
    checkout = tmp_path / "checkout"
    (checkout / "skills").mkdir(parents=True)
    shutil.copy(Path(__file__).resolve().parents[1] / "pyproject.toml", checkout)
    created = new_skill("demo-model", skills_dir=checkout / "skills")
    suite = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "0", "-p", "no:cacheprovider"],
        cwd=checkout,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert suite.returncode == 0, suite.stdout[-3000:] + suite.stderr[-2000:]
    assert "2 passed" in suite.stdout
    ruff = Path(sys.executable).with_name("ruff")
    for check in (["check"], ["format", "--check"]):
        linted = subprocess.run([str(ruff), *check, str(created.folder)], cwd=checkout, capture_output=True, text=True)
        assert linted.returncode == 0, linted.stdout + linted.stderr
