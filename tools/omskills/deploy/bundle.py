"""`omskills bundle TASK`: one self-contained folder to deploy a verified adaptation from.

    bundle/
      bundle.json            the manifest: graphs, contracts, shape strategies, sha256 of every file
      README.md              what is inside, how to run it, on which backend
      example.py             the main path through the public API (`python example.py --backend om`)
      graphs/<graph>/        the ONNX (and its external weights), the OM when ATC built one
      contracts/<graph>.json the contract and shape strategy of each graph
      atc/<graph>.sh         the ATC command of each graph, paths relative to the bundle
      weights/, inputs/, driver/   the checkpoint, input files and driver file the record names
      memo/<graph>.npz       with --precompute: outputs computed ahead for inputs known now

Every path inside is relative, so the folder can be moved or copied to the Ascend host. Files are
hard-linked from the run folder where the file system allows it (a full-scale bundle would
otherwise copy gigabytes), else copied; each one's bytes are hashed as placed and checked against
the hash the run recorded for it.

The bundle is written beside `--out` and renamed into place: a folder is replaced only when it is
a bundle this command wrote (its `.omskills-bundle` marker lists every file it wrote) and holds
nothing else, so no file of the user's is ever removed.
"""

from __future__ import annotations

import glob
import os
import re
import secrets
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, get_args

import numpy as np
from omskills.ascend.atc import atc_script
from omskills.deploy.manifest import MANIFEST_NAME, DeployError, manifest_from_record
from omskills.errors import OmskillsError
from omskills.files import process_alive, sha256_file
from omskills.models.api import with_input_files
from omskills.models.registry import bind_intake, confine_intake, driver_for, localised_intake
from omskills.records.deploy import Artifact, ArtifactFile, DeployedGraph, DeployedMerge, DeployManifest
from omskills.records.intake import allowed_input_roots
from omskills.records.literals import BundleArtifact
from omskills.records.names import STORED
from omskills.records.results import BundleSummary, RememberedGraph
from omskills.records.task import TaskRecord, load_record
from omskills.report.render import template_environment
from omskills.run_folder import RunFolder
from omskills.splicing.memo import MAX_OUTPUT_BYTES, MemoEntry, save_entries, why_not_memoisable

ARTIFACTS: tuple[str, ...] = get_args(BundleArtifact)


def write_bundle(
    task_path: Path,
    out: Path | None = None,
    *,
    artifact: str = "auto",
    weights: bool = True,
    precompute: Sequence[Mapping[str, Any]] = (),
) -> BundleSummary:
    """Write the bundle of the verified adaptation `task_path` into `out` (default: <run>/bundle).

    artifact: "onnx" (no OM), "om" (every graph's OM, which each must have) or "auto" (the OMs
    ATC built); the ONNX files always come too (the contracts' reference and the ATC scripts'
    input). weights: copy the checkpoint (else the loader must be given `checkpoint=`).
    precompute: input sets (fields of intake.inputs, e.g. {"prompt": "a red car"}) the deployment
    will meet: the main path runs once on each, and the outputs of every graph whose inputs derive
    from user inputs and the model's constants alone (a text tower) go into the bundle, so the
    deployed model answers those calls from memory; the summary says why for every other graph."""
    if artifact not in ARTIFACTS:
        raise DeployError(f"artifact: {artifact!r} is not one of {list(ARTIFACTS)}")
    task_path = Path(task_path)
    workdir = TaskRecord.workdir(task_path)
    manifest = manifest_from_record(task_path)
    missing_om = [g.name for g in manifest.graphs if g.om is None]
    if artifact == "om" and missing_om:
        raise DeployError(
            f"artifact 'om': no OM was built for {missing_om}; run their ATC scripts where CANN is "
            "installed (convert_atc), or bundle the ONNX files (--artifact onnx)"
        )
    out = Path(out) if out else workdir / "bundle"
    _check_replaceable(out)
    record = load_record(task_path)
    _remove_dead_staging(out)
    staging = _new_staging(out, "writing")
    try:
        writer = _Writer(workdir, staging, _recorded_hashes(record))
        graphs = [writer.graph(graph, artifact, record) for graph in manifest.graphs]
        merged = [writer.merged(m, record) for m in manifest.merged]
        remembered, not_remembered = _precomputed(task_path, precompute) if precompute else ({}, {})
        graphs = [writer.remembered(g, remembered[g.name]) if g.name in remembered else g for g in graphs]
        intake, required = writer.intake(record, weights)
        bundled = manifest.model_copy(
            update={"graphs": graphs, "merged": merged, "intake": intake, "required": required}
        )
        text = bundled.model_dump_json(indent=2)
        DeployManifest.model_validate_json(text, context=STORED)  # as its loader will read it
        (staging / MANIFEST_NAME).write_text(text)
        _write_docs(staging, bundled)
        files = sorted(
            p.relative_to(staging).as_posix() for p in staging.rglob("*") if p.is_file() and p.name != STAGING_MARKER
        )
        (staging / MARKER).write_text("\n".join(files) + "\n")
        _replace(out, staging)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    files = [p for p in out.rglob("*") if p.is_file()]
    return BundleSummary(
        path=str(out),
        graphs=[g.name for g in graphs],
        files=len(files),
        bytes=sum(p.stat().st_size for p in files),
        om_graphs=[g.name for g in graphs if g.om],
        not_deployed=bundled.not_deployed,
        required=required,
        remembered={
            g.name: RememberedGraph(entries=len(remembered[g.name]), bytes=g.remembered.bytes, path=g.remembered.path)
            for g in graphs
            if g.remembered is not None
        },
        not_remembered=not_remembered,
    )


def _check_input_sets(task_path: Path, input_sets: Sequence[Mapping[str, Any]]) -> None:
    """Each input set valid for the driver, every path it names inside the run folder or the
    allowed input roots: checked before anything runs."""
    record = load_record(task_path)
    workdir = TaskRecord.workdir(task_path)
    for k, inputs in enumerate(input_sets):
        if not isinstance(inputs, Mapping) or not inputs:
            raise DeployError(f"precompute[{k}]: an input set is a mapping of intake.inputs fields, got {inputs!r}")
        intake = record.intake.model_copy(update={"inputs": record.intake.inputs | dict(inputs)})
        try:
            bind_intake(intake, workdir)
            confine_intake(intake, workdir, allowed_input_roots(workdir))
        except OmskillsError as err:
            raise DeployError(f"precompute[{k}]: {err}") from None


def _precomputed(
    task_path: Path, input_sets: Sequence[Mapping[str, Any]]
) -> tuple[dict[str, list[MemoEntry]], dict[str, str]]:
    """Graph -> the calls it answered on `input_sets` (the deployed model on ONNX Runtime CPU), for
    every graph whose calls may be remembered; and graph -> why none was, for every other graph."""
    from omskills.deploy.adapted import load_adapted

    _check_input_sets(task_path, input_sets)
    found: dict[str, dict[bytes, dict[str, np.ndarray]]] = {}
    with load_adapted(task_path, backend="onnxruntime", providers=["CPUExecutionProvider"]) as model:
        routes = [r for spliced in {id(m): m for m in model.handle.modules.values()}.values() for r in spliced.routes]
        for inputs in input_sets:
            model.run_main_path(inputs)
            for route in routes:  # after each run: a memory holds the last few calls only
                if route.memo is not None:
                    found.setdefault(route.contract.candidate, {}).update(route.memo.entries())
        missing = {
            r.contract.candidate: _why_nothing_remembered(r) for r in routes if not found.get(r.contract.candidate)
        }
    return {graph: list(entries.items()) for graph, entries in found.items() if entries}, missing


def _why_nothing_remembered(route: Any) -> str:
    """Why a graph's memory holds no call after the main path ran on every input set."""
    if route.memo is None:
        return why_not_memoisable(route.contract) or "its calls are not remembered"
    if route.fallback_events:
        return f"its calls fell back to PyTorch ({route.fallback_events[0].reason})"
    if route.calls == 0:
        return "it was not called on the input sets given"
    if route.memo.oversized:
        return f"its outputs are more than the {MAX_OUTPUT_BYTES:,} bytes a memory keeps per call"
    return "its calls were answered inside the composed graph of its merged chain"


# The file a bundle folder carries to say this command wrote it, and which files.
MARKER = ".omskills-bundle"


def _check_replaceable(out: Path) -> None:
    """`out` may be written: it does not exist, is an empty folder, or is a bundle this command
    wrote holding only what it wrote."""
    if out.is_symlink():
        raise DeployError(f"out: {out} is a symbolic link; give the folder itself")
    if not out.exists():
        return
    if not out.is_dir():
        raise DeployError(f"out: {out} is a file, not a folder")
    present = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file() or p.is_symlink()}
    if not present:
        return
    written = set((out / MARKER).read_text().split()) | {MARKER} if (out / MARKER).is_file() else set()
    if not written:
        raise DeployError(f"out: {out} holds files omskills did not write; choose a new or empty folder")
    foreign = sorted(present - written)
    if foreign:
        raise DeployError(
            f"out: {out} holds {len(foreign)} file(s) the bundle did not write ({foreign[0]}, ...); "
            "move them or choose another folder: nothing of yours is removed"
        )


# Inside each folder a bundle write stages in: who made it. Only a folder holding it, naming a
# process that is gone, is removed: a user's folder of a similar name is never touched.
STAGING_MARKER = ".omskills-staging"
_STAGING_NAME = re.compile(r"\.(?P<out>.+)\.(?P<kind>writing|replaced)-(?P<pid>[0-9]{1,10})-(?P<token>[0-9a-f]{16})")


def _new_staging(out: Path, kind: str) -> Path:
    """A folder beside `out` that this process creates (never one that exists), with its marker."""
    out.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(8)
    folder = out.parent / f".{out.name}.{kind}-{os.getpid()}-{token}"
    folder.mkdir()
    (folder / STAGING_MARKER).write_text(f"{os.getpid()} {token}\n")
    return folder


def _remove_dead_staging(out: Path) -> None:
    """Half-written bundles beside `out` whose writer was killed before it could clean up: folders
    this tool made (their name and their marker agree) whose process is gone."""
    for folder in out.parent.glob(f".{glob.escape(out.name)}.*-*-*"):
        match = _STAGING_NAME.fullmatch(folder.name)
        if match is None or match["out"] != out.name or folder.is_symlink() or not folder.is_dir():
            continue
        marker = folder / STAGING_MARKER
        if marker.is_symlink() or not marker.is_file():
            continue
        if marker.read_text(errors="replace").split() == [match["pid"], match["token"]] and not process_alive(
            int(match["pid"])
        ):
            shutil.rmtree(folder, ignore_errors=True)


def _replace(out: Path, staging: Path) -> None:
    """`staging` renamed to `out`; an earlier bundle there (checked by _check_replaceable) goes."""
    (staging / STAGING_MARKER).unlink()
    if out.exists():
        previous = _new_staging(out, "replaced")
        out.rename(previous / "bundle")
        staging.rename(out)
        shutil.rmtree(previous, ignore_errors=True)
    else:
        staging.rename(out)


def _recorded_hashes(record: TaskRecord) -> dict[str, str]:
    """Run-folder path -> the sha256 a step recorded for the file it wrote there."""
    return {a.path: a.sha256 for step in record.stages.values() for a in step.artifacts if a.sha256}


class _Writer:
    def __init__(self, workdir: Path, out: Path, recorded: dict[str, str]) -> None:
        self.workdir = workdir
        self.out = out
        self.recorded = recorded

    def place(self, source: Path, target: str) -> ArtifactFile:
        """`source` at `target` (relative to the bundle), hard-linked or copied, with the hash of
        the bytes placed, which must be those the run recorded for it."""
        if source.is_symlink() or not source.is_file():
            raise DeployError(f"artifact missing or not a regular file: {source}")
        dest = self.out / target
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(source, dest)
        except OSError:  # another file system, or links not allowed
            shutil.copy2(source, dest)
        digest = sha256_file(dest)
        expected = self.recorded.get(_run_relative(self.workdir, source))
        if expected is not None and digest != expected:
            raise DeployError(
                f"artifact {source} changed after the run wrote it (sha256 {digest[:12]}…, recorded "
                f"{expected[:12]}…); rerun the adaptation to redo that step"
            )
        return ArtifactFile(path=target, bytes=dest.stat().st_size, sha256=digest)

    def artifact(self, artifact: Artifact, folder: str) -> Artifact:
        return Artifact(
            files=[self.place(self.in_run(f.path), f"{folder}/{Path(f.path).name}") for f in artifact.files]
        )

    def in_run(self, stored: str) -> Path:
        """A path the record stores, as a file of the run folder reached through no symbolic link."""
        try:
            return RunFolder(self.workdir).file(stored)
        except ValueError as err:
            raise DeployError(f"{stored}: {err}") from None

    def graph(self, graph: DeployedGraph, artifact: str, record: TaskRecord) -> DeployedGraph:
        folder = f"graphs/{graph.name}"
        onnx = self.artifact(graph.onnx, folder)  # always: the contract's reference and the ATC input
        om = self.artifact(graph.om, folder) if graph.om is not None and artifact in ("auto", "om") else None
        (self.out / "contracts").mkdir(exist_ok=True)
        (self.out / "contracts" / f"{graph.name}.json").write_text(
            graph.model_dump_json(include={"name", "module_path", "contract", "strategy"}, indent=2)
        )
        atc = record.toolchain_of(graph.name).atc
        script = self.atc_script(graph.name, onnx, atc.command) if atc is not None and atc.command else None
        return graph.model_copy(update={"onnx": onnx, "om": om, "atc_script": script})

    def merged(self, merged: DeployedMerge, record: TaskRecord) -> DeployedMerge:
        """A verified chain's composed graph, and its ATC script made relative to the bundle."""
        onnx = self.artifact(merged.onnx, f"graphs/{merged.name}")
        built = next(m for m in record.verification.merged.graphs if m.name == merged.name)  # type: ignore[union-attr]
        script = self.atc_script(merged.name, onnx, built.atc_command) if built.atc_command else None
        return merged.model_copy(update={"onnx": onnx, "atc_script": script})

    def remembered(self, graph: DeployedGraph, entries: list[MemoEntry]) -> DeployedGraph:
        """`graph` with the calls computed ahead for it saved beside its files."""
        path = save_entries(self.out / "memo" / f"{graph.name}.npz", entries)
        target = path.relative_to(self.out).as_posix()
        return graph.model_copy(
            update={"remembered": ArtifactFile(path=target, bytes=path.stat().st_size, sha256=sha256_file(path))}
        )

    def atc_script(self, name: str, onnx: Artifact, command: list[str]) -> str:
        """The graph's recorded ATC command with its paths made relative to the bundle."""
        rewritten = []
        for arg in command:
            key, sep, value = arg.partition("=")
            if key == "--model":
                arg = f"--model={onnx.path}"
            elif key == "--output":
                arg = f"--output=graphs/{name}/{Path(value).name}"
            elif key == "--keep_dtype" and sep:
                kept = self.place(self.in_run(value), f"atc/{name}.keep_dtype.cfg")
                arg = f"--keep_dtype={kept.path}"
            rewritten.append(arg)
        target = self.out / "atc" / f"{name}.sh"
        target.parent.mkdir(exist_ok=True)
        target.write_text(atc_script(rewritten, from_own_folder=".."))
        target.chmod(0o755)
        return f"atc/{name}.sh"

    def intake(self, record: TaskRecord, weights: bool):
        """The record's intake with its files inside the bundle; what cannot be bundled is `required`.
        Every file it names is confined first: a bundle copies them in."""
        confine_intake(record.intake, self.workdir, allowed_input_roots(self.workdir))
        intake = localised_intake(record.intake, self.workdir)
        model, required = intake.model, {}
        update: dict[str, object] = {}
        if model.source != "package":
            required["source"] = f"a checkout of the model's source (the adaptation used {model.source})"
            update["source"] = "package"  # replaced by the loader's `source`, which it then requires
        if model.checkpoint:
            if weights:
                update["checkpoint"] = self.place(Path(model.checkpoint), f"weights/{Path(model.checkpoint).name}").path
            else:
                required["checkpoint"] = f"the checkpoint (the adaptation used {Path(model.checkpoint).name})"
                update["checkpoint"] = None
        path_part, sep, name = (model.driver or "").partition(":")
        if path_part.endswith(".py"):
            update["driver"] = self.place(Path(path_part), f"driver/{Path(path_part).name}").path + sep + name
        driver = driver_for(model, self.workdir)

        def placed(where: str, value: str) -> str:
            if not Path(value).is_file():
                return value
            # A list's items keep their own folder each: two frames may share a file name.
            folder = "inputs" if "[" not in where else f"inputs/{where.replace('[', '/').rstrip(']')}"
            return self.place(Path(value), f"{folder}/{Path(value).name}").path

        inputs = with_input_files(driver.inputs_model, intake.inputs, placed)
        return intake.model_copy(update={"model": model.model_copy(update=update), "inputs": inputs}), required


def _run_relative(workdir: Path, path: Path) -> str:
    return os.path.relpath(path.absolute(), workdir.absolute()).replace(os.sep, "/")


def _write_docs(out: Path, manifest: DeployManifest) -> None:
    env = template_environment()
    (out / "README.md").write_text(env.get_template("bundle_readme.md.j2").render(b=manifest))
    example = out / "example.py"
    example.write_text(env.get_template("bundle_example.py.j2").render(b=manifest))
    example.chmod(0o755)
