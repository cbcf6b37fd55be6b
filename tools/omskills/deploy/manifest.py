"""The deployment manifest: read from a verified task record, or from a bundle (checked on load)."""

from __future__ import annotations

import json
from pathlib import Path

from omskills.errors import OmskillsError
from omskills.files import inside_without_links, sha256_file
from omskills.models.registry import model_paths
from omskills.records.deploy import (
    BUNDLE_FORMAT,
    Artifact,
    ArtifactFile,
    DeployedGraph,
    DeployedMerge,
    DeployManifest,
    onnx_files,
)
from omskills.records.names import STORED
from omskills.records.task import SCHEMA_VERSION, TaskRecord, load_record, now_iso, validation_problems
from omskills.records.traffic import MergedGraph
from omskills.version import __version__
from pydantic import ValidationError

MANIFEST_NAME = "bundle.json"


class DeployError(OmskillsError):
    """An adaptation cannot be deployed as asked: not verified, a missing or changed artifact, a bad bundle."""


def manifest_from_record(task_path: Path) -> DeployManifest:
    """What the verified adaptation deploys: every graph verify_main_path integrated (no fallback),
    with paths relative to the run folder."""
    record = load_record(task_path)
    workdir = TaskRecord.workdir(task_path)
    verification = record.verification
    if verification is None:
        raise DeployError(
            f"{task_path}: the adaptation is not verified; run verify_main_path (or `omskills adapt`) first"
        )
    integrated = [c.name for c in verification.candidates if c.status == "integrated"]
    not_deployed = dict(verification.not_spliced)
    not_deployed |= {
        c.name: f"fell back to PyTorch in verify_main_path ({c.fallbacks} of {c.calls} calls)"
        for c in verification.candidates
        if c.status != "integrated"
    }
    graphs = [graph_from_record(record, workdir, name) for name in integrated]
    merged = [
        merge_from_record(workdir, m)
        for m in (verification.merged.graphs if verification.merged else [])
        if m.status == "verified" and set(m.graphs) <= set(integrated)
    ]
    return DeployManifest(
        contract_schema=SCHEMA_VERSION,
        omskills_version=__version__,
        task_id=record.id,
        created=now_iso(),
        intake=record.intake,
        weights=verification.weights,
        verified=f"{verification.verdict}: {verification.main_path.summary()}",
        graphs=graphs,
        merged=merged,
        not_deployed=not_deployed,
    )


def merge_from_record(workdir: Path, merged: MergedGraph) -> DeployedMerge:
    """A verified chain of composed graphs as a deployment sees it (paths relative to `workdir`)."""
    return DeployedMerge(
        name=merged.name,
        graphs=merged.graphs,
        io_maps=merged.io_maps,
        prefixes=merged.prefixes,
        recipes=merged.recipes,
        slots=merged.slots,
        onnx=Artifact(files=[_file(workdir, path, None) for path in onnx_files(workdir / str(merged.onnx_path))]),
        precision_mode=merged.precision_mode,
        atc_script=merged.atc_script,
    )


def graph_from_record(record: TaskRecord, workdir: Path, name: str) -> DeployedGraph:
    """One exported graph of the record as a deployment sees it (paths relative to `workdir`)."""
    contract = record.contract(name)
    chain = record.toolchain_of(name)
    atc = chain.atc
    om = None
    if atc is not None and atc.status == "converted" and atc.om_path:
        om = Artifact(files=[_file(workdir, Path(atc.om_path), None)])
    precision = chain.precision
    return DeployedGraph(
        name=name,
        plan_candidate=contract.plan_candidate,
        module_path=contract.module_path,
        contract=contract,
        strategy=record.boundaries[name].shape_strategy if name in record.boundaries else None,
        batch_split=chain.batch_split,
        batch_independence=chain.batch_independence,
        onnx=Artifact(files=[_file(workdir, path, None) for path in onnx_files(record.preferred_model(workdir, name))]),
        om=om,
        precision_mode=precision.chosen_mode if precision else None,
        keep_dtype_nodes=list(precision.chosen_keep) if precision else [],
        atc_script=_relative(workdir, Path(atc.script)) if atc is not None else None,
    )


def _file(root: Path, path: Path, sha256: str | None) -> ArtifactFile:
    full = path if path.is_absolute() else root / path
    if not full.is_file():
        raise DeployError(f"artifact missing: {full}")
    return ArtifactFile(path=_relative(root, full), bytes=full.stat().st_size, sha256=sha256)


def _relative(root: Path, path: Path) -> str:
    full = path if path.is_absolute() else root / path
    try:
        return full.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return str(full)  # outside the run folder (an OM written elsewhere): kept as it is


def read_bundle(root: Path, check_hashes: bool = True) -> DeployManifest:
    """The bundle's manifest, after checking its format, its contracts' schema and every artifact."""
    path = root / MANIFEST_NAME
    if path.is_symlink():
        raise DeployError(f"{path} is a symbolic link: refused, a bundle's manifest is a file of its own")
    if not path.is_file():
        raise DeployError(
            f"{root} is not an omskills bundle: {path} is missing (write one with `omskills bundle TASK`)"
        )
    try:
        data = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DeployError(f"{path}: not valid JSON ({err})") from None
    except RecursionError:
        raise DeployError(f"{path}: nested deeper than a bundle's manifest ever is: refused") from None
    if isinstance(data, dict) and data.get("format") != BUNDLE_FORMAT:
        raise DeployError(
            f"{path}: bundle format {data.get('format')!r}, this omskills reads format {BUNDLE_FORMAT}; "
            "write the bundle again with this version"
        )
    try:
        manifest = DeployManifest.model_validate(data, context=STORED)
    except ValidationError as err:
        raise DeployError(f"{path}: {validation_problems(err)}") from None
    if manifest.contract_schema != SCHEMA_VERSION:
        raise DeployError(
            f"{path}: contracts written under schema {manifest.contract_schema}, this omskills reads "
            f"schema {SCHEMA_VERSION}; write the bundle again with this version"
        )
    for graph in manifest.graphs:
        for artifact in (graph.onnx, graph.om):
            for file in artifact.files if artifact else []:
                check_file(root, file, graph.name, check_hashes)
        if graph.remembered is not None:
            check_file(root, graph.remembered, graph.name, check_hashes)
    for merged in manifest.merged:
        for file in merged.onnx.files:
            check_file(root, file, merged.name, check_hashes)
    _check_model_files(root, manifest)
    return manifest


def _check_model_files(root: Path, manifest: DeployManifest) -> None:
    """The files the bundle's model names (driver file, checkpoint) lie inside it, through no
    symbolic link: checked before the driver is imported. Its inputs are checked once the driver
    says which fields are files (`deploy.adapted.load_adapted`)."""
    for where, value in model_paths(manifest.intake.model):
        try:
            inside_without_links(root, value)
        except ValueError as err:
            raise DeployError(f"{root / MANIFEST_NAME}: {where} {value!r}: {err}") from None


def check_file(root: Path, file: ArtifactFile, graph: str, check_hash: bool) -> None:
    try:
        path = inside_without_links(root, file.path)
    except ValueError as err:
        raise DeployError(f"{graph}: artifact {file.path!r}: {err}") from None
    if not path.is_file():
        raise DeployError(f"{graph}: artifact missing: {path}")
    if check_hash and not file.sha256:
        raise DeployError(f"{graph}: {path}: the bundle records no sha256 for it; write the bundle again")
    if path.stat().st_size != file.bytes:
        raise DeployError(f"{graph}: {path} has changed: {path.stat().st_size} bytes, the bundle recorded {file.bytes}")
    if check_hash and file.sha256 and sha256_file(path) != file.sha256:
        raise DeployError(
            f"{graph}: {path} has changed: its sha256 is not the one the bundle recorded ({file.sha256[:12]}…)"
        )
