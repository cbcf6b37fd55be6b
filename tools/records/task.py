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
from omskills.errors import StageError, TaskRecordError
from omskills.records.base import Record
from omskills.records.contracts import BoundaryDecision, ContractSpec, is_ancestor
from omskills.records.environment import EnvironmentReport
from omskills.records.export import ExportResult
from omskills.records.intake import Intake
from omskills.records.inventory import Inventory
from omskills.records.plan import Candidate, Plan, StudyRun
from omskills.records.profile import ProfileReport
from omskills.records.stages import Decision, StageResult
from omskills.records.toolchain import BatchSplit
from omskills.records.toolchain_stage import CandidateToolchain
from omskills.records.verify import VerifyReport
from pydantic import Field, ValidationError

# 2: verification is judged by the driver's output checks (per step), not by frames and masks.
SCHEMA_VERSION = 2

# libyaml's safe loader and dumper when PyYAML was built with it: records reach hundreds of KB,
# which the pure-Python ones take a second to read.
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_Dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


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
    # Graph name -> captured contract. A graph is a plan candidate, or one of the graphs of a
    # candidate dispatched on a non-tensor argument ("mask_decoder-multimask_output_True").
    contracts: dict[str, ContractSpec] = Field(default_factory=dict)
    boundaries: dict[str, BoundaryDecision] = Field(default_factory=dict)  # graph -> boundary decision
    exports: dict[str, ExportResult] = Field(default_factory=dict)  # graph -> its ONNX export
    toolchain: dict[str, CandidateToolchain] = Field(default_factory=dict)  # graph -> probes, variants, ops, ATC
    verification: VerifyReport | None = None
    # The same main path with every spliced graph in its chosen ATC precision mode, emulated on CPU.
    verification_emulated: VerifyReport | None = None

    def decide(self, by: str, what: str, why: str) -> None:
        self.decisions.append(Decision(at=now_iso(), by=by, what=what, why=why))

    # -- queries the stages share --------------------------------------------------------------

    def selected(self, candidate: str | None = None) -> list[str]:
        """The plan's first batch, or the one candidate named (which must be in the plan)."""
        if self.plan is None:
            raise StageError("no plan in the task record: run plan_candidates first")
        if candidate is None:
            return list(self.plan.first_batch)
        if self.plan.candidate(candidate) is None:
            known = ", ".join(c.name for c in self.plan.candidates)
            raise StageError(f"candidate {candidate!r} is not in the plan (known: {known})")
        return [candidate]

    def contracts_of(self, candidate: str) -> list[ContractSpec]:
        """The contracts of a plan candidate: one, or one per value it is dispatched on."""
        return [c for c in self.contracts.values() if c.plan_candidate == candidate]

    def graphs(self, candidate: str | None = None) -> list[str]:
        """Graph names of the first batch, of the plan candidate named, or the graph named itself."""
        if candidate is not None and candidate in self.contracts:
            return [candidate]
        graphs = []
        for name in self.selected(candidate):
            found = self.contracts_of(name)
            if not found:
                raise StageError(f"no contract for candidate {name!r}: it was never called on the main path "
                                 "(run capture_contracts)")
            graphs += [c.candidate for c in found]
        return graphs

    def contract(self, graph: str) -> ContractSpec:
        if graph not in self.contracts:
            raise StageError(f"no contract for candidate {graph!r}: run capture_contracts first")
        return self.contracts[graph]

    def toolchain_of(self, graph: str) -> CandidateToolchain:
        """The graph's stage-3 results (empty when there are none yet); see `chain` to write them."""
        return self.toolchain.get(graph) or CandidateToolchain()

    def chain(self, graph: str) -> CandidateToolchain:
        """The graph's stage-3 results, created in the record when missing, to write into."""
        return self.toolchain.setdefault(graph, CandidateToolchain())

    def batch_split_of(self, graph: str) -> BatchSplit | None:
        """How ONNX Runtime must run this graph's batch here (set by probe_onnx), if not whole."""
        return self.toolchain_of(graph).batch_split

    def model_path(self, workdir: Path, graph: str, variant: str = "original") -> Path:
        """The ONNX file of a graph's export (`original`) or of one of its optimised variants."""
        if variant == "original":
            if graph not in self.exports:
                raise StageError(f"candidate {graph!r} is not exported: run export_onnx first")
            return workdir / self.exports[graph].path
        opt = self.toolchain_of(graph).optimize
        found = next((v for v in (opt.variants if opt else []) if v.name == variant and v.path), None)
        if found is None:
            raise StageError(f"candidate {graph!r} has no {variant!r} variant: run optimize_onnx first")
        return workdir / found.path

    def preferred_model(self, workdir: Path, graph: str) -> Path:
        """The variant optimize_onnx preferred, else the export."""
        opt = self.toolchain_of(graph).optimize
        if opt is not None and opt.preferred_path:
            return workdir / opt.preferred_path
        return self.model_path(workdir, graph)

    def inner_graphs(self) -> list[str]:
        """Graphs of candidates deferred because they run inside a selected one."""
        inner = [c.name for c in (self.plan.candidates if self.plan else []) if c.inside]
        return [c.candidate for name in inner for c in self.contracts_of(name)]

    def promote_inside(self, outer: str) -> list[str]:
        """`outer` cannot be deployed: the outermost of the candidates deferred inside it join the
        first batch (the others now wait inside those). Returns the candidates promoted."""
        if self.plan is None:
            return []
        waiting = [c for c in self.plan.candidates if c.inside == outer]
        promoted = [c for c in waiting if not any(is_ancestor(o.module_path, c.module_path) for o in waiting)]
        for cand in waiting:
            if cand in promoted:
                cand.status, cand.inside = "selected", None
                cand.reason = f"{outer} could not be deployed whole, so its parts are ({cand.share:.1%} of main-path time)"
                self.plan.first_batch.append(cand.name)
            else:
                cand.inside = next(o.name for o in promoted if is_ancestor(o.module_path, cand.module_path))
        return [c.name for c in promoted]

    def plan_candidate_of(self, graph: str) -> Candidate | None:
        name = self.contracts[graph].plan_candidate if graph in self.contracts else graph
        return self.plan.candidate(name) if self.plan else None

    def set_status(self, graph: str, status: str, reason: str | None = None) -> None:
        """Move the plan candidate of `graph` to `status`. A failure's first reason is kept, and a
        candidate stays failed while another of its graphs has a failed step."""
        cand = self.plan_candidate_of(graph)
        if cand is None or (status == "failed" and cand.status == "failed"):
            return
        if status != "failed" and cand.status == "failed" and self._sibling_failed(graph, cand.name):
            return
        cand.status = status  # type: ignore[assignment]
        if reason:
            cand.reason = reason

    def _sibling_failed(self, graph: str, candidate: str) -> bool:
        siblings = {c.candidate for c in self.contracts_of(candidate)} - {graph}
        return any(len(parts := step.split(":")) > 1 and parts[1] in siblings and result.status == "failed"
                   for step, result in self.stages.items())

    @staticmethod
    def workdir(path: str | Path) -> Path:
        return Path(path).resolve().parent


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def validation_problems(err: ValidationError, prefix: str = "") -> str:
    """A pydantic error as "field.path: message; ..." with the fields under `prefix`."""
    problems = []
    for e in err.errors():
        loc = ".".join([prefix] * bool(prefix) + [str(p) for p in e["loc"]]) or "(root)"
        msg = "unknown field" if e["type"] == "extra_forbidden" else e["msg"]
        problems.append(f"{loc}: {msg}")
    return "; ".join(problems)


def _format_validation_error(path: Path, err: ValidationError) -> str:
    return f"task record {path}: " + validation_problems(err)


def _upgraded(data: dict) -> dict:
    """A record of an older schema, brought up to this one: results whose form changed are dropped
    (the stage that wrote them runs again), everything else is kept."""
    if data.get("schema_version", SCHEMA_VERSION) < 2:
        data = {**data, "schema_version": SCHEMA_VERSION, "verification": None}
        data["stages"] = {k: v for k, v in (data.get("stages") or {}).items() if k != "verify"}
    return data


def parse_record(data: object, path: Path) -> TaskRecord:
    if not isinstance(data, dict):
        raise TaskRecordError(f"task record {path}: expected a mapping at the top level")
    if "intake" not in data:
        raise TaskRecordError(f"task record {path}: intake: field required (model, inputs, target)")
    data = _upgraded(data)
    try:
        return TaskRecord.model_validate(data)
    except ValidationError as err:
        raise TaskRecordError(_format_validation_error(path, err)) from None


def load_record(path: str | Path) -> TaskRecord:
    path = Path(path)
    if not path.is_file():
        raise TaskRecordError(f"task record not found: {path}")
    try:
        data = yaml.load(path.read_text(), Loader=_Loader)
    except yaml.YAMLError as err:
        raise TaskRecordError(f"task record {path}: not valid YAML ({err})") from None
    return parse_record(data, path)


def save_record(record: TaskRecord, path: str | Path) -> None:
    """Write atomically: a crash mid-write leaves the previous record intact."""
    path = Path(path)
    text = yaml.dump(record.model_dump(mode="json", exclude_none=False), Dumper=_Dumper, sort_keys=False, allow_unicode=True)
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
