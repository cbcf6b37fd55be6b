"""An adapted model, loaded for use: the object users call, with the compiled graphs spliced in.

    from omskills.deploy import load_adapted

    with load_adapted("runs/my-model/task.yaml", backend="onnxruntime") as model:
        predictor = model.entry            # what the user's application calls, as before
        run = model.run_main_path()         # or the main path on the record's inputs
        model.stats()                       # per graph: backend, calls, fallbacks

Only the model, the records and the runtime are loaded: no study, capture, profiling or export
module (a test checks it in a fresh process).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omskills.contracts.pytree import register_struct
from omskills.deploy.manifest import MANIFEST_NAME, DeployError, manifest_from_record, read_bundle
from omskills.models.api import LoadedModel, MainPathRun, ModelDriver, run_seeded
from omskills.models.registry import BoundIntake, bind_intake, confine_intake, driver_for, resolved_spec
from omskills.models.weights import seeded_load
from omskills.records.deploy import DeployManifest
from omskills.records.export import FallbackEvent, SpliceStats
from omskills.records.intake import Intake
from omskills.runtime import open_backend
from omskills.runtime.serving import open_graph, resolve_backend
from omskills.splicing.memo import load_entries, why_not_memoisable
from omskills.splicing.splice import SpliceHandle, splice

logger = logging.getLogger(__name__)


@dataclass
class LoadTimes:
    manifest_s: float  # reading (and, for a bundle, checking) the manifest and its artifacts
    model_s: float  # building the PyTorch model
    backends_s: float  # opening every graph's session


class AdaptedModel:
    """The user's model with its compiled graphs spliced in; `close()` (or `with`) undoes it."""

    def __init__(
        self,
        manifest: DeployManifest,
        root: Path,
        backend: str,
        bound: BoundIntake,
        data: Any,
        loaded: LoadedModel,
        handle: SpliceHandle,
        backends: Sequence[Any],
        times: LoadTimes,
    ) -> None:
        self.manifest = manifest
        self.root = root
        self.backend = backend
        self.bound = bound
        self.loaded = loaded
        self.handle = handle
        self.times = times
        self._backends = list(backends)
        self._data = data  # the manifest's inputs, loaded by the driver

    @property
    def driver(self) -> ModelDriver:
        return self.bound.driver

    @property
    def entry(self) -> Any:
        """The object users call (a predictor, a pipeline, the model itself)."""
        return self.loaded.entry

    @property
    def module(self) -> Any:
        """The module tree the graphs are spliced into."""
        return self.loaded.root

    def backend_of(self) -> dict[str, str]:
        """Graph -> the backend that runs it, as the runtime reports it ("om:npu:0", ...)."""
        return {
            route.contract.candidate: route.backend.describe()
            for spliced in self.handle.modules.values()
            for route in spliced.routes
        }

    def run_main_path(self, inputs: Mapping[str, Any] | None = None) -> MainPathRun:
        """The driver's main path on the manifest's inputs, or on `inputs` (fields of intake.inputs)."""
        bound, data = self.bound, self._data
        if inputs:
            parsed = self.driver.parse_inputs(self.manifest.intake.inputs | dict(inputs))
            data = self.driver.load_inputs(parsed, self.root)
            bound = BoundIntake(driver=self.driver, inputs=parsed, verification=bound.verification)
        return run_seeded(self.driver, self.loaded, data, bound.inputs, bound.verification)

    def stats(self) -> list[SpliceStats]:
        return self.handle.stats()

    def fallbacks(self) -> list[FallbackEvent]:
        return self.handle.fallbacks()

    def close(self) -> None:
        self.handle.unsplice()
        for backend in self._backends:
            close = getattr(backend, "close", None)
            if callable(close):
                close()
        self._backends = []

    def __enter__(self) -> AdaptedModel:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def load_adapted(
    path: str | Path,
    backend: str = "auto",
    *,
    providers: Sequence[str] | None = None,
    device_id: int | None = None,
    strict: bool = False,
    source: str | None = None,
    checkpoint: str | None = None,
    device: str | None = None,
    check_hashes: bool = True,
) -> AdaptedModel:
    """Load an adapted model from its task record (`task.yaml` of a run) or a bundle folder.

    backend: "om" (ais_bench InferSession), "onnxruntime" (on `providers`, default the best present:
    CANN, CUDA, CPU), any other backend registered in `omskills.backends` (opened as its class
    serves a graph), or "auto" (the OM where every graph has one and ais_bench is installed).
    device_id: the NPU (default the record's intake.target.device_id). strict: a call outside a
    graph's contract raises instead of running PyTorch. source / checkpoint / device override the
    record's model (a checkout path elsewhere, the weights, the PyTorch device).
    """
    started = time.perf_counter()
    manifest, root = _manifest(Path(path), check_hashes)
    manifest_s = time.perf_counter() - started
    intake = _intake_with(manifest, root, source=source, checkpoint=checkpoint, device=device)
    confine_intake(manifest.intake, root, [root.resolve()])  # every file the bundle names lies inside it
    started = time.perf_counter()
    bound, data, loaded = build_model(intake, root)
    model_s = time.perf_counter() - started
    started = time.perf_counter()
    chosen = resolve_backend(backend, manifest.graphs)
    device_id = intake.target.device_id if device_id is None else device_id
    handle, backends = _spliced(manifest, root, loaded, chosen, device_id, providers, strict)
    times = LoadTimes(manifest_s=manifest_s, model_s=model_s, backends_s=time.perf_counter() - started)
    logger.info(
        "%s: %d graph(s) spliced on %s; %s",
        manifest.task_id,
        len(manifest.graphs),
        chosen,
        ", ".join(f"{g}: {why}" for g, why in manifest.not_deployed.items()) or "nothing left in PyTorch",
    )
    return AdaptedModel(manifest, root, chosen, bound, data, loaded, handle, backends, times)


def _intake_with(manifest: DeployManifest, root: Path, **given: str | None) -> Intake:
    """The manifest's intake with the caller's model overrides; what a bundle requires must be given
    (a source checkout may also come from the driver's own environment variable)."""
    # Paths given here are the caller's (relative to the working directory), not the bundle's.
    overrides = {k: str(Path(v).expanduser().resolve()) if k != "device" else v for k, v in given.items() if v}
    from_env = os.environ.get(driver_for(manifest.intake.model, root).source_env or "")
    if from_env and "source" not in overrides:
        overrides["source"] = from_env
    missing = {what: hint for what, hint in manifest.required.items() if what not in overrides}
    if missing:
        raise DeployError("the bundle needs " + "; ".join(f"{what}= ({hint})" for what, hint in missing.items()))
    if not overrides:
        return manifest.intake
    return manifest.intake.model_copy(update={"model": manifest.intake.model.model_copy(update=overrides)})


def _spliced(
    manifest: DeployManifest,
    root: Path,
    loaded: LoadedModel,
    backend: str,
    device_id: int,
    providers: Sequence[str] | None,
    strict: bool,
) -> tuple[SpliceHandle, list[Any]]:
    """Every graph's backend opened and spliced in; all or nothing."""
    backends: list[Any] = []
    try:
        for graph in manifest.graphs:
            backends.append(open_graph(graph, root, backend, device_id=device_id, providers=providers))
        strategies = {g.name: g.strategy for g in manifest.graphs if g.strategy is not None}
        replacements = [(g.contract, b) for g, b in zip(manifest.graphs, backends)]
        handle = splice(loaded.root, replacements, strategies=strategies, strict=strict)
        try:
            _preload_remembered(manifest, root, handle)
            if backend == "onnxruntime":
                _merge_chains(manifest, root, handle, backends, providers)
        except BaseException:
            handle.unsplice()
            raise
        return handle, backends
    except BaseException:
        for opened in backends:
            opened.close()
        raise


def _merge_chains(
    manifest: DeployManifest, root: Path, handle: SpliceHandle, backends: list[Any], providers: Sequence[str] | None
) -> None:
    """Each chain verify merged, served by its composed graph (one call instead of one per graph).
    On ONNX Runtime only: on an NPU the graphs run apart until an OM of the composed graph is
    built from its ATC script."""
    for merged in manifest.merged:
        options = {"providers": list(providers)} if providers else {}
        backends.append(open_backend(root / merged.onnx.path, "onnxruntime", **options))
        handle.merge(merged.graphs, backends[-1], merged.io_maps, merged.prefixes, merged.recipes, merged.slots)


def _preload_remembered(manifest: DeployManifest, root: Path, handle: SpliceHandle) -> None:
    """The outputs a bundle carries for inputs known ahead, in the memory of their graphs."""
    for graph in manifest.graphs:
        if graph.remembered is None:
            continue
        route = next(r for r in handle.modules[graph.name].routes if r.contract.candidate == graph.name)
        if route.memo is None:
            raise DeployError(
                f"{graph.name}: the bundle carries outputs computed ahead, but the graph's calls are not "
                f"remembered ({why_not_memoisable(route.contract)}); write the bundle again"
            )
        route.memo.preload(load_entries(root / graph.remembered.path))


def _manifest(path: Path, check_hashes: bool) -> tuple[DeployManifest, Path]:
    if path.is_dir() and (path / MANIFEST_NAME).is_file():
        return read_bundle(path, check_hashes), path.resolve()
    if path.name == MANIFEST_NAME:
        return read_bundle(path.parent, check_hashes), path.parent.resolve()
    if path.is_file():
        return manifest_from_record(path), path.resolve().parent
    if path.is_dir():
        raise DeployError(
            f"{path} holds neither a bundle ({MANIFEST_NAME}) nor is a task record; "
            "pass a run's task.yaml or a folder written by `omskills bundle`"
        )
    raise DeployError(f"not found: {path} (a run's task.yaml, or a folder written by `omskills bundle`)")


def build_model(intake: Intake, root: Path) -> tuple[BoundIntake, Any, LoadedModel]:
    """The intake read by its driver, its inputs loaded, and the PyTorch model built and prepared as
    every stage prepares it (nothing spliced yet): what eager PyTorch runs."""
    bound = bind_intake(intake, root)
    data = bound.driver.load_inputs(bound.inputs, root)
    spec = resolved_spec(intake.model, root)
    loaded = seeded_load(bound.driver, spec)  # the weights verify ran with, when random
    for cls in bound.driver.pytree_types(loaded):
        register_struct(cls)
    loaded.notes += bound.driver.prepare(loaded, data, bound.inputs, bound.verification)
    return bound, data, loaded
