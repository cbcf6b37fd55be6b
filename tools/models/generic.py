"""The driver for plain PyTorch code: a Python file with two functions, no class to subclass.

    def build_model(spec):          # spec: the record's intake.model (scale, seed, device, builder_kwargs, ...)
        return torchvision.models.resnet18(weights=None)    # the object users call
    def run_main_path(model, inputs):   # inputs: the record's intake.inputs
        return model(torch.randn(*inputs["shape"]))

`build_model` returns the object users call; when that object is not itself the `nn.Module`
tree to cut, it returns `(entry, root_module)`. Weights are seeded random (torch's generator is
seeded with `intake.model.seed` before building) unless `intake.model.checkpoint` names a state
dict, which is loaded into the root. `run_main_path` returns one step's outputs (a tensor, a
tuple or a dict of tensors); a generator yields one step per item. Before each run torch's
generator is seeded with 0, so random inputs are the same in the reference and spliced runs.

Optional names in the same file: `Inputs` (a pydantic model validating intake.inputs),
`COMPARISON` (a list of OutputCheck fields), `SEED_CANDIDATES` (a list of (name, module path)),
`FAMILY` and `STEP_NAME`. Without seed candidates the study ranks the module tree.
"""

from __future__ import annotations

import inspect
import pickle
import time
import types
from pathlib import Path
from typing import Any, ClassVar

from omskills.errors import InputError, TaskRecordError
from omskills.models.api import LoadedModel, MainPathRun, ModelDriver, RunHooks, SeedCandidate, StepOutput, as_arrays
from omskills.records.intake import ModelSpec
from omskills.records.verify import OutputCheck
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
            raise TaskRecordError(f"intake.model.driver: {path} defines no function {' or '.join(missing)} "
                                  f"(a driver file defines {BUILD}(spec) and {RUN}(model, inputs))")
        self.family = str(getattr(module, "FAMILY", path.stem))  # type: ignore[misc]
        self.step_name = str(getattr(module, "STEP_NAME", "step"))  # type: ignore[misc]
        inputs = getattr(module, "Inputs", None)
        if inputs is not None:
            if not (isinstance(inputs, type) and issubclass(inputs, BaseModel)):
                raise TaskRecordError(f"intake.model.driver: {path}: Inputs must be a pydantic model class")
            self.inputs_model = inputs  # type: ignore[misc]

    def source_root(self, spec: ModelSpec) -> Path:
        return self.path.parent

    def code_fingerprint(self) -> str:
        import hashlib

        return hashlib.sha256(self.path.read_bytes()).hexdigest()[:16]

    def load(self, spec: ModelSpec) -> LoadedModel:
        import torch

        torch.manual_seed(spec.seed)
        built = getattr(self.module, BUILD)(spec)
        entry, root = built if isinstance(built, tuple) else (built, built)
        if not isinstance(root, torch.nn.Module):
            raise InputError(f"{self.path}: {BUILD} returned {type(root).__name__}; return the nn.Module users call, "
                             "or (entry, root_module)")
        root.eval()
        notes = []
        if spec.checkpoint is None:
            notes.append(f"random weights (seed {spec.seed})")
        else:
            load_state_dict(root, Path(spec.checkpoint), spec.device)
        root.to(spec.device)
        return LoadedModel(entry=entry, root=root, source_root=self.path.parent,
                           weights=spec.checkpoint or "random", notes=notes)

    def load_inputs(self, inputs: BaseModel, base_dir: Path) -> Any:
        return inputs.model_dump() if isinstance(inputs, AnyInputs) else inputs

    def run_main_path(self, loaded: LoadedModel, data: Any, inputs: BaseModel, verification: BaseModel,
                      hooks: RunHooks) -> MainPathRun:
        import torch

        torch.manual_seed(0)
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

    def seed_candidates(self) -> list[SeedCandidate]:
        return [SeedCandidate(name, path, f"declared in {self.path.name}")
                for name, path in getattr(self.module, "SEED_CANDIDATES", [])]


def load_state_dict(root: Any, checkpoint: Path, device: str) -> None:
    """A checkpoint's state dict into `root`, with one-line errors naming the path."""
    import torch

    if not checkpoint.is_file():
        raise InputError(f"intake.model.checkpoint: checkpoint file not found: {checkpoint}")
    try:
        state = torch.load(checkpoint, map_location=device, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise InputError(f"intake.model.checkpoint: {checkpoint} is not a loadable state dict ({first[:200]})") from None
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise InputError(f"intake.model.checkpoint: {checkpoint} holds a {type(state).__name__}, not a state dict")
    result = root.load_state_dict(state, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise InputError(f"intake.model.checkpoint: {checkpoint} does not fit the model: "
                         f"{len(result.missing_keys)} missing keys (first {result.missing_keys[:3]}), "
                         f"{len(result.unexpected_keys)} unexpected (first {result.unexpected_keys[:3]})")
