"""Contributing skills: scaffold one (`new-skill`), check them (`validate`), install them
for Claude Code (`install-skills`).

The validation gate is what keeps a contributed skill from breaking the server: the
Agent Skills spec through the `skills-ref` package, plus the omskills tool rules — a typed
signature and a docstring on every tool, names unique and valid for MCP and the
Anthropic API, the server able to register it, a working CLI `--help`, and SKILL.md
naming every tool the skill ships.
"""

from __future__ import annotations

import inspect
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jinja2
import skills_ref
from omskills.errors import InputError, OmskillsError
from omskills.host.mcp_server import registration_problem
from omskills.host.toolkit import TOOL_NAME, ToolInfo, load_tool, skills_root
from pydantic import BaseModel, Field
from skills_ref.validator import validate_metadata

# Where a template path says TOOL, the example tool's name goes.
TOOL_PLACEHOLDER = "TOOL"
HELP_TIMEOUT_S = 180


def _templates_dir() -> Path:
    import omskills.host

    folder = Path(omskills.host.__file__).resolve().parent / "templates" / "skill"
    if not folder.is_dir():
        raise OmskillsError(f"cannot find the skill templates ({folder})")
    return folder


# --------------------------------------------------------------------------- new-skill


class CreatedSkill(BaseModel):
    name: str
    folder: Path
    tool: str
    files: list[Path]


def example_tool_name(skill: str) -> str:
    suffix = "_task_summary"
    return re.sub(r"[^a-z0-9]+", "_", skill.lower()).strip("_")[: 64 - len(suffix)] + suffix


def _result_class(tool: str) -> str:
    return "".join(part.capitalize() for part in tool.split("_") if part)


def _check_new_skill(name: str, description: str, root: Path, tool: str) -> None:
    problems = validate_metadata({"name": name, "description": description})
    if problems:
        raise InputError(f"new skill {name!r}: " + "; ".join(problems))
    if (root / name).exists():
        raise InputError(f"{root / name} already exists")
    taken = {p.stem: p for p in root.glob("*/scripts/*.py")}
    if tool in taken:
        raise InputError(f"the example tool name {tool!r} is already used by {taken[tool]}")


def new_skill(name: str, description: str | None = None, skills_dir: Path | None = None) -> CreatedSkill:
    """Create `skills_dir/name/` from the templates: SKILL.md, references/, one tool and its test."""
    root = (skills_dir or skills_root()).resolve()
    description = description or f"Tools for {name}. Say what the skill does and when an agent should use it."
    tool = example_tool_name(name)
    _check_new_skill(name, description, root, tool)
    source = _templates_dir()
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(source), undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    # A JSON string is a valid double-quoted YAML scalar: safe for any description (": " included).
    env.filters["yaml_string"] = lambda text: json.dumps(text, ensure_ascii=False)
    values = {
        "name": name,
        "title": name.replace("-", " ").capitalize(),
        "description": description,
        "tool": tool,
        "result_class": _result_class(tool),
    }
    folder = root / name
    written: list[Path] = []
    for template in sorted(source.rglob("*.j2")):
        relative = template.relative_to(source).as_posix()
        target = folder / relative.removesuffix(".j2").replace(TOOL_PLACEHOLDER, tool)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(env.get_template(relative).render(**values))
        written.append(target)
    return CreatedSkill(name=name, folder=folder, tool=tool, files=written)


# --------------------------------------------------------------------------- validate


class Problem(BaseModel):
    where: str
    message: str


class ValidationReport(BaseModel):
    skills: list[str] = Field(default_factory=list)
    tools: int = 0
    problems: list[Problem] = Field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _is_skill_dir(path: Path) -> bool:
    return (path / "SKILL.md").is_file() or (path / "scripts").is_dir()


def skill_dirs(paths: Iterable[Path] | None) -> list[Path]:
    """Skill folders named, or found one level under the folders named (default: every skill)."""
    found: list[Path] = []
    for path in [Path(p).resolve() for p in paths] if paths else [skills_root()]:
        if not path.is_dir():
            raise InputError(f"{path} is not a folder")
        if _is_skill_dir(path):
            found.append(path)
        else:
            found.extend(sorted(d for d in path.iterdir() if d.is_dir() and not d.name.startswith((".", "_"))))
    return found


def script_files(skill: Path) -> list[Path]:
    return sorted(p for p in (skill / "scripts").glob("*.py") if not p.name.startswith("_"))


def signature_problems(func: object) -> list[str]:
    """A tool's signature rules: every parameter and the return annotated, no *args/**kwargs."""
    problems: list[str] = []
    try:
        hints = inspect.get_annotations(func, eval_str=True)  # type: ignore[arg-type]
    except Exception as err:
        return [f"its annotations do not evaluate: {type(err).__name__}: {err}"]
    for pname, param in inspect.signature(func).parameters.items():  # type: ignore[arg-type]
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            problems.append(f"parameter {pname!r}: *args/**kwargs cannot be described to a model; name each argument")
        elif pname not in hints:
            problems.append(f"parameter {pname!r} has no type annotation")
        if pname.startswith("_"):
            problems.append(f"parameter {pname!r}: names starting with '_' are not allowed by MCP")
    if "return" not in hints:
        problems.append("the return type is not annotated (return a pydantic model)")
    if not (inspect.getdoc(func) or "").strip():
        problems.append("the function has no docstring (the model reads it as the tool description)")
    return problems


def _help_problem(script: Path) -> str | None:
    try:
        proc = subprocess.run(
            [sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=HELP_TIMEOUT_S, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired:
        return f"`{script.name} --help` did not finish in {HELP_TIMEOUT_S}s"
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return f"`{script.name} --help` failed (exit {proc.returncode}): {last}"
    if "usage:" not in proc.stdout:
        return f"`{script.name} --help` printed no usage: end the file with the run_cli block"
    return None


def _names_tool(skill_md: str, tool: str) -> bool:
    return re.search(rf"(?<![A-Za-z0-9_]){re.escape(tool)}(?![A-Za-z0-9_])", skill_md) is not None


def _where(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _check_tool(script: Path) -> tuple[ToolInfo | None, list[str]]:
    if not TOOL_NAME.match(script.stem):
        return None, [f"tool name {script.stem!r} is not valid for MCP/Anthropic ({TOOL_NAME.pattern})"]
    try:
        info = load_tool(script)
    except Exception as err:
        return None, [f"cannot load the tool: {type(err).__name__}: {err}"]
    problems = signature_problems(info.func)
    if not problems and (why := registration_problem(info)):
        problems.append(f"the MCP server cannot register it: {why}")
    return info, problems


def _sibling_tools(skills: list[Path]) -> dict[str, list[Path]]:
    """Tool name -> scripts defining it, over the validated skills and their sibling skills
    (the server serves the whole folder, so a clash with a sibling breaks it too)."""
    folders = {s.parent for s in skills}
    scripts = {p.resolve() for folder in folders for p in folder.glob("*/scripts/*.py") if not p.name.startswith("_")}
    scripts |= {p.resolve() for s in skills for p in script_files(s)}
    by_name: dict[str, list[Path]] = {}
    for script in sorted(scripts):
        by_name.setdefault(script.stem, []).append(script)
    return by_name


def validate_skills(paths: Iterable[Path] | None = None, *, run_help: bool = True) -> ValidationReport:
    skills = skill_dirs(paths)
    report = ValidationReport(skills=[s.name for s in skills])
    add = lambda where, message: report.problems.append(Problem(where=_where(where), message=message))  # noqa: E731
    by_name = _sibling_tools(skills)
    help_jobs: list[Path] = []
    for skill in skills:
        for message in skills_ref.validate(skill):
            add(skill / "SKILL.md", message)
        skill_md_path = skills_ref.find_skill_md(skill)
        skill_md = skill_md_path.read_text(encoding="utf-8") if skill_md_path else ""
        for script in script_files(skill):
            report.tools += 1
            info, problems = _check_tool(script)
            for message in problems:
                add(script, message)
            others = [p for p in by_name.get(script.stem, []) if p != script.resolve()]
            if others:
                add(script, f"tool name {script.stem!r} is also defined in {', '.join(_where(p) for p in others)}")
            if skill_md and not _names_tool(skill_md, script.stem):
                add(skill / "SKILL.md", f"does not name the tool {script.stem!r} that the skill ships (say when to call it)")
            if info is not None:
                help_jobs.append(script)
    if run_help:
        # Each --help is a fresh interpreter importing the engine: two at a time on two cores.
        with ThreadPoolExecutor(max_workers=2) as pool:
            for script, problem in zip(help_jobs, pool.map(_help_problem, help_jobs)):
                if problem:
                    add(script, problem)
    return report


# --------------------------------------------------------------------------- install-skills


def install_skills(target: Path, source: Path | None = None) -> list[Path]:
    """Copy each skill's SKILL.md, references/ and scripts/ into `target/<skill>/` (replacing it)."""
    installed: list[Path] = []
    for skill in skill_dirs([source] if source else None):
        if not (skill / "SKILL.md").is_file():
            raise OmskillsError(f"{skill} has no SKILL.md; run `omskills validate` before installing")
        dest = target / skill.name
        if dest.exists():
            if not (dest / "SKILL.md").is_file():
                raise InputError(f"{dest} exists and is not an installed skill; move it away first")
            shutil.rmtree(dest)
        dest.mkdir(parents=True)
        shutil.copy2(skill / "SKILL.md", dest / "SKILL.md")
        for part in ("references", "scripts"):
            if (skill / part).is_dir():
                shutil.copytree(skill / part, dest / part, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        installed.append(dest)
    return installed
