"""The task record: one YAML file per adaptation, validated, written atomically.

Every tool reads it and writes its results back; a rerun resumes from what is done.
Artefacts of a run live in the record's folder (`TaskRecord.workdir(path)`).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
import tempfile
from pathlib import Path
from typing import Iterator

import yaml
from pydantic import Field, ValidationError

from omskills.errors import TaskRecordError
from omskills.records.base import Record
from omskills.records.environment import EnvironmentReport
from omskills.records.export import ExportResult
from omskills.records.intake import Intake
from omskills.records.inventory import Inventory
from omskills.records.contracts import BoundaryDecision, ContractSpec
from omskills.records.plan import Plan, StudyRun
from omskills.records.profile import ProfileReport
from omskills.records.stages import Decision, StageResult
from omskills.records.toolchain_stage import CandidateToolchain
from omskills.records.verify import VerifyReport

SCHEMA_VERSION = 1


class TaskRecord(Record):
    schema_version: int = SCHEMA_VERSION
    id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    intake: Intake
    # Step name ("main_path", "export:vision_backbone", ...) -> its result.
    stages: dict[str, StageResult] = Field(default_factory=dict)
    decisions: list[Decision] = Field(default_factory=list)
    environment: EnvironmentReport | None = None
    inventory: Inventory | None = None
    study: StudyRun | None = None
    profile: ProfileReport | None = None
    plan: Plan | None = None
    contracts: dict[str, ContractSpec] = Field(default_factory=dict)  # candidate -> captured contract
    boundaries: dict[str, BoundaryDecision] = Field(default_factory=dict)
    exports: dict[str, ExportResult] = Field(default_factory=dict)  # candidate -> its ONNX export
    toolchain: dict[str, CandidateToolchain] = Field(default_factory=dict)  # candidate -> probes, variants, ops, ATC
    verification: VerifyReport | None = None

    def decide(self, by: str, what: str, why: str) -> None:
        self.decisions.append(Decision(at=now_iso(), by=by, what=what, why=why))

    @staticmethod
    def workdir(path: str | Path) -> Path:
        return Path(path).resolve().parent


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _format_validation_error(path: Path, err: ValidationError) -> str:
    problems = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(root)"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown field"
        problems.append(f"{loc}: {msg}")
    return f"task record {path}: " + "; ".join(problems)


def parse_record(data: object, path: Path) -> TaskRecord:
    if not isinstance(data, dict):
        raise TaskRecordError(f"task record {path}: expected a mapping at the top level")
    if "intake" not in data:
        raise TaskRecordError(f"task record {path}: intake: field required (model, inputs, target)")
    try:
        return TaskRecord.model_validate(data)
    except ValidationError as err:
        raise TaskRecordError(_format_validation_error(path, err)) from None


def load_record(path: str | Path) -> TaskRecord:
    path = Path(path)
    if not path.is_file():
        raise TaskRecordError(f"task record not found: {path}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise TaskRecordError(f"task record {path}: not valid YAML ({err})") from None
    return parse_record(data, path)


def save_record(record: TaskRecord, path: str | Path) -> None:
    """Write atomically: a crash mid-write leaves the previous record intact."""
    path = Path(path)
    text = yaml.safe_dump(record.model_dump(mode="json", exclude_none=False), sort_keys=False, allow_unicode=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def updating(path: str | Path) -> Iterator[TaskRecord]:
    """Load, let the caller change, save atomically. Nothing is saved if the body raises."""
    record = load_record(path)
    yield record
    save_record(record, path)
