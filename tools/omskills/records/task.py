"""The task record: one YAML file per adaptation, validated, written atomically.

Every tool reads it and writes its results back; a rerun resumes from what is done.
Artefacts of a run live in the record's folder (`TaskRecord.workdir(path)`), and every path
stored in the record is relative to that folder, so a copied run folder works on its own files.

Writers go through `updating(path)`: an exclusive lock on the record (`.task.yaml.lock` next to
it, held by one thread of one process at a time) around load, change and save, so concurrent
tools (MCP calls in one server, CLI processes) never lose each other's results. A save writes
`stages` after the results it summarises, keeps the file's mode, and keeps the comments a user
wrote in the sections users write (header, `id`, `schema_version`, `intake`).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import hashlib
import io
import json
import os
import re
import stat
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from filelock import FileLock, Timeout
from omskills.errors import OmskillsError, StageError, TaskRecordError
from omskills.files import atomic_write_text
from omskills.records.base import Record
from omskills.records.contracts import BoundaryDecision, ContractSpec, is_ancestor
from omskills.records.details import (
    DetailMissing,
    details_folder,
    is_reference,
    join_details,
    remove_unnamed,
    split_details,
    write_details,
)
from omskills.records.environment import EnvironmentReport
from omskills.records.export import ExportResult
from omskills.records.intake import Intake
from omskills.records.inventory import Inventory
from omskills.records.names import STORED, SafeName
from omskills.records.plan import Candidate, Plan, StudyRun
from omskills.records.precision import PrecisionPlan
from omskills.records.profile import ProfileReport
from omskills.records.stage_order import result_slots
from omskills.records.stages import Decision, StageResult
from omskills.records.step_owner import active_steps, interrupted_reason, no_owner, settle_interrupted
from omskills.records.toolchain import BatchSplit
from omskills.records.toolchain_stage import CandidateToolchain
from omskills.records.verify import VerifyReport
from pydantic import Field, PrivateAttr, TypeAdapter, ValidationError

# 2: verification is judged by the driver's output checks (per step), not by frames and masks.
SCHEMA_VERSION = 2

# libyaml's safe loader and dumper when PyYAML was built with it: records reach hundreds of KB,
# which the pure-Python ones take a second to read.
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_Dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
BOM = "\ufeff"
# Nodes that YAML aliases may add to a record beyond those written out: a record has no use for
# aliases, and a few hundred bytes of nested ones expand to billions of nodes ("billion laughs").
MAX_ALIAS_NODES = 1000


class _RecordLoader(_Loader):  # type: ignore[misc, valid-type]
    """The safe loader, refusing a mapping that gives one key twice (YAML keeps the last silently:
    a user's edit above would be lost without a word)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (lines {seen[key]} and {line}): keep one", key_node.start_mark
                )
            seen[key] = line
        return super().construct_mapping(node, deep)


def load_yaml(text: str) -> Any:
    """A task record's YAML: the safe loader, no duplicate key, aliases bounded (`_check_aliases`)."""
    loader = _RecordLoader(text.removeprefix(BOM))
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_aliases(node)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _check_aliases(root: yaml.Node) -> None:
    """The document expanded (an alias copies what its anchor holds) is at most MAX_ALIAS_NODES
    nodes more than written, and no alias refers to a node that holds it. Counted without
    expanding anything: each distinct node's expanded size once, iteratively (a deep document
    must not exhaust Python's stack)."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()  # being sized: an alias back to one of them is a cycle
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, closing = stack.pop()
        key = id(node)
        if closing:
            open_nodes.discard(key)
            sizes[key] = 1 + sum(sizes[id(child)] for child in _children(node))
        elif key in open_nodes:
            raise yaml.YAMLError("a YAML alias refers to a node that contains it: a task record cannot be recursive")
        elif key not in sizes:
            open_nodes.add(key)
            stack.append((node, True))
            stack.extend((child, False) for child in _children(node))
    if sizes[id(root)] - len(sizes) > MAX_ALIAS_NODES:
        raise yaml.YAMLError(
            f"YAML aliases expand the document by {sizes[id(root)] - len(sizes)} nodes, more than "
            f"the {MAX_ALIAS_NODES} a task record may hold (it needs none)"
        )


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


class TaskRecord(Record):
    schema_version: int = SCHEMA_VERSION
    # It names run folders and files (`runs/<id>-<scale>`, a fleet's `<id>/`): a file name's length.
    id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", max_length=120)
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
    contracts: dict[SafeName, ContractSpec] = Field(default_factory=dict)
    boundaries: dict[SafeName, BoundaryDecision] = Field(default_factory=dict)  # graph -> boundary decision
    exports: dict[SafeName, ExportResult] = Field(default_factory=dict)  # graph -> its ONNX export
    toolchain: dict[SafeName, CandidateToolchain] = Field(default_factory=dict)  # graph -> probes, variants, ops, ATC
    verification: VerifyReport | None = None
    # The same main path with every spliced graph in its chosen ATC precision mode, emulated on CPU.
    verification_emulated: VerifyReport | None = None
    # That check as a plan: the modes that passed end to end, and what was moved to get there.
    precision_plan: PrecisionPlan | None = None
    # The text the record was read from when it carries comments: a save keeps the user's comments
    # even into a new file (`omskills adapt` copies the intake into the run folder).
    _source_text: str | None = PrivateAttr(default=None)
    # The steps the loader found `running` with their process gone, and marked interrupted.
    _interrupted: list[str] = PrivateAttr(default_factory=list)

    @property
    def interrupted_on_load(self) -> list[str]:
        """The steps the record said were `running` whose process was gone when it was read: read
        (and saved, by the next writer) as failed, interrupted (`records.step_owner`)."""
        return list(self._interrupted)

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
                raise StageError(
                    f"no contract for candidate {name!r}: it was never called on the main path (run capture_contracts)"
                )
            graphs += [c.candidate for c in found]
        return graphs

    def contract(self, graph: str) -> ContractSpec:
        if graph not in self.contracts:
            raise StageError(f"no contract for candidate {graph!r}: run capture_contracts first")
        return self.contracts[graph]

    def weights(self) -> str:
        """The weights the model ran with: their label at the study (`omskills.models.weights`), else
        the intake's checkpoint, else "random" (seeded random initialisation)."""
        if self.study is not None and self.study.weights:
            return self.study.weights
        return self.intake.model.checkpoint or "random"

    def toolchain_of(self, graph: str) -> CandidateToolchain:
        """The graph's stage-3 results (empty when there are none yet); see `toolchain_entry` to write them."""
        return self.toolchain.get(graph) or CandidateToolchain()

    def toolchain_entry(self, graph: str) -> CandidateToolchain:
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
                cand.reason = (
                    f"{outer} could not be deployed whole, so its parts are ({cand.share:.1%} of main-path time)"
                )
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
        return any(
            len(parts := step.split(":")) > 1 and parts[1] in siblings and result.status == "failed"
            for step, result in self.stages.items()
        )

    def missing_results(self, step: str) -> list[str]:
        """What a step marked done should have written and the record lacks: a record cut short, or
        edited, says a stage is done whose results are gone. The slots come from the step's
        declaration (`records.stage_order`)."""
        kind, _, rest = step.partition(":")
        if kind == "boundaries":
            return self._missing_boundaries(rest or None)
        missing = [slot for slot in result_slots(step) if self._slot(slot) is None]
        if kind == "study" and self.study is not None:
            lost = [name for name in self.study.contracts_captured if name not in self.contracts]
            missing += [f"contracts for {', '.join(lost)}"] if lost else []
        return missing

    def _slot(self, dotted: str) -> object | None:
        """The value at a dotted path of the record ("toolchain.x.probes.original"), None when empty."""
        value: object = self
        for part in dotted.split("."):
            value = value.get(part) if isinstance(value, dict) else getattr(value, part, None)
            if value is None:
                return None
        return value

    def _missing_boundaries(self, candidate: str | None) -> list[str]:
        try:
            names = self.graphs(candidate) + (self.inner_graphs() if candidate is None else [])
        except StageError as err:
            return [str(err)]
        lost = [name for name in names if name not in self.boundaries]
        return [f"boundaries for {', '.join(lost)}"] if lost else []

    @staticmethod
    def workdir(path: str | Path) -> Path:
        return Path(path).resolve().parent


def now_iso() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


def validation_problems(err: ValidationError, prefix: str = "") -> str:
    """A pydantic error as "field.path: message; ..." with the fields under `prefix`."""
    problems = []
    for e in err.errors():
        loc = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in [prefix] * bool(prefix) + list(e["loc"]))
        loc = loc.removeprefix(".") or "(root)"
        msg = "unknown field" if e["type"] == "extra_forbidden" else str(e["msg"]).removeprefix("Value error, ")
        problems.append(f"{loc}: {msg}")
    return "; ".join(problems)


def _format_validation_error(path: Path, err: ValidationError) -> str:
    return f"task record {path}: " + validation_problems(err)


def _upgraded(data: dict, folder: Path) -> dict:
    """A record of an older schema or form, brought up to this one: results whose form changed are
    dropped (the stage that wrote them runs again), everything else is kept. `folder`: the record's."""
    if data.get("schema_version", SCHEMA_VERSION) < 2:
        data = {**data, "schema_version": SCHEMA_VERSION, "verification": None}
        data["stages"] = {k: v for k, v in (data.get("stages") or {}).items() if k != "verify"}
    _relative_merged_commands(data, folder)
    for result in (data.get("stages") or {}).values():
        if isinstance(result, dict):
            result.pop("finished", None)  # once recorded beside `started` and `seconds`, which say it
    return data


def _relative_merged_commands(data: dict, folder: Path) -> None:
    """Merged graphs' ATC commands were once recorded with absolute paths into the run folder:
    made relative to it, as every recorded path (one pointing elsewhere stays, and is refused)."""
    for report in (data.get(k) for k in ("verification", "verification_emulated")):
        merged = report.get("merged") if isinstance(report, dict) else None
        graphs = merged.get("graphs") if isinstance(merged, dict) else None
        for graph in graphs if isinstance(graphs, list) else []:
            command = graph.get("atc_command") if isinstance(graph, dict) else None
            if isinstance(command, list):
                graph["atc_command"] = [_relative_option(arg, folder) for arg in command]


def _relative_option(arg: object, folder: Path) -> object:
    key, sep, value = arg.partition("=") if isinstance(arg, str) else ("", "", "")
    if not (sep and value.startswith("/")):
        return arg
    root = folder.resolve()
    try:
        return f"{key}={Path(value).relative_to(root).as_posix()}"
    except ValueError:
        return arg


def parse_record(data: object, path: Path) -> TaskRecord:
    if not isinstance(data, dict):
        raise TaskRecordError(f"task record {path}: expected a mapping at the top level")
    if "intake" not in data:
        raise TaskRecordError(f"task record {path}: intake: field required (model, inputs, target)")
    version = data.get("schema_version", SCHEMA_VERSION)
    if type(version) is not int:
        raise TaskRecordError(
            f"task record {path}: schema_version: {version!r} is not a version number "
            f"(this release reads {SCHEMA_VERSION})"
        )
    if version > SCHEMA_VERSION:
        raise TaskRecordError(
            f"task record {path}: schema_version: {version} is newer than this release reads "
            f"({SCHEMA_VERSION}); update omskills to read it"
        )
    data = _upgraded(data, path.parent)
    join_details(TaskRecord, data, path.parent, path)
    try:
        return TaskRecord.model_validate(data, context=STORED)
    except ValidationError as err:
        raise TaskRecordError(_format_validation_error(path, err)) from None


def load_record(path: str | Path) -> TaskRecord:
    """Read without locking: saves replace the file whole, so a reader sees one version or the next
    (and when a detail file it names was replaced meanwhile, it reads the next version)."""
    path = Path(path)
    for attempt in range(3):
        text = _record_text(path)
        try:
            record = parse_record(_parsed_data(path, text), path)
        except DetailMissing:
            if attempt == 2 or _record_text(path) == text:
                raise
            continue
        if "#" in text:
            record._source_text = text
        # Every reader sees a step whose process is gone as interrupted, never as running.
        record._interrupted = settle_interrupted(record.stages, path)
        return record
    raise AssertionError("unreachable")


def _record_text(path: Path) -> str:
    if not path.is_file():
        if path.exists():  # a folder, a FIFO (reading it would block), a device
            raise TaskRecordError(f"task record {path} is not a regular file")
        raise TaskRecordError(f"task record not found: {path}")
    try:
        return path.read_text(encoding="utf-8").removeprefix(BOM)  # an editor's byte-order mark says nothing
    except UnicodeDecodeError as err:
        raise TaskRecordError(f"task record {path}: not UTF-8 text (byte {err.start}: {err.reason})") from None


# Parsing a record's YAML is most of a step's bookkeeping (0.3 s for a 480 KB record, read several
# times per candidate per step), and one process mostly reads back what it wrote itself. So the
# data of the last text read or written at each path is kept as JSON (5 ms to load), keyed by a
# digest of that text: any other text at the path, whoever wrote it, is parsed afresh.
_known_text: dict[Path, tuple[bytes, str]] = {}
_known_lock = threading.Lock()  # tools of one server run in threads
KNOWN_TEXTS_KEPT = 8  # a long-lived server touches many runs: keep the most recent records only


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()


def _remember(path: Path, text: str, data: dict, as_json: str | None = None) -> None:
    key, entry = path.resolve(), (_digest(text), as_json if as_json is not None else json.dumps(data))
    with _known_lock:
        _known_text.pop(key, None)
        _known_text[key] = entry
        while len(_known_text) > KNOWN_TEXTS_KEPT:
            del _known_text[next(iter(_known_text))]


def _parsed_data(path: Path, text: str) -> Any:
    known = _known_text.get(path.resolve())
    if known is not None and known[0] == _digest(text):
        return json.loads(known[1])
    try:
        data = load_yaml(text)
    except yaml.YAMLError as err:  # PyYAML's message spans lines: one line, as every error here
        raise TaskRecordError(f"task record {path}: not valid YAML ({' '.join(str(err).split())})") from None
    as_json = _as_json(data) if isinstance(data, dict) else None
    if as_json is not None:
        _remember(path, text, data, as_json)
    return data


def _as_json(data: dict) -> str | None:
    """`data` as JSON, or None when JSON cannot hold it as YAML gave it (dates or non-string keys
    a user may write)."""
    try:
        as_json = json.dumps(data)
    except (TypeError, ValueError):
        return None
    return as_json if json.loads(as_json) == data else None


# A writer that waits longer than this for the record is stuck behind a hung one: say so.
LOCK_TIMEOUT_S = 600.0


def record_lock(path: str | Path) -> FileLock:
    """The record's write lock: one per record path and process (re-entrant in one thread), held
    across processes through flock on `.<name>.lock` next to the record."""
    path = Path(path).resolve()
    return FileLock(
        path.with_name(f".{path.name}.lock"), timeout=LOCK_TIMEOUT_S, is_singleton=True, preserve_lock_file=True
    )


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    try:
        with record_lock(path):
            yield
    except Timeout:
        raise TaskRecordError(
            f"task record {path}: another writer has held it for {LOCK_TIMEOUT_S:.0f} s; is a tool stuck on it?"
        ) from None
    except OSError as err:  # filelock opens its file without following a link (ELOOP)
        if err.errno != errno.ELOOP:
            raise
        raise TaskRecordError(
            f"task record {path}: its lock file {err.filename} is a symbolic link: refused, a lock file is never "
            "opened through one"
        ) from None


def save_record(record: TaskRecord, path: str | Path) -> None:
    """Write atomically under the record's lock: a crash mid-write leaves the previous record intact.
    Prefer `updating`, which also holds the lock while the record is read and changed."""
    path = Path(path)
    # Its mode says no one may write it (root could; a replace would not even ask): respected.
    if path.is_file() and not path.stat().st_mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH):
        raise TaskRecordError(f"task record {path} is read-only: not saved (make it writable, or copy it)")
    with _locked(path):
        previous = path.read_text(encoding="utf-8").removeprefix(BOM) if path.is_file() else None
        template = previous if previous is not None and "#" in previous else record._source_text
        data = _record_data(record)
        folder = details_folder(path)
        details = split_details(TaskRecord, data, folder, untouched=AUTHORED)
        write_details(path.parent, details)
        text = _render(data, template)
        atomic_write_text(path, text)
        remove_unnamed(path.parent, folder, details)
        _remember(path, text, data)
    record._source_text = text if "#" in text else None


@contextlib.contextmanager
def updating(path: str | Path) -> Iterator[TaskRecord]:
    """Lock, load, let the caller change, save atomically, unlock. Nothing is saved if the body
    raises. Keep the body short (no model runs): every other writer of the record waits for it."""
    path = Path(path)
    with _locked(path):
        record = load_record(path)
        yield record
        save_record(record, path)


def settle_on_disk(path: str | Path) -> list[str]:
    """The record saved when its loader found steps `running` whose process is gone, so that its
    text, not only the loaded record, says they were interrupted (for readers of the file itself,
    such as an MCP client reading `task://`). The steps settled; nothing is written otherwise."""
    if not load_record(path).interrupted_on_load:
        return []
    with updating(path) as record:
        return record.interrupted_on_load


def record_interrupted_here(how: str, seconds: float = 2.0) -> list[str]:
    """The steps this process runs now recorded as failed, interrupted `how`, with the command that
    redoes each: for a process about to exit without waiting for them (a server shutting down while
    a step is deep in a model call). Written from a thread of its own, waited for at most about
    `seconds`: the caller may be a signal handler that interrupted the holder of a lock a save
    takes. A step that ends meanwhile keeps its own end. The names of the steps recorded."""
    marked: list[str] = []

    def mark() -> None:
        for path, step in active_steps():
            with contextlib.suppress(OmskillsError, OSError, Timeout):
                if _mark_interrupted(Path(path), step, how, seconds):
                    marked.append(step)

    worker = threading.Thread(target=mark, name="omskills interrupted steps", daemon=True)
    worker.start()
    worker.join(seconds + 1.0)
    return list(marked)


def _mark_interrupted(path: Path, step: str, how: str, seconds: float) -> bool:
    with record_lock(path).acquire(timeout=seconds), updating(path) as record:
        result = record.stages.get(step)
        if result is None or result.status != "running" or result.pid != os.getpid():
            return False
        result.status, result.error = "failed", interrupted_reason(step, path, how)
        for name, value in no_owner().items():
            setattr(result, name, value)
        return True


# -- the YAML text -----------------------------------------------------------------------------

# Sections a user writes in a task record: their comments are kept when the record is saved.
AUTHORED = ("schema_version", "id", "intake")
_TOP_KEY = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*):(?:[ \t]|$)")


class _RecordDumper(_Dumper):  # type: ignore[misc, valid-type]
    """Block style, except a short collection of scalars, which takes one line
    (`shape: [1, 3, 1008, 1008]`): a block for every shape and gear would make the record
    several times longer for nothing."""

    def represent_mapping(self, tag: str, mapping: Any, flow_style: bool | None = None) -> yaml.MappingNode:
        node = super().represent_mapping(tag, mapping, flow_style)
        # A detail file's reference is one entry, however long its hash.
        node.flow_style = is_reference(mapping) or _one_line(node.value)
        return node

    def represent_sequence(self, tag: str, sequence: Any, flow_style: bool | None = None) -> yaml.SequenceNode:
        node = super().represent_sequence(tag, sequence, flow_style)
        node.flow_style = _one_line([(item,) for item in node.value])
        return node


# A collection of scalars whose text is at most this long goes on one line.
ONE_LINE_CHARS = 110


class _Entry(dict):
    """An entry of a log section: one flow mapping, wrapped at the width, not a block of fields."""


def _represent_entry(dumper: _RecordDumper, entry: _Entry) -> yaml.MappingNode:
    node = dumper.represent_mapping("tag:yaml.org,2002:map", dict(entry))
    node.flow_style = True
    return node


_RecordDumper.add_representer(_Entry, _represent_entry)

# Sections that are logs (what was decided, how each step went): an entry each, read line by line.
LOG_SECTIONS = ("decisions", "stages")


def _as_entries(key: str, value: Any) -> Any:
    if key not in LOG_SECTIONS:
        return value
    if isinstance(value, list):
        return [_Entry(item) if isinstance(item, dict) else item for item in value]
    if isinstance(value, dict):
        return {name: _Entry(item) if isinstance(item, dict) else item for name, item in value.items()}
    return value


def _one_line(entries: list) -> bool:
    scalars = [part for entry in entries for part in entry]
    if not all(isinstance(part, yaml.ScalarNode) for part in scalars):
        return False
    return sum(len(str(part.value)) + 3 for part in scalars) <= ONE_LINE_CHARS


def _dump(data: Any) -> str:
    # A section of one scalar (`id: x`) stays `key: value`, not a one-line mapping.
    one_scalar = isinstance(data, dict) and not any(isinstance(v, (dict, list)) for v in data.values())
    dumper_class = _Dumper if one_scalar else _RecordDumper
    return yaml.dump(data, Dumper=dumper_class, sort_keys=False, allow_unicode=True, width=120)


# The last YAML written for each top-level section, by the section's JSON: a save re-renders only
# the sections that changed (a step changes one or two of a dozen).
_section_yaml: dict[str, tuple[str, str]] = {}


def _dump_section(key: str, value: Any) -> str:
    """`{key: value}` as YAML: the same text as that key's part of the whole mapping dumped at once."""
    as_json = json.dumps(value)
    known = _section_yaml.get(key)
    if known is not None and known[0] == as_json:
        return known[1]
    text = _dump({key: _as_entries(key, value)})
    _section_yaml[key] = (as_json, text)
    return text


def _record_data(record: TaskRecord) -> dict:
    """The record as plain data, `stages` last: written after the results it summarises, a record
    cut short loses the stage first and the step runs again. Checked as a load checks it (a path a
    step left absolute is refused here, before the file changes)."""
    data = record.model_dump(mode="json", exclude_none=False)
    try:
        TaskRecord.model_validate(data, context=STORED)
    except ValidationError as err:
        raise TaskRecordError(f"task record {record.id}: not saved: {validation_problems(err)}") from None
    data["stages"] = data.pop("stages")
    return data


def render_record(record: TaskRecord, template: str | None = None) -> str:
    """The record as YAML, its details inline. With a `template` (the text the record was read
    from) its header comments and the authored sections' comments are kept."""
    data = _record_data(record)
    split_details(TaskRecord, data, None, untouched=AUTHORED)
    return _render(data, template)


def _render(data: dict, template: str | None) -> str:
    split = _sections(template) if template is not None else None
    header, old = split if split is not None else ("", {})
    parts = [header]
    for key, value in data.items():
        text = old.get(key) if key in AUTHORED else None
        parts.append(
            _authored_section(key, value, text) if text is not None and "#" in text else _dump_section(key, value)
        )
    return "".join(parts)


def _sections(text: str) -> tuple[str, dict[str, str]] | None:
    """The comments before the first key, and each top-level key's text (the comment lines just
    above it included); None when the text is not one block mapping that splits cleanly."""
    header: list[str] = []
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    pending: list[str] = []
    for line in text.splitlines(keepends=True):
        if line.startswith(("---", "...")) and current is not None:
            return None  # a second document
        key = _TOP_KEY.match(line)
        if key:
            if key.group(1) in sections:
                return None
            if current is None:
                header, pending = header + pending, []
            current = sections[key.group(1)] = pending + [line]
            pending = []
        elif not line.strip() or line.startswith("#") or (current is None and line.startswith("---")):
            pending.append(line)
        elif current is None:
            return None  # content before the first key: not a block mapping
        else:
            current += pending + [line]
            pending = []
    if current is not None:
        current += pending
    else:
        header += pending
    return "".join(header), {key: "".join(lines) for key, lines in sections.items()}


def _authored_section(key: str, value: Any, text: str) -> str:
    """An authored section with its comments: the old text itself when it still says the same
    (as validated), else the old text's comments and layout with the new values (ruamel.yaml's
    round trip; only these small sections pay for it)."""
    try:
        old = load_yaml(text)
    except yaml.YAMLError:
        return _dump({key: value})
    if not isinstance(old, dict) or list(old) != [key]:
        return _dump({key: value})
    if _canonical(key, old[key]) == value:
        return text if text.endswith("\n") else text + "\n"
    from ruamel.yaml import YAML

    round_trip = YAML(typ="rt")
    round_trip.preserve_quotes = True
    round_trip.representer.add_representer(type(None), _represent_null)
    doc = round_trip.load(text)
    doc[key] = _merged(doc[key], value)
    out = io.StringIO()
    round_trip.dump(doc, out)
    return out.getvalue()


def _represent_null(representer: Any, _value: None) -> Any:
    return representer.represent_scalar("tag:yaml.org,2002:null", "null")  # as PyYAML writes it, not empty


def _canonical(key: str, value: Any) -> Any:
    """`value` as the record would store it (defaults filled in), or itself when it is not valid."""
    adapter = TypeAdapter(TaskRecord.model_fields[key].annotation)
    try:
        return adapter.dump_python(adapter.validate_python(value), mode="json")
    except ValidationError:
        return value


def _merged(old: Any, new: Any) -> Any:
    """`new`, written into ruamel's `old` node where their shapes agree, so comments stay attached."""
    if isinstance(old, dict) and isinstance(new, dict):
        for gone in [k for k in old if k not in new]:
            del old[gone]
        for k, v in new.items():
            old[k] = _merged(old[k], v) if k in old else v
        return old
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        for i, v in enumerate(new):
            old[i] = _merged(old[i], v)
        return old
    # Equal values keep ruamel's node (its quotes and style); True is not kept for 1, nor 1 for True.
    same = old == new and isinstance(old, type(new)) and isinstance(old, bool) == isinstance(new, bool)
    return old if same else new
