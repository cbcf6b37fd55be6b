"""The driver for plain PyTorch code: a Python file with two functions, no class to subclass.

    def build_model(spec):          # spec: the record's intake.model (scale, seed, device, builder_kwargs, ...)
        return torchvision.models.resnet18(weights=None)    # the object users call
    def run_main_path(model, inputs):   # inputs: the record's intake.inputs
        return model(torch.randn(*inputs["shape"]))

`build_model` returns the object users call; when that object is not itself the `nn.Module`
tree to cut, it returns `(entry, root_module)`. `intake.model.checkpoint`, when given, is loaded into
the root; every report names the files the build read (`omskills.models.weights`), or says random
weights, the generators seeded with `intake.model.seed` before building. `run_main_path` returns one
step's outputs (a tensor, a tuple or a dict of tensors); a generator yields one step per item. Before
each run the engine seeds torch's, numpy's and Python's generators with 0, so random inputs are the
same in every run.

Optional names in the same file: `Inputs` (a pydantic model validating intake.inputs),
`COMPARISON` and `PRECISION_CHECKS` (lists of OutputCheck fields), `SEED_CANDIDATES` (a list of (name, module path)),
`FAMILY`, `STEP_NAME`, `WEIGHTS`: what `build_model` loads itself, for the gate (which builds
nothing) and for reports when the build reads no file the engine sees (`torch.load` and safetensors
reads are named with their hash whatever it says), and for the static inventory `SOURCE_PACKAGE`
(the package to scan, installed or under `intake.model.source`), `ENTRY_CLASSES` and
`ENTRY_METHODS` (as `ModelDriver.entry_classes` / `entry_methods`). Without seed candidates the
study ranks the module tree.

When the record names a checkpoint, the gate (check_environment) runs `build_model(spec)` once
with every parameter on the meta device to list the model's keys and compare them with the
checkpoint's before any weights are allocated; a build that fails there is one line naming the file.
"""

from __future__ import annotations

import inspect
import time
import types
from pathlib import Path
from typing import Any, ClassVar

from omskills.errors import InputError, TaskRecordError, one_line
from omskills.models.api import (
    LoadedModel,
    MainPathRun,
    ModelDriver,
    RunHooks,
    SeedCandidate,
    StepOutput,
    as_arrays,
    input_files_from,
)
from omskills.models.checkpoints import load_state_dict, parameters_on_meta
from omskills.models.weights import RANDOM
from omskills.records.intake import ModelSpec
from omskills.records.verify import OutputCheck
from omskills.source.packages import package_root
from pydantic import BaseModel, ConfigDict

BUILD = "build_model"
RUN = "run_main_path"


class AnyInputs(BaseModel):
    """intake.inputs as given, when the driver file defines no `Inputs` model."""

    model_config = ConfigDict(extra="allow")


class FunctionDriver(ModelDriver):
    family: ClassVar[str] = "python"
    description: ClassVar[str] = "a Python file with build_model(spec) and run_main_path(model, inputs)"
    inputs_model: ClassVar[type[BaseModel]] = AnyInputs

    def __init__(self, module: types.ModuleType, path: Path) -> None:
        self.module = module
        self.path = path
        missing = [name for name in (BUILD, RUN) if not callable(getattr(module, name, None))]
        if missing:
            raise TaskRecordError(
                f"intake.model.driver: {path} defines no function {' or '.join(missing)} "
                f"(a driver file defines {BUILD}(spec) and {RUN}(model, inputs))"
            )
        self.family = str(getattr(module, "FAMILY", path.stem))  # type: ignore[misc]
        self.step_name = str(getattr(module, "STEP_NAME", "step"))  # type: ignore[misc]
        self.entry_methods = tuple(getattr(module, "ENTRY_METHODS", ()))  # type: ignore[misc]
        self.entry_classes = tuple(getattr(module, "ENTRY_CLASSES", ()))  # type: ignore[misc]
        inputs = getattr(module, "Inputs", None)
        if inputs is not None:
            if not (isinstance(inputs, type) and issubclass(inputs, BaseModel)):
                raise TaskRecordError(f"intake.model.driver: {path}: Inputs must be a pydantic model class")
            self.inputs_model = inputs  # type: ignore[misc]

    def source_package(self, spec: ModelSpec) -> str | None:
        """`SOURCE_PACKAGE`: the package the static inventory scans (installed, or under
        `intake.model.source`); without it there is no static inventory."""
        package = getattr(self.module, "SOURCE_PACKAGE", None)
        return str(package) if package else None

    def source_root(self, spec: ModelSpec) -> Path:
        package = self.source_package(spec)
        return package_root(spec.source, package) if package else self.path.parent

    def code_fingerprint(self) -> str:
        import hashlib

        return hashlib.sha256(self.path.read_bytes()).hexdigest()[:16]

    def load(self, spec: ModelSpec) -> LoadedModel:
        import torch

        torch.manual_seed(spec.seed)
        built = getattr(self.module, BUILD)(spec)
        entry, root = built if isinstance(built, tuple) else (built, built)
        if not isinstance(root, torch.nn.Module):
            raise InputError(
                f"{self.path}: {BUILD} returned {type(root).__name__}; return the nn.Module users call, "
                "or (entry, root_module)"
            )
        root.eval()
        if spec.checkpoint is not None:
            load_state_dict(root, Path(spec.checkpoint), spec.device)
        # What the file declares; the engine's label comes from what the build read (models.weights).
        weights = spec.checkpoint or self.builder_weights(spec) or RANDOM
        root.to(spec.device)
        return LoadedModel(entry=entry, root=root, source_root=self.source_root(spec), weights=weights)

    def builder_weights(self, spec: ModelSpec) -> str | None:
        weights = getattr(self.module, "WEIGHTS", None)
        return str(weights) if weights else None

    def expected_state_keys(self, spec: ModelSpec) -> set[str] | None:
        """The root's state-dict keys, for the gate (check_environment) to hold a checkpoint against
        before any weights exist. A driver file has no other way to tell them, so this runs the user's
        `build_model(spec)`: once, with the spec as the gate got it (the scale asked), every parameter
        created on the meta device (no memory for weights; other tensors stay real). A build that
        fails there stops the gate with one line naming the driver file: `build_model` must not read
        its parameters' values (`weight.item()`) while building. None: it built no nn.Module."""
        import torch

        try:
            with parameters_on_meta():
                built = getattr(self.module, BUILD)(spec)
        except Exception as err:  # noqa: BLE001 - the user's code may raise anything; one line says what
            raise InputError(
                f"intake.model.driver: {self.path}: {BUILD}(spec) failed at scale {spec.scale} "
                f"with parameters on the meta device (the gate lists its keys so): {one_line(err, 300)}"
            ) from None
        root = built[1] if isinstance(built, tuple) else built
        return set(root.state_dict()) if isinstance(root, torch.nn.Module) else None

    def load_inputs(self, inputs: BaseModel, base_dir: Path) -> Any:
        """What `run_main_path` gets: the `Inputs` object, its files (fields typed `InputPath` or
        `list[InputPath]`) taken from the record's folder; a plain dict without `Inputs`."""
        if isinstance(inputs, AnyInputs):
            return inputs.model_dump()
        fields = {name: getattr(inputs, name) for name in type(inputs).model_fields}
        return inputs.model_copy(update=input_files_from(type(inputs), fields, base_dir))

    def run_main_path(
        self, loaded: LoadedModel, data: Any, inputs: BaseModel, verification: BaseModel, hooks: RunHooks
    ) -> MainPathRun:
        import torch

        steps: list[StepOutput] = []
        start = last = time.perf_counter()
        with torch.no_grad():
            produced = getattr(self.module, RUN)(loaded.entry, data)
            for index, outputs in enumerate(produced if inspect.isgenerator(produced) else [produced]):
                now = time.perf_counter()
                steps.append(StepOutput(index=index, seconds=now - last, outputs=as_arrays(outputs)))
                hooks.step(index)
                last = time.perf_counter()
        return MainPathRun(steps=steps, setup_seconds=0.0, total_seconds=time.perf_counter() - start)

    def comparison(self, verification: BaseModel) -> list[OutputCheck]:
        declared = getattr(self.module, "COMPARISON", None)
        if declared is None:
            return super().comparison(verification)
        return [OutputCheck.model_validate(c) if isinstance(c, dict) else c for c in declared]

    def precision_checks(self, verification: BaseModel) -> list[OutputCheck]:
        declared = getattr(self.module, "PRECISION_CHECKS", None)
        if declared is None:
            return super().precision_checks(verification)
        return [OutputCheck.model_validate(c) if isinstance(c, dict) else c for c in declared]

    def seed_candidates(self) -> list[SeedCandidate]:
        return [
            SeedCandidate(name, path, f"declared in {self.path.name}")
            for name, path in getattr(self.module, "SEED_CANDIDATES", [])
        ]
