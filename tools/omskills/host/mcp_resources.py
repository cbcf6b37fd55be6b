"""What the MCP server offers to read: skill documents, task records and what runs wrote.

- `skill://<skill>/SKILL.md` and `skill://<skill>/references/<file>`: listed at start-up (a few
  small files), each described by its frontmatter `description` or its first heading.
- `task://<path>`: a task record, by workspace-relative path.
- `run://<path>`: a file a run wrote (report.html, DELIVERY.md, pictures, verify/*.json, logs,
  ...), by workspace-relative path, with the MIME type of its kind; pictures come as blobs.

Records and run outputs are found when a client lists resources, never at start-up: a big
workspace would otherwise delay `initialize`. Every path is resolved (symlinks followed) and
must stay inside the workspace; a run file must lie in a folder that holds a task record (a
run folder) or below one, and no part of its path may be hidden (`.git`, `.env`).
"""

from __future__ import annotations

import fnmatch
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml
from omskills.errors import InputError
from omskills.records.intake import confined_path
from omskills.records.task import load_yaml

# Folders never searched for task records (big, or not the user's records).
SKIPPED_DIRS = {".git", ".venv", "venv", "node_modules", "__pycache__", "site-packages", ".claude"}
MAX_LISTED_RECORDS = 200
MAX_LISTED_PER_RUN = 60
# resources/list stays a page a client can show; everything past it is still readable by URI.
MAX_LISTED_TOTAL = 1000
MAX_PICTURES_PER_RUN = 24
# A resource is read whole into a message: bigger files (ONNX weights, npz samples) are refused.
MAX_RESOURCE_BYTES = 32 * 2**20
# A record is recognised by its top-level `intake:` key, without parsing YAML (records reach MBs).
_INTAKE_KEY = re.compile(rb"^intake:", re.MULTILINE)
_RECORD_SUFFIXES = {".yaml", ".yml"}
_MAX_RECORD_BYTES = 64 * 2**20

MIME_TYPES = {
    ".md": "text/markdown",
    ".html": "text/html",
    ".json": "application/json",
    ".yaml": "application/yaml",
    ".yml": "application/yaml",
    ".png": "image/png",
    ".jpg": "image/jpeg",
    ".jpeg": "image/jpeg",
    ".svg": "image/svg+xml",
    ".log": "text/plain",
    ".txt": "text/plain",
    ".sh": "text/x-shellscript",
    ".py": "text/x-python",
    ".csv": "text/csv",
}
_TEXT_MIME = ("text/", "application/json", "application/yaml", "image/svg+xml")


def mime_type(path: Path) -> str:
    return MIME_TYPES.get(path.suffix.lower(), "application/octet-stream")


def is_text(mime: str) -> bool:
    return mime.startswith(_TEXT_MIME)


# --------------------------------------------------------------------------- skill documents


@dataclass(frozen=True)
class Document:
    uri: str
    path: Path
    name: str
    title: str
    description: str


def _frontmatter(text: str) -> dict:
    if not text.startswith("---"):
        return {}
    end = text.find("\n---", 3)
    if end < 0:
        return {}
    try:
        data = yaml.safe_load(text[3:end])
    except yaml.YAMLError:
        return {}
    return data if isinstance(data, dict) else {}


def _first_heading(text: str) -> str | None:
    for line in text.splitlines():
        if line.startswith("#"):
            return line.lstrip("#").strip() or None
    return None


def _first_paragraph(text: str) -> str:
    body = text.split("\n---", 2)[-1] if text.startswith("---") else text
    lines: list[str] = []
    for line in body.splitlines():
        stripped = line.strip()
        if not stripped:
            if lines:
                break
            continue
        if stripped.startswith(("#", "|", "```", "-", "*")) and not lines:
            continue
        lines.append(stripped)
    return " ".join(lines)


def describe_document(path: Path, skill: str) -> tuple[str, str]:
    """(title, description) of a SKILL.md or reference file, from its frontmatter or first heading."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return path.name, f"{path.name} of the {skill} skill."
    meta = _frontmatter(text)
    heading = _first_heading(text)
    if path.name == "SKILL.md":
        title = f"{meta.get('name', skill)}: skill instructions"
        described = str(meta.get("description") or heading or "")
        return title, f"Instructions of the {skill} skill (read it first). {described}".strip()
    title = heading or path.stem.replace("_", " ")
    summary = str(meta.get("description") or _first_paragraph(text))
    if len(summary) > 300:
        summary = summary[:297].rsplit(" ", 1)[0] + "..."
    return title, f"Reference of the {skill} skill: {title}." + (f" {summary}" if summary else "")


def skill_documents(root: Path) -> Iterator[Document]:
    """Each SKILL.md and reference file, for progressive disclosure."""
    for skill_md in sorted(root.glob("*/SKILL.md")):
        skill = skill_md.parent.name
        files = [skill_md] + sorted(
            p for p in (skill_md.parent / "references").glob("*") if p.is_file() and not p.name.startswith(".")
        )
        for path in files:
            rel = "SKILL.md" if path == skill_md else f"references/{path.name}"
            title, description = describe_document(path, skill)
            yield Document(
                uri=f"skill://{skill}/{rel}",
                path=path.resolve(),
                name=f"{skill}/{rel}",
                title=title,
                description=description,
            )


# --------------------------------------------------------------------------- workspace files


def confine(value: str, workspace: Path, field: str) -> Path:
    """Resolve `value` against the workspace (symlinks followed); refuse anything outside it."""
    return confined_path(value, field, workspace, [workspace], root_name="the workspace", widened_by_env=False)


def looks_like_task_record(path: Path) -> bool:
    if path.suffix not in _RECORD_SUFFIXES:
        return False
    try:
        if path.stat().st_size > _MAX_RECORD_BYTES:
            return False
        return _INTAKE_KEY.search(path.read_bytes()) is not None
    except OSError:
        return False


def _walk(workspace: Path) -> Iterator[tuple[Path, list[str]]]:
    for folder, dirs, files in os.walk(workspace):
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS and not d.startswith("."))
        yield Path(folder), sorted(files)


def find_task_records(workspace: Path, limit: int = MAX_LISTED_RECORDS) -> list[Path]:
    """Task records under the workspace (symlinks leading out of it left out), at most `limit`."""
    found: list[Path] = []
    for folder, files in _walk(workspace):
        for name in files:
            path = folder / name
            if (
                path.suffix in _RECORD_SUFFIXES
                and path.resolve().is_relative_to(workspace)
                and looks_like_task_record(path)
            ):
                found.append(path)
                if len(found) >= limit:
                    return found
    return found


def _served_file(value: str, workspace: Path, what: str) -> Path:
    """A workspace file a resource may serve: inside the workspace, no hidden part, small enough."""
    target = confine(value, workspace, what)
    rel = target.relative_to(workspace)
    if any(part.startswith(".") for part in rel.parts):
        raise InputError(f"{what} {value!r}: hidden files are not served")
    if not target.is_file():
        raise InputError(f"no file {value!r} in the workspace")
    size = target.stat().st_size
    if size > MAX_RESOURCE_BYTES:
        raise InputError(
            f"{what} {value!r} is {size / 2**20:.0f} MB, more than a resource may be "
            f"({MAX_RESOURCE_BYTES // 2**20} MB); pass its path to a tool instead"
        )
    return target


def task_record_path(value: str, workspace: Path) -> Path:
    """The file a `task://` URI names: a served file that is a task record (YAML with an `intake:` key)."""
    target = _served_file(value, workspace, "task record")
    if not looks_like_task_record(target):
        raise InputError(f"task record {value!r}: not a task record (a YAML file with a top-level 'intake:')")
    return target


def _in_a_run_folder(path: Path, workspace: Path) -> bool:
    folder = path.parent
    while folder.is_relative_to(workspace):
        if any(looks_like_task_record(p) for p in folder.iterdir() if p.suffix in _RECORD_SUFFIXES and p.is_file()):
            return True
        if folder == workspace:
            break
        folder = folder.parent
    return False


def run_file_path(value: str, workspace: Path) -> Path:
    """The file a `run://` URI names: inside the workspace, not hidden, in a run folder, small enough."""
    target = _served_file(value, workspace, "run file")
    if not _in_a_run_folder(target, workspace):
        raise InputError(f"run file {value!r} is not in a run folder (a folder holding a task record)")
    return target


def read_file(path: Path) -> str | bytes:
    return path.read_text(encoding="utf-8") if is_text(mime_type(path)) else path.read_bytes()


# --------------------------------------------------------------------------- run outputs


# (pattern relative to the run folder, what it is). First match wins; unmatched files are not listed
# (they stay readable through the run:// templates).
OUTPUT_KINDS: list[tuple[str, str]] = [
    (
        "DELIVERY.md",
        "Delivery note: the deployed boundary, environment, ATC commands, validation figures and known limits",
    ),
    (
        "verify/*.html",
        "Verification report (report.html): spliced pipeline vs PyTorch, per-step output checks, "
        "parity per graph, pictures",
    ),
    ("verify/*.json", "Verification result (JSON): the output checks, parity and latency behind the report"),
    ("npu/FIGURES.md", "Figures measured on an Ascend NPU by omskills npu-check"),
    ("study/main_path.json", "The study's main-path run (JSON): steps, outputs, timings"),
    ("*main_path.json", "A main-path run (JSON): steps, outputs, timings"),
    ("plan/*.md", "Candidate plan: ranked candidates with status and reason"),
    ("plan/*.png", "Chart of the candidate plan (compute share per candidate)"),
    ("*compute_share.png", "Chart: compute share of the main path per module"),
    ("contracts/*.md", "Contracts and boundary decisions of the captured candidates"),
    ("inventory/*.md", "Static inventory of the model source: entry points, control plane, device-specific sites"),
    ("*.md", "A note the run wrote"),
    ("*.html", "A report the run wrote"),
    ("*.png", "A picture the run drew"),
    ("*.log", "A log of a step (export, ATC, optimisation)"),
    ("*.sh", "A shell script the run wrote (ATC command lines)"),
]


@dataclass(frozen=True)
class Listed:
    uri: str
    name: str
    title: str
    description: str
    mime_type: str
    size: int | None = None


def _kind(rel: str) -> str | None:
    return next((what for pattern, what in OUTPUT_KINDS if fnmatch.fnmatch(rel, pattern)), None)


def run_outputs(run_dir: Path, workspace: Path) -> list[Listed]:
    """The files of one run folder worth listing, described by kind (pictures capped)."""
    listed: list[Listed] = []
    pictures = 0
    run_label = run_dir.relative_to(workspace).as_posix() or "."
    for folder, files in _walk(run_dir):
        for name in files:
            path = folder / name
            rel = path.relative_to(run_dir).as_posix()
            what = None if name.startswith(".") else _kind(rel)
            if what is None or not path.resolve().is_relative_to(workspace):
                continue
            if path.suffix == ".png":
                pictures += 1
                if pictures > MAX_PICTURES_PER_RUN:
                    continue
            ws_rel = path.relative_to(workspace).as_posix()
            listed.append(
                Listed(
                    uri=f"run://{ws_rel}",
                    name=ws_rel,
                    title=f"{rel} ({run_label})",
                    description=f"{what}. Run folder {run_label}.",
                    mime_type=mime_type(path),
                    size=path.stat().st_size,
                )
            )
            if len(listed) >= MAX_LISTED_PER_RUN:
                return listed
    return listed


def _record_id(path: Path) -> str | None:
    match = re.search(rb"^id:\s*(\S+)", path.read_bytes()[:4096], re.MULTILINE)
    return match.group(1).decode(errors="replace").strip("'\"") if match else None


def listed_workspace(workspace: Path) -> list[Listed]:
    """Task records and the outputs of the runs beside them, as found now."""
    listed: list[Listed] = []
    run_dirs: list[Path] = []
    for record in find_task_records(workspace):
        rel = record.relative_to(workspace).as_posix()
        record_id = _record_id(record) or record.stem
        listed.append(
            Listed(
                uri=f"task://{rel}",
                name=rel,
                title=f"task record {record_id}",
                description=(
                    f"Task record {record_id} ({rel}): intake, stage statuses and every "
                    "stage's results. Tools that act on it take task=" + rel + "."
                ),
                mime_type="application/yaml",
                size=record.stat().st_size,
            )
        )
        run_dirs.append(record.parent)
    for run_dir in dict.fromkeys(run_dirs):
        # A folder of several records (task_records/) is a collection of inputs, not one run.
        if run_dirs.count(run_dir) == 1:
            listed += run_outputs(run_dir, workspace)
        if len(listed) >= MAX_LISTED_TOTAL:
            break
    return listed[:MAX_LISTED_TOTAL]


def candidate_names(record: Path) -> list[str]:
    """Plan candidates and graphs named in a task record (raw YAML: an older or partial record still answers)."""
    try:
        data = load_yaml(record.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return []
    if not isinstance(data, dict):
        return []
    names: list[str] = []
    plan = data.get("plan") or {}
    for cand in plan.get("candidates") or [] if isinstance(plan, dict) else []:
        if isinstance(cand, dict) and isinstance(cand.get("name"), str):
            names.append(cand["name"])
    study = data.get("study") or {}
    for seed in study.get("seeds") or [] if isinstance(study, dict) else []:
        if isinstance(seed, dict) and isinstance(seed.get("name"), str):
            names.append(seed["name"])
    for key in ("contracts", "exports", "toolchain"):
        section = data.get(key)
        if isinstance(section, dict):
            names += [k for k in section if isinstance(k, str)]
    return list(dict.fromkeys(names))
