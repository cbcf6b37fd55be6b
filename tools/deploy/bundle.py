"""`omskills bundle TASK`: one self-contained folder to deploy a verified adaptation from.

    bundle/
      bundle.json            the manifest: graphs, contracts, shape strategies, sha256 of every file
      README.md              what is inside, how to run it, on which backend
      example.py             the main path through the public API (`python example.py --backend om`)
      graphs/<graph>/        the ONNX (and its external weights), the OM when ATC built one
      contracts/<graph>.json the contract and shape strategy of each graph
      atc/<graph>.sh         the ATC command of each graph, paths relative to the bundle
      weights/, inputs/, driver/   the checkpoint, input files and driver file the record names

Every path inside is relative, so the folder can be moved or copied to the Ascend host. Files are
hard-linked from the run folder where the file system allows it (a full-scale bundle would
otherwise copy gigabytes), else copied.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import get_args

from omskills.ascend.atc import atc_script
from omskills.deploy.manifest import MANIFEST_NAME, DeployError, manifest_from_record
from omskills.files import sha256_file
from omskills.models.api import InputPathMarker
from omskills.models.registry import driver_for, localised_intake
from omskills.records.deploy import Artifact, ArtifactFile, DeployedGraph, DeployManifest
from omskills.records.literals import BundleArtifact
from omskills.records.results import BundleSummary
from omskills.records.task import TaskRecord, load_record
from omskills.report.render import template_environment

ARTIFACTS: tuple[str, ...] = get_args(BundleArtifact)


def write_bundle(task_path: Path, out: Path | None = None, *, artifact: str = "auto", weights: bool = True) -> BundleSummary:
    """Write the bundle of the verified adaptation `task_path` into `out` (default: <run>/bundle).

    artifact: "onnx" (no OM), "om" (every graph's OM, which each must have) or "auto" (the OMs
    ATC built); the ONNX files always come too (the contracts' reference and the ATC scripts' input). weights: copy the checkpoint (else the loader must be given `checkpoint=`)."""
    if artifact not in ARTIFACTS:
        raise DeployError(f"artifact: {artifact!r} is not one of {list(ARTIFACTS)}")
    task_path = Path(task_path)
    workdir = TaskRecord.workdir(task_path)
    manifest = manifest_from_record(task_path)
    missing_om = [g.name for g in manifest.graphs if g.om is None]
    if artifact == "om" and missing_om:
        raise DeployError(f"artifact 'om': no OM was built for {missing_om}; run their ATC scripts where CANN is "
                          "installed (convert_atc), or bundle the ONNX files (--artifact onnx)")
    out = Path(out) if out else workdir / "bundle"
    if out.exists() and not (out / MANIFEST_NAME).is_file() and any(out.iterdir()):
        raise DeployError(f"out: {out} exists and is not a bundle; choose an empty or new folder")
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    record = load_record(task_path)
    writer = _Writer(workdir, out)
    graphs = [writer.graph(graph, artifact, record) for graph in manifest.graphs]
    intake, required = writer.intake(record, weights)
    bundled = manifest.model_copy(update={"graphs": graphs, "intake": intake, "required": required})
    (out / MANIFEST_NAME).write_text(bundled.model_dump_json(indent=2))
    _write_docs(out, bundled)
    files = [p for p in out.rglob("*") if p.is_file()]
    return BundleSummary(path=str(out), graphs=[g.name for g in graphs], files=len(files),
                         bytes=sum(p.stat().st_size for p in files), om_graphs=[g.name for g in graphs if g.om],
                         not_deployed=bundled.not_deployed, required=required)


class _Writer:
    def __init__(self, workdir: Path, out: Path) -> None:
        self.workdir = workdir
        self.out = out

    def place(self, source: Path, target: str) -> ArtifactFile:
        """`source` at `target` (relative to the bundle), hard-linked or copied, with its hash."""
        if not source.is_file():
            raise DeployError(f"artifact missing: {source}")
        dest = self.out / target
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(source, dest)
        except OSError:  # another file system, or links not allowed
            shutil.copy2(source, dest)
        return ArtifactFile(path=target, bytes=dest.stat().st_size, sha256=sha256_file(dest))

    def artifact(self, artifact: Artifact, folder: str) -> Artifact:
        return Artifact(files=[self.place(self.workdir / f.path, f"{folder}/{Path(f.path).name}") for f in artifact.files])

    def graph(self, graph: DeployedGraph, artifact: str, record: TaskRecord) -> DeployedGraph:
        folder = f"graphs/{graph.name}"
        onnx = self.artifact(graph.onnx, folder)  # always: the contract's reference and the ATC input
        om = self.artifact(graph.om, folder) if graph.om is not None and artifact in ("auto", "om") else None
        (self.out / "contracts").mkdir(exist_ok=True)
        (self.out / "contracts" / f"{graph.name}.json").write_text(
            graph.model_dump_json(include={"name", "module_path", "contract", "strategy"}, indent=2))
        atc = record.toolchain_of(graph.name).atc
        script = self.atc_script(graph, onnx, atc.command) if atc is not None and atc.command else None
        return graph.model_copy(update={"onnx": onnx, "om": om, "atc_script": script})

    def atc_script(self, graph: DeployedGraph, onnx: Artifact, command: list[str]) -> str:
        """The graph's recorded ATC command with its paths made relative to the bundle."""
        rewritten = []
        for arg in command:
            key, sep, value = arg.partition("=")
            if key == "--model":
                arg = f"--model={onnx.path}"
            elif key == "--output":
                arg = f"--output=graphs/{graph.name}/{Path(value).name}"
            elif key == "--keep_dtype" and sep:
                kept = self.place(self.workdir / value, f"atc/{graph.name}.keep_dtype.cfg")
                arg = f"--keep_dtype={kept.path}"
            rewritten.append(arg)
        target = self.out / "atc" / f"{graph.name}.sh"
        target.parent.mkdir(exist_ok=True)
        target.write_text(atc_script(rewritten, from_own_folder=".."))
        target.chmod(0o755)
        return f"atc/{graph.name}.sh"

    def intake(self, record: TaskRecord, weights: bool):
        """The record's intake with its files inside the bundle; what cannot be bundled is `required`."""
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
        inputs = dict(intake.inputs)
        driver = driver_for(model)
        for field_name, field in driver.inputs_model.model_fields.items():
            value = inputs.get(field_name)
            if any(isinstance(m, InputPathMarker) for m in field.metadata) and isinstance(value, str) and Path(value).is_file():
                inputs[field_name] = self.place(Path(value), f"inputs/{Path(value).name}").path
        return intake.model_copy(update={"model": model.model_copy(update=update), "inputs": inputs}), required


def _write_docs(out: Path, manifest: DeployManifest) -> None:
    env = template_environment()
    (out / "README.md").write_text(env.get_template("bundle_readme.md.j2").render(b=manifest))
    example = out / "example.py"
    example.write_text(env.get_template("bundle_example.py.j2").render(b=manifest))
    example.chmod(0o755)
