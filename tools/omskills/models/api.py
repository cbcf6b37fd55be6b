"""The driver interface: everything model-specific the engine asks of a model family.

A driver is a `ModelDriver` subclass. The engine calls it to build the model, to load the
record's inputs, to run the main path (the entry users call, not a module's `forward`), and to
say how two runs of that main path are compared. Everything else has a default, so a small
driver overrides only what its model needs:

- `inputs_model` / `verification_model`: pydantic models that validate `intake.inputs` and
  `intake.verification` (errors name the field);
- `comparison()`: which outputs decide parity, with which metric and gate (`OutputCheck`);
- `picture()`: an image of one step's outputs, for the reports;
- `seed_candidates()`: the heavy subtrees the family knows; without them the study ranks the
  module tree from a profile;
- `provenance_sources()`, `source_limits()`, `derived_args()`, `control_plane_notes()`,
  `pytree_types()`, `export_patches()`: what the contracts, shape strategies and exports need
  to know about the source.

Drivers are found by family name through the `omskills.drivers` entry-point group, or named in
the task record (`intake.model.driver`); see `omskills.models.registry`.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from omskills.errors import InputError, OmskillsError, one_line
from omskills.records.contracts import QuantityLimit, QuantitySchedule, ShapeDerivedArg
from omskills.records.intake import ModelSpec
from omskills.records.names import InputPath as InputPath  # re-exported: drivers import it from here
from omskills.records.names import is_input_path
from omskills.records.parity import FP16_GATES
from omskills.records.verify import OutputCheck
from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    from PIL import Image
    from torch import nn


# The one scheme an input value may name instead of a file: one of the clips that ship with omskills.
BUILTIN_SCHEME = "builtin:"


def names_a_file(value: str) -> bool:
    """An `InputPath` value that is a path (every value but `builtin:<clip>`, colons or not)."""
    return not value.startswith(BUILTIN_SCHEME)


def _items(name: str, value: Any) -> list[tuple[str, Any]]:
    """A field's value as (where, item): itself, or each item of a list (`frames[2]`)."""
    if isinstance(value, (list, tuple)):
        return [(f"{name}[{index}]", item) for index, item in enumerate(value)]
    return [(name, value)]


def input_files(model: type[BaseModel], values: Mapping[str, Any], builtin: bool = False) -> list[tuple[str, str]]:
    """(where, value) of every file a driver's inputs name: the value of each field typed `InputPath`
    and each item of one typed `list[InputPath]` (where `frames[2]`); built-in clips only when
    `builtin`. The one walk over input files: confinement, resolution, the existence check and
    bundles all use it."""
    return [
        (where, item)
        for name, info in model.model_fields.items()
        if is_input_path(info)
        for where, item in _items(name, values.get(name))
        if isinstance(item, str) and (builtin or names_a_file(item))
    ]


def with_input_files(
    model: type[BaseModel], values: Mapping[str, Any], change: Callable[[str, str], str]
) -> dict[str, Any]:
    """`values` with every file `input_files` finds replaced by `change(where, value)` (lists stay lists)."""
    changed = dict(values)
    files = dict(input_files(model, values))
    for name in model.model_fields:
        value = values.get(name)
        if isinstance(value, (list, tuple)):
            changed[name] = [change(w, v) if w in files else v for w, v in _items(name, value)]
        elif name in files:
            changed[name] = change(name, value)
    return changed


def input_files_from(model: type[BaseModel], values: Mapping[str, Any], base_dir: Path) -> dict[str, Any]:
    """`values` with every relative input file taken from `base_dir` (the task record's folder)."""

    def absolute(_where: str, value: str) -> str:
        return value if Path(value).expanduser().is_absolute() else str((base_dir / value).resolve())

    return with_input_files(model, values, absolute)


class NoSettings(BaseModel):
    """The verification settings of a driver that has none (unknown fields are errors)."""

    model_config = ConfigDict(extra="forbid")


@dataclass
class LoadedModel:
    entry: Any  # the object users call (a predictor, a pipeline, the model itself)
    root: nn.Module  # the module tree candidates are paths into
    source_root: Path  # folder holding the model's Python source (for file:line findings)
    weights: str  # what the driver says it loaded; the engine relabels it from what the build read (models.weights)
    # Entered around every run and export: the device-portability layer, or nothing.
    portability: contextlib.AbstractContextManager[Any] = field(default_factory=contextlib.nullcontext)
    notes: list[str] = field(default_factory=list)
    # Fingerprint of the inputs and settings ModelDriver.prepare last ran with (None: not yet).
    prepared_for: str | None = None

    def findings(self) -> list[Any]:
        """Portability findings of the layer, when it records them."""
        findings = getattr(self.portability, "findings", None)
        return findings() if callable(findings) else []


@dataclass
class StepOutput:
    """One step of the main path (a frame, an image, a request): its outputs as named arrays."""

    index: int
    seconds: float
    outputs: dict[str, np.ndarray]


@dataclass
class MainPathRun:
    steps: list[StepOutput]
    setup_seconds: float  # before the first step (session start, prompts)
    total_seconds: float
    notes: list[str] = field(default_factory=list)


def seed_generators(seed: int = 0) -> None:
    """torch's, numpy's and Python's random generators, seeded."""
    import random

    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def run_seeded(
    driver: ModelDriver,
    loaded: LoadedModel,
    data: Any,
    inputs: BaseModel,
    verification: BaseModel,
    hooks: RunHooks | None = None,
) -> MainPathRun:
    """The driver's main path with every random generator seeded first: a model that draws noise
    (a sampler's latents, a pitch tracker's dither) draws the same in every run, so two runs
    differ only by what the graphs change."""
    seed_generators(0)
    return driver.run_main_path(loaded, data, inputs, verification, hooks or RunHooks())


def save_run(run: MainPathRun, path: Path) -> Path:
    """The outputs of every step in one npz ("<step index>/<output name>" keys), for comparing runs
    made in other processes bit for bit."""
    arrays = {f"{step.index}/{name}": value for step in run.steps for name, value in step.outputs.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as handle:  # a file handle: np.savez would add ".npz" to another suffix
        np.savez_compressed(handle, **arrays)
    return path


def load_run(path: Path) -> dict[int, dict[str, np.ndarray]]:
    """What `save_run` wrote: step index -> output name -> array."""
    steps: dict[int, dict[str, np.ndarray]] = {}
    with np.load(path, allow_pickle=False) as saved:
        for key in saved.files:
            index, _, name = key.partition("/")
            steps.setdefault(int(index), {})[name] = saved[key]
    return steps


@dataclass
class RunHooks:
    """Called by the driver while the main path runs; the study uses them to count per step."""

    on_step: Callable[[int], None] | None = None  # after each step, with its index
    on_prompt: Callable[[], None] | None = None  # each time a prompt is given to the model

    def step(self, index: int) -> None:
        if self.on_step:
            self.on_step(index)

    def prompt(self) -> None:
        if self.on_prompt:
            self.on_prompt()


@dataclass(frozen=True)
class SeedCandidate:
    """A heavy subtree the family driver knows about: name, module path and why it matters."""

    name: str
    module_path: str
    description: str
    group: str = ""  # seed subtree it belongs to when one seed is cut into several calls


@dataclass(frozen=True)
class ProvenanceSource:
    """`owner.attribute` is a Python callable whose tensor outputs are user inputs of some kind
    (`kind` "input": text tokens, frames, an image) or session state (`kind` "session")."""

    owner: Any
    attribute: str
    kind: str
    source: str  # what they are, in words ("video frames", "text prompt tokens")


def check_builder_kwargs(
    builder: Callable[..., Any], kwargs: Mapping[str, Any], set_by_driver: tuple[str, ...] = ()
) -> None:
    """`intake.model.builder_kwargs` bind to `builder`'s parameters, and name none the driver
    passes itself; an InputError naming the field otherwise (before any model is built)."""
    import inspect

    taken = sorted(set(set_by_driver) & set(kwargs))
    if taken:
        raise InputError(f"intake.model.builder_kwargs: {', '.join(taken)} set by the driver itself; leave them out")
    signature = inspect.signature(builder)
    try:
        signature.bind_partial(**kwargs)
    except TypeError as err:
        raise InputError(
            f"intake.model.builder_kwargs: {err} ({getattr(builder, '__name__', 'the builder')} takes "
            f"{', '.join(signature.parameters)})"
        ) from None


@contextlib.contextmanager
def driver_checks(driver: ModelDriver, method: str) -> Iterator[None]:
    """Around a call into a driver that checks what the user gave (inputs, builder, weights): a
    `ValueError` or `TypeError` it raises is the user's error, said in one line (`InputError`,
    which drivers may raise themselves), not a traceback."""
    try:
        yield
    except OmskillsError:
        raise
    except (ValueError, TypeError) as err:
        raise InputError(f"{one_line(str(err)) or type(err).__name__} ({driver.family} driver, {method})") from err


def as_arrays(outputs: Any, prefix: str = "out") -> dict[str, np.ndarray]:
    """Named numpy arrays from a tensor, a sequence or a mapping of tensors (nested ones flattened
    with dotted names); non-tensor leaves that numpy can hold become arrays too."""
    import torch

    named: dict[str, np.ndarray] = {}

    def visit(value: Any, name: str) -> None:
        if isinstance(value, torch.Tensor):
            named[name] = value.detach().cpu().numpy()
        elif isinstance(value, np.ndarray):
            named[name] = value
        elif isinstance(value, Mapping):
            for key, item in value.items():
                visit(item, f"{name}.{key}" if name else str(key))
        elif isinstance(value, (list, tuple)) and value and not all(isinstance(v, (int, float, bool)) for v in value):
            for i, item in enumerate(value):
                visit(item, f"{name}.{i}" if name else str(i))
        elif value is not None:
            named[name] = np.asarray(value)

    visit(outputs, prefix if not isinstance(outputs, Mapping) else "")
    return named


class ModelDriver(ABC):
    """One model family's knowledge. Subclass it, set `family`, implement the abstract methods."""

    family: ClassVar[str]
    description: ClassVar[str] = ""
    inputs_model: ClassVar[type[BaseModel]]
    verification_model: ClassVar[type[BaseModel]] = NoSettings
    # What one main-path step is called in reports ("frame", "image").
    step_name: ClassVar[str] = "step"
    # An environment variable that, when set, overrides intake.model.source.
    source_env: ClassVar[str | None] = None
    # Methods of the classes users call, looked for by the static inventory (e.g. request dispatchers),
    # and, when not empty, the only class names it reports.
    entry_methods: ClassVar[tuple[str, ...]] = ()
    entry_classes: ClassVar[tuple[str, ...]] = ()
    # GB a whole adaptation of this model may take, per scale ("tiny", "full"): what `omskills fleet`
    # asks Ray for before any run of it was measured (a scale's default where this says nothing).
    adaptation_memory_gb: ClassVar[dict[str, float]] = {}

    # -- where the model comes from --------------------------------------------------------

    @abstractmethod
    def source_root(self, spec: ModelSpec) -> Path:
        """Folder that holds the model's Python source (an error naming intake.model.source if missing).
        Paths in `spec` arrive absolute (the engine resolves them against the task record's folder)."""

    def source_package(self, spec: ModelSpec) -> str | None:
        """The Python package under source_root that the static inventory scans (None: no scan)."""
        return None

    def code_fingerprint(self) -> str:
        """A hash of the driver's own code (its class and the driver classes it derives from): a
        study made with other driver code is not reused."""
        import hashlib
        import inspect

        digest = hashlib.sha256()
        for cls in type(self).__mro__:
            if not (isinstance(cls, type) and issubclass(cls, ModelDriver)) or cls is ModelDriver:
                continue
            try:
                digest.update(Path(inspect.getfile(cls)).read_bytes())
            except (OSError, TypeError):  # a class without a file (made in a REPL): its name alone
                digest.update(f"{cls.__module__}:{cls.__qualname__}".encode())
        return digest.hexdigest()[:16]

    def builder_name(self, spec: ModelSpec) -> str | None:
        """The function that builds the model (the inventory scans from its module); by default
        intake.model.builder. None: the whole package is scanned from its __init__."""
        return spec.builder

    def builder_weights(self, spec: ModelSpec) -> str | None:
        """What the builder loads when no checkpoint is given, when it loads trained weights itself
        (files in the model's wheel): what the gate says before any build, and the label when the
        build reads no file the engine sees (`omskills.models.weights`); None: nothing declared."""
        return None

    @abstractmethod
    def load(self, spec: ModelSpec) -> LoadedModel:
        """Build the model on spec.device (never a hub download); checkpoint or seeded random weights."""

    # -- what the environment gate checks before any model is built --------------------------

    def check_builder(self, spec: ModelSpec) -> str:
        """That what builds the model imports (an error naming intake.model.builder if not), said
        in a few words; by default the builder the spec names is not looked up."""
        return f"builder: {self.builder_name(spec) or 'the driver default'} (not checked by the {self.family} driver)"

    def expected_state_keys(self, spec: ModelSpec) -> set[str] | None:
        """The state-dict keys of the model `spec` builds, found without building it for real (on
        the meta device, say), so the gate can name a checkpoint that does not fit before any
        weights are allocated. None: the driver cannot tell cheaply (the checkpoint is then only
        read, and its keys meet the model at load)."""
        return None

    def check_inputs(self, inputs: BaseModel, base_dir: Path) -> list[str]:
        """Before any model is built: the files the inputs name read, and the work they ask for is
        within what they hold (frames of a video). Raises InputError naming the field; returns what
        was found, for the report. By default every `InputPath` field must exist."""
        found = []
        values = {name: getattr(inputs, name, None) for name in type(inputs).model_fields}
        for where, value in input_files(type(inputs), values, builtin=True):
            if names_a_file(value) and not (base_dir / Path(value).expanduser()).exists():
                raise InputError(f"intake.inputs.{where}: not found: {base_dir / Path(value).expanduser()}")
            found.append(f"intake.inputs.{where}: {value}")
        return found

    # -- the main path ---------------------------------------------------------------------

    def parse_inputs(self, inputs: Mapping[str, Any]) -> BaseModel:
        return self.inputs_model.model_validate(dict(inputs))

    def parse_verification(self, settings: Mapping[str, Any]) -> BaseModel:
        return self.verification_model.model_validate(dict(settings))

    @abstractmethod
    def load_inputs(self, inputs: BaseModel, base_dir: Path) -> Any:
        """What the main path consumes (frames, images, tensors), from the parsed intake.inputs;
        relative paths are taken from `base_dir` (the task record's folder)."""

    def prepare(self, loaded: LoadedModel, data: Any, inputs: BaseModel, verification: BaseModel) -> list[str]:
        """Called once on a freshly loaded model, before any run or export of it, for settings that
        need the inputs (e.g. statistics estimated from them). Returns notes for the reports."""
        return []

    @abstractmethod
    def run_main_path(
        self, loaded: LoadedModel, data: Any, inputs: BaseModel, verification: BaseModel, hooks: RunHooks
    ) -> MainPathRun:
        """Run the entry users call on `data`, calling `hooks.step(i)` after each step."""

    # -- verification ----------------------------------------------------------------------

    def comparison(self, verification: BaseModel) -> list[OutputCheck]:
        """How a spliced run is judged against the PyTorch reference. Default: every output,
        float ones by cosine / max abs, others exactly."""
        return [
            OutputCheck(output="*", metric="tensor", label="every output (floats by cosine / max abs, others exactly)")
        ]

    def precision_checks(self, verification: BaseModel) -> list[OutputCheck]:
        """How a run with every graph emulated in its ATC precision mode is judged against the
        PyTorch reference: checks that mean something at fp16's precision, on any weights. Default:
        `comparison` with its `tensor` and `max_abs` checks held to fp16's gates (`FP16_GATES`: the
        max-abs bound scales with the reference's magnitude; a `max_abs` threshold is written for
        fp32 parity), exact and IoU checks as they are. A driver whose outputs are thresholded
        (masks, detections after a score threshold, labels, generated tokens) should judge the
        continuous values before the threshold (with a `decision` check, or a tensor check of the
        logits) and report the discrete ones, so that a flip where the reference sat at the threshold
        is not taken for a divergence."""
        return [
            c.model_copy(update={"metric": "tensor", "threshold": None, "gates": c.gates or FP16_GATES})
            if c.metric in ("tensor", "max_abs")
            else c
            for c in self.comparison(verification)
        ]

    def settings_notes(self, verification: BaseModel) -> list[str]:
        """The verification settings that are on, said plainly (every report repeats them)."""
        return []

    def picture(self, data: Any, step: StepOutput, title: str) -> Image.Image | None:
        """An image of one step's outputs (overlays), or None when the model has nothing to draw."""
        return None

    # -- where to cut ----------------------------------------------------------------------

    def seed_candidates(self) -> list[SeedCandidate]:
        """The family's known heavy subtrees; empty: the study ranks the module tree from a profile."""
        return []

    def provenance_sources(self, loaded: LoadedModel) -> list[ProvenanceSource]:
        return []

    def control_plane_notes(self) -> list[str]:
        """What the family keeps in Python around its candidates, and why (for the record)."""
        return []

    def source_limits(self, loaded: LoadedModel) -> dict[str, list[QuantityLimit | QuantitySchedule]]:
        """Per candidate: quantities whose range the source shows and the input dims they drive."""
        return {}

    def derived_args(self) -> dict[str, dict[str, ShapeDerivedArg]]:
        """Per candidate: non-tensor arguments the source computes from input shapes."""
        return {}

    def pytree_types(self, loaded: LoadedModel) -> list[type]:
        """Container classes of the model's calls to flatten into their tensors (dataclasses are found alone)."""
        return []

    @contextlib.contextmanager
    def export_patches(self, loaded: LoadedModel, candidate: str) -> Iterator[None]:
        """Entered around a candidate's export; by default the portability layer."""
        with loaded.portability:
            yield
