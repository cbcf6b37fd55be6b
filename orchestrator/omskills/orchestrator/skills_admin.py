"""Contributing skills: scaffold one (`new-skill`), check them (`validate`), install them
for Claude Code (`install-skills`).

The validation gate is what keeps a contributed skill from breaking the server: the
Agent Skills spec through the `skills-ref` package, plus the omskills tool rules — a typed
signature and a docstring on every tool, names unique and valid for MCP and the
Anthropic API, the server able to register it, a working CLI `--help`, and SKILL.md
naming every tool the skill ships.
"""

from __future__ import annotations

import difflib
import hashlib
import inspect
import json
import math
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import jinja2
import skills_ref
from omskills.errors import InputError, OmskillsError
from omskills.files import atomic_write_text
from omskills.host.mcp_server import parse_heartbeat_seconds, parse_log_level, registration_problem
from omskills.host.toolkit import TOOL_NAME, ToolInfo, hints_of, load_tool, parameter_description, skills_root
from omskills.orchestrator.choices import Client, Scope, ServerSetting
from omskills.orchestrator.version import installed_version
from omskills.records.stage_order import ADAPTATION_STEPS
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
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(source), undefined=jinja2.StrictUndefined, keep_trailing_newline=True
    )
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
    """A tool's signature rules: every parameter annotated and described, the return annotated, no
    *args/**kwargs, a docstring, and `@tool_hints` (the MCP title and annotations)."""
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
        elif parameter_description(hints[pname]) is None:
            problems.append(
                f"parameter {pname!r} has no description: annotate it "
                f"Annotated[T, Field(description=...)] (pydantic Field; clients show it)"
            )
        if pname.startswith("_"):
            problems.append(f"parameter {pname!r}: names starting with '_' are not allowed by MCP")
    if "return" not in hints:
        problems.append("the return type is not annotated (return a pydantic model)")
    if not (inspect.getdoc(func) or "").strip():
        problems.append("the function has no docstring (the model reads it as the tool description)")
    if hints_of(func) is None:  # type: ignore[arg-type]
        problems.append(
            "no @tool_hints(title=..., read_only=..., ...): clients need its title and whether it "
            "writes, destroys or runs long (from omskills.host.toolkit import tool_hints)"
        )
    return problems


def _help_problem(script: Path) -> str | None:
    try:
        proc = subprocess.run(
            [sys.executable, str(script), "--help"],
            capture_output=True,
            text=True,
            timeout=HELP_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        return f"`{script.name} --help` did not finish in {HELP_TIMEOUT_S}s"
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return f"`{script.name} --help` failed (exit {proc.returncode}): {last}"
    if "usage:" not in proc.stdout:
        return f"`{script.name} --help` printed no usage: end the file with the run_cli block"
    return None


def _tool_mention(text: str, tool: str) -> re.Match[str] | None:
    return re.search(rf"(?<![A-Za-z0-9_]){re.escape(tool)}(?![A-Za-z0-9_])", text)


def _names_tool(skill_md: str, tool: str) -> bool:
    return _tool_mention(skill_md, tool) is not None


def numbered_steps(skill_md: str) -> str:
    """The text of a SKILL.md's numbered lists: each "N. " item with its indented continuation lines."""
    kept, inside = [], False
    for line in skill_md.splitlines():
        inside = bool(re.match(r"\d+\. ", line)) or (inside and line.startswith("   "))
        if inside:
            kept.append(line)
    return "\n".join(kept)


def plan_order_problem(skill_md: str) -> str | None:
    """Numbered steps that start the adaptation (name the plan's first tool) must name every tool of
    the plan, first in the plan's order (records.stage_order declares it)."""
    steps = numbered_steps(skill_md)
    plan = [step.tool for step in ADAPTATION_STEPS]
    if not _names_tool(steps, plan[0]):
        return None
    missing = [tool for tool in plan if not _names_tool(steps, tool)]
    if missing:
        return f"the numbered steps run the adaptation but never name {missing} (the plan: {' -> '.join(plan)})"
    named = sorted(plan, key=lambda tool: _tool_mention(steps, tool).start())  # type: ignore[union-attr]
    if named != plan:
        return (
            f"the numbered steps name the plan's tools in the order {' -> '.join(named)}; "
            f"the plan runs {' -> '.join(plan)}"
        )
    return None


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
        if order := plan_order_problem(skill_md):
            add(skill / "SKILL.md", order)
        for script in script_files(skill):
            report.tools += 1
            info, problems = _check_tool(script)
            for message in problems:
                add(script, message)
            others = [p for p in by_name.get(script.stem, []) if p != script.resolve()]
            if others:
                add(script, f"tool name {script.stem!r} is also defined in {', '.join(_where(p) for p in others)}")
            if skill_md and not _names_tool(skill_md, script.stem):
                add(
                    skill / "SKILL.md",
                    f"does not name the tool {script.stem!r} that the skill ships (say when to call it)",
                )
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

# Written into each installed skill: the hash of every file as installed, so a later install can
# tell a file edited by its user (kept unless --force) from one it may simply update.
INSTALL_MANIFEST = ".omskills-install.json"


class InstallManifest(BaseModel):
    omskills_version: str
    files: dict[str, str]  # path inside the skill -> sha256 of the content installed


class FileChange(BaseModel):
    """One installed file an install would add, update or remove."""

    path: Path
    change: Literal["add", "update", "remove"]
    # Its content is not what omskills installed there (edited since, or never installed by it).
    local_edit: bool
    diff: str  # unified diff from the file as it is to what the install leaves


class SkillInstall(BaseModel):
    skill: str
    dest: Path
    changes: list[FileChange] = Field(default_factory=list)
    # Installed before without an install manifest (by an omskills that wrote none): every changed
    # file then counts as a local edit, since nothing says what was installed.
    older_install: bool = False

    @property
    def local_edits(self) -> list[FileChange]:
        return [c for c in self.changes if c.local_edit]


class InstallReport(BaseModel):
    target: Path
    skills: list[SkillInstall]
    written: bool  # False: local edits were found and nothing was written (rerun with force)

    @property
    def local_edits(self) -> list[FileChange]:
        return [c for s in self.skills for c in s.local_edits]

    @property
    def installed(self) -> list[Path]:
        return [s.dest for s in self.skills] if self.written else []


def user_skills_dir() -> Path:
    """Claude Code's skills folder for every project of this user."""
    return Path.home() / ".claude" / "skills"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _files_under(folder: Path) -> dict[str, bytes]:
    """Every file of an installed or source skill by its path inside it (caches and the manifest left out)."""
    found: dict[str, bytes] = {}
    for path in sorted(folder.rglob("*")):
        relative = path.relative_to(folder)
        if not path.is_file() or relative.as_posix() == INSTALL_MANIFEST:
            continue
        if any(part == "__pycache__" for part in relative.parts) or path.suffix == ".pyc":
            continue
        found[relative.as_posix()] = path.read_bytes()
    return found


def installation_python() -> Path:
    """This installation's interpreter, absolute but not resolved: a venv's python is a symlink
    whose target does not see the venv's packages."""
    return Path(sys.executable).absolute()


def _console_script(python: Path) -> Path | None:
    script = python.parent / ("omskills.exe" if os.name == "nt" else "omskills")
    return script if script.is_file() else None


def python_section(python: Path) -> str:
    """What an installed SKILL.md adds: the interpreter its scripts run with (the one that installed
    them, where omskills and its dependencies are), so an agent reading it needs no guess."""
    venv = f" (the virtual environment `{sys.prefix}`)" if sys.prefix != sys.base_prefix else ""
    script = _console_script(python)
    lines = [
        "",
        "## The Python environment of this installation",
        "",
        "Written by `omskills install-skills`. The scripts run with the interpreter that installed them,",
        "where omskills and its dependencies are (another `python` may lack them):",
        "",
        f"- Python: `{python}`{venv}",
        f"- a tool: `{python} <this skill's folder>/scripts/<tool>.py --help`",
        *([f"- the CLI: `{script} tool --list`"] if script else []),
    ]
    return "\n".join(lines) + "\n"


def _source_files(skill: Path) -> dict[str, bytes]:
    """The files to install: the skill's own, SKILL.md with the interpreter that runs the scripts."""
    skill_md = (skill / "SKILL.md").read_text(encoding="utf-8").rstrip("\n") + "\n"
    files = {"SKILL.md": (skill_md + python_section(installation_python())).encode("utf-8")}
    for part in ("references", "scripts"):
        if (skill / part).is_dir():
            files.update({f"{part}/{name}": data for name, data in _files_under(skill / part).items()})
    return files


def _read_manifest(dest: Path) -> InstallManifest | None:
    try:
        return InstallManifest.model_validate_json((dest / INSTALL_MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):  # none, or unreadable: every difference counts as a local edit
        return None


def unified_diff(before: bytes | None, after: bytes | None, before_label: str, after_label: str) -> str:
    try:
        old = (before or b"").decode("utf-8").splitlines(keepends=True)
        new = (after or b"").decode("utf-8").splitlines(keepends=True)
    except UnicodeDecodeError:
        return f"Binary files {before_label} and {after_label} differ\n"
    lines = difflib.unified_diff(
        old, new, before_label if before is not None else "/dev/null", after_label if after is not None else "/dev/null"
    )
    return "".join(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n" for line in lines)


def _plan_skill(skill: Path, dest: Path, version: str) -> tuple[SkillInstall, dict[str, bytes]]:
    if not (skill / "SKILL.md").is_file():
        raise OmskillsError(f"{skill} has no SKILL.md; run `omskills validate` before installing")
    if dest.exists() and not (dest / "SKILL.md").is_file():
        raise InputError(f"{dest} exists and is not an installed skill; move it away first")
    _refuse_links(dest)
    new = _source_files(skill)
    old = _files_under(dest) if dest.exists() else {}
    manifest = _read_manifest(dest)
    installed_hashes = manifest.files if manifest else {}
    plan = SkillInstall(skill=skill.name, dest=dest, older_install=bool(old) and manifest is None)
    for name in sorted(old.keys() | new.keys()):
        before, after = old.get(name), new.get(name)
        if before == after:
            continue
        change = "add" if before is None else "remove" if after is None else "update"
        edited = before is not None and installed_hashes.get(name) != _sha256(before)
        diff = unified_diff(before, after, f"{dest / name} (installed)", f"{dest / name} (omskills {version})")
        plan.changes.append(FileChange(path=dest / name, change=change, local_edit=edited, diff=diff))
    return plan, new


def _refuse_links(dest: Path) -> None:
    """An installed skill holds no symbolic link: writing its files through one would change files
    outside it (a linked `references/` folder), so the install stops before writing anything."""
    links = [dest] if dest.is_symlink() else []
    if not links and dest.is_dir():
        for folder, dirs, files in os.walk(dest):  # links to folders are listed, not entered
            links += [Path(folder) / n for n in [*dirs, *files] if (Path(folder) / n).is_symlink()]
    if links:
        raise InputError(
            f"{links[0]} is a symbolic link: install-skills never writes through one (it could lead outside "
            f"{dest.parent}); replace it with a plain folder or file, or move {dest} away"
        )


def _write_skill(skill: Path, plan: SkillInstall, files: dict[str, bytes], version: str) -> None:
    """Apply the plan's changes (identical files are not touched) and record what is installed."""
    for change in plan.changes:
        if change.change == "remove":
            change.path.unlink()
            for folder in change.path.parents:  # drop the folders it leaves empty
                if folder == plan.dest or any(folder.iterdir()):
                    break
                folder.rmdir()
        else:
            name = change.path.relative_to(plan.dest)
            change.path.parent.mkdir(parents=True, exist_ok=True)
            change.path.write_bytes(files[name.as_posix()])  # as planned: SKILL.md is not the source's
            shutil.copymode(skill / name, change.path)  # a script keeps its executable bit
    manifest = InstallManifest(omskills_version=version, files={name: _sha256(data) for name, data in files.items()})
    if _read_manifest(plan.dest) != manifest:
        atomic_write_text(plan.dest / INSTALL_MANIFEST, manifest.model_dump_json(indent=2) + "\n")


def install_skills(target: Path, source: Path | None = None, *, force: bool = False) -> InstallReport:
    """Install each skill's SKILL.md, references/ and scripts/ as `target/<skill>/`.

    A file whose content is not what omskills installed there (edited, or added by hand) is a
    local edit: unless `force`, nothing at all is written and the report carries the diffs.
    Files unchanged since the last install are updated; identical files are left as they are.
    """
    version = installed_version()
    skills = skill_dirs([source] if source else None)
    plans = [_plan_skill(skill, target / skill.name, version) for skill in skills]
    report = InstallReport(target=target, skills=[plan for plan, _ in plans], written=False)
    if report.local_edits and not force:
        return report
    for skill, (plan, files) in zip(skills, plans):
        _write_skill(skill, plan, files, version)
    report.written = True
    return report


# --------------------------------------------------------------------------- install-client

SERVER_NAME = "omskills"


class ClientInstall(BaseModel):
    """What `install-client` did to one client's configuration file."""

    client: Client
    config_path: Path
    entry: dict[str, Any]  # the mcpServers.omskills entry it wants there
    previous: dict[str, Any] | None  # the entry that was there
    status: Literal["added", "replaced", "unchanged", "refused"]
    diff: str
    # Server settings set in this shell but not written (no --env for them): the server will not see them.
    not_carried: list[str] = Field(default_factory=list)


# ---- the server's environment in a client's entry (`--env KEY=VALUE`)
# A client starts the server with the entry's `env` and little else of the user's shell, so the
# settings the server reads go there. Every value is checked here, before anything is written:
# this is the one place a value bound for a client's configuration is checked.


def _folder(key: str, value: str) -> str:
    path = Path(value)
    if not path.is_absolute():
        raise InputError(f"--env {key}: {value!r} is not an absolute path (the client starts the server elsewhere)")
    if not path.is_dir():
        raise InputError(f"--env {key}: {value} is not an existing folder")
    return str(path)


def _folders(key: str, value: str) -> str:
    parts = [part for part in value.split(os.pathsep) if part]
    if not parts:
        raise InputError(f"--env {key}: names no folder")
    return os.pathsep.join(_folder(key, part) for part in parts)


def _log_level(key: str, value: str) -> str:
    return parse_log_level(value)


def _seconds(key: str, value: str) -> str:
    return str(parse_heartbeat_seconds(value))


# The allow-list (README, `install-client --help`), each setting with its check; and DRIVER_SOURCE_ENV.
SERVER_ENV: dict[ServerSetting, Callable[[str, str], str]] = {
    "OMSKILLS_INPUT_ROOTS": _folders,
    "OMSKILLS_SKILLS_DIR": _folder,
    "OMSKILLS_LOG_LEVEL": _log_level,
    "OMSKILLS_HEARTBEAT_SECONDS": _seconds,
}
# A driver's checkout, such as OMSKILLS_SAM31_SOURCE (a driver declares its own as `source_env`).
DRIVER_SOURCE_ENV = re.compile(r"OMSKILLS_[A-Z0-9]+(?:_[A-Z0-9]+)*_SOURCE")


def _check_setting(key: str, value: str) -> str:
    if key in SERVER_ENV:
        check = SERVER_ENV[key]  # type: ignore[index]
    elif DRIVER_SOURCE_ENV.fullmatch(key):
        check = _folder
    else:
        raise InputError(
            f"--env {key}: not a setting the server reads; it takes {', '.join(SERVER_ENV)} "
            "or a driver's OMSKILLS_<DRIVER>_SOURCE (e.g. OMSKILLS_SAM31_SOURCE)"
        )
    if not value or any(ord(char) < 32 or ord(char) == 127 for char in value):
        raise InputError(f"--env {key}: the value is empty or holds a control character")
    return check(key, value)


def parse_env_args(items: Iterable[str]) -> dict[str, str]:
    """`KEY=VALUE` items as given on the command line (each key once), not yet checked."""
    env: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise InputError(f"--env {item!r}: expected KEY=VALUE")
        if key in env:
            raise InputError(f"--env {key}: given twice; keep one")
        env[key] = value
    return env


def checked_server_env(env: Mapping[str, str]) -> dict[str, str]:
    """The settings to write into the entry, each checked (InputError naming the first bad one), sorted."""
    return {key: _check_setting(key, env[key]) for key in sorted(env)}


def _not_carried(env: Mapping[str, str]) -> list[str]:
    """Server settings this shell has that the entry will not carry."""
    return sorted(key for key in SERVER_ENV if os.environ.get(key) and key not in env)


def serve_command(workspace: str) -> tuple[str, list[str]]:
    """The command that starts this installation's MCP server, with absolute paths."""
    python = installation_python()
    if script := _console_script(python):
        return str(script), ["serve", "--workspace", workspace]
    return str(python), ["-m", "omskills.orchestrator.cli", "serve", "--workspace", workspace]


def desktop_config_path() -> Path:
    """Claude Desktop's configuration file on this system."""
    home = Path.home()
    if sys.platform == "darwin":
        return home / "Library" / "Application Support" / "Claude" / "claude_desktop_config.json"
    if sys.platform == "win32":
        return Path(os.environ.get("APPDATA", home / "AppData" / "Roaming")) / "Claude" / "claude_desktop_config.json"
    return Path(os.environ.get("XDG_CONFIG_HOME") or home / ".config") / "Claude" / "claude_desktop_config.json"


def _client_target(client: Client, workspace: Path | None, scope: Scope | None) -> tuple[Path, str, dict[str, Any]]:
    """(config file, server workspace argument, extra entry fields) for a client and scope."""
    if workspace is not None and not workspace.is_dir():
        raise InputError(f"--workspace: {workspace} is not a folder")
    folder = (workspace or Path.cwd()).resolve()
    if client == "claude-desktop":
        if scope is not None:
            raise InputError("--scope applies to claude-code only (Claude Desktop has one configuration)")
        # Claude Desktop starts servers in `/`: the workspace must be absolute.
        return desktop_config_path(), str(folder), {}
    if (scope or "project") == "project":
        return folder / ".mcp.json", str(folder), {"type": "stdio"}
    # User scope: the folder given, or the one install-client ran in, absolute (a relative one
    # would mean wherever a client happens to start the server).
    return Path.home() / ".claude.json", str(folder), {"type": "stdio"}


def _load_config(path: Path) -> dict[str, Any]:
    """A client's configuration, refused (nothing written) when a rewrite could not keep it as it
    is: a key given twice (JSON keeps the last: the first block would be lost), a number JSON
    cannot hold (1e400 would come back as Infinity), a lone surrogate, or a file deeper than
    Python's parser goes."""
    if not path.exists():
        return {}
    try:
        text = path.read_text(encoding="utf-8") or "{}"
        data = json.loads(text, object_pairs_hook=_unique_keys(path), parse_constant=_no_constant, parse_float=_finite)
        json.dumps(data, ensure_ascii=False).encode("utf-8")  # a lone surrogate cannot be written back
    except (OSError, ValueError, RecursionError) as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise InputError(f"{path}: cannot read it as JSON ({reason}); fix or move it (nothing was written)") from None
    if not isinstance(data, dict):
        raise InputError(f"{path}: expected a JSON object at the top level (nothing was written)")
    if not isinstance(data.get("mcpServers", {}), dict):
        raise InputError(f"{path}: mcpServers is not a JSON object (nothing was written)")
    return data


def _unique_keys(path: Path) -> Callable[[list[tuple[str, Any]]], dict[str, Any]]:
    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: dict[str, Any] = {}
        for key, value in items:
            if key in seen:
                raise ValueError(f"the key {key!r} is given twice: keep one")
            seen[key] = value
        return seen

    return pairs


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is beyond what JSON can write back")
    return value


def write_json_keeping_mode(path: Path, data: dict[str, Any]) -> None:
    """Replace `path` atomically (a crash leaves the old file), keeping its permissions. A path that
    is a symbolic link (dotfiles kept elsewhere) keeps its link: its target is what is replaced."""
    target = path.resolve() if path.is_symlink() else path
    target.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(target, json.dumps(data, indent=2, ensure_ascii=False, allow_nan=False) + "\n")


def install_client(
    client: Client,
    workspace: Path | None = None,
    scope: Scope | None = None,
    *,
    force: bool = False,
    follow_link: bool = False,
    env: Mapping[str, str] | None = None,
) -> ClientInstall:
    """Add the omskills server to a client's `mcpServers`, keeping every other server and key.

    `env` is the server's settings (SERVER_ENV keys, a driver's source), checked before anything
    is written. A different omskills entry already there is replaced only with `force`; the result
    carries the diff either way. A configuration file that is a symbolic link is written (its
    target, the link kept) only with `follow_link`.
    """
    server_env = checked_server_env(env or {})
    path, workspace_arg, extra = _client_target(client, workspace, scope)
    if path.is_symlink() and not follow_link:
        raise InputError(
            f"{path} is a symbolic link (to {os.readlink(path)}): nothing was written; pass --follow-link to "
            "write the file it points at and keep the link"
        )
    command, args = serve_command(workspace_arg)
    entry = {**extra, "command": command, "args": args, "env": server_env}
    data = _load_config(path)
    previous = data.get("mcpServers", {}).get(SERVER_NAME)
    label = f"{path} mcpServers.{SERVER_NAME}"
    as_text = lambda value: (json.dumps(value, indent=2) + "\n").encode()  # noqa: E731
    diff = unified_diff(
        as_text(previous) if previous is not None else None, as_text(entry), f"{label} (now)", f"{label} (new)"
    )
    result = ClientInstall(
        client=client,
        config_path=path,
        entry=entry,
        previous=previous,
        status="added",
        diff=diff,
        not_carried=_not_carried(server_env),
    )
    if previous == entry:
        result.status, result.diff = "unchanged", ""
    elif previous is not None and not force:
        result.status = "refused"
    else:
        result.status = "replaced" if previous is not None else "added"
        data.setdefault("mcpServers", {})[SERVER_NAME] = entry
        write_json_keeping_mode(path, data)
    return result
