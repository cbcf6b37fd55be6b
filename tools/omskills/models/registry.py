"""Finding the driver of a task record, and reading its intake through it.

`intake.model.family` names an installed driver: an entry of the `omskills.drivers` entry-point
group (`omskills drivers` lists them). `intake.model.driver` names one directly:

- "package.module:Class": an importable driver class;
- "path/to/file.py:Class": a class in a file (relative to the task record's folder);
- "path/to/file.py": a file with the two functions `build_model` and `run_main_path`
  (see `omskills.models.generic`).
"""

from __future__ import annotations

import importlib.util
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from omskills.errors import TaskRecordError
from omskills.files import file_module_name
from omskills.models.api import ModelDriver, input_files, input_files_from
from omskills.records.intake import Intake, ModelSpec, allowed_input_roots, confined_path
from omskills.records.names import is_input_path
from omskills.records.results import DriverListing
from omskills.records.task import validation_problems
from omskills.registry import Registry, RegistryError, import_reference
from pydantic import BaseModel, ValidationError

DRIVER_GROUP = "omskills.drivers"
DRIVERS: Registry[type[ModelDriver]] = Registry("model driver", group=DRIVER_GROUP)

_instances: dict[str, ModelDriver] = {}
_lock = threading.Lock()


def driver_for(spec: ModelSpec, base_dir: Path | None = None) -> ModelDriver:
    """The driver the spec names (one instance per driver per process)."""
    if spec.driver:
        key, make = _direct(spec.driver, base_dir)
    else:
        key, make = f"family:{spec.family}", lambda: _from_family(str(spec.family))
    with _lock:
        if key not in _instances:
            _instances[key] = make()
        return _instances[key]


def family_driver(family: str) -> ModelDriver:
    """The installed driver of `family`."""
    return driver_for(ModelSpec(family=family))


def _from_family(family: str) -> ModelDriver:
    try:
        cls = DRIVERS.get(family)
    except RegistryError as err:
        raise TaskRecordError(f"intake.model.family: {err}") from None
    return _instantiate(cls, f"intake.model.family {family!r}")


def _direct(reference: str, base_dir: Path | None):
    path_part, sep, name = reference.partition(":")
    if path_part.endswith(".py"):
        # A driver file is an input like any other: inside the record's folder or an allowed input
        # root, checked before it is imported (importing it runs it).
        base = base_dir or Path.cwd()
        path = confined_path(path_part, "intake.model.driver", base, allowed_input_roots(base))
        key = f"file:{path}:{name}"
        if not sep:
            return key, lambda: _function_driver(path)
        return key, lambda: _instantiate(
            getattr_or_error(_module_from_file(path), name, path), f"intake.model.driver {reference!r}"
        )
    if not sep:
        raise TaskRecordError(f"intake.model.driver: {reference!r} is neither 'package.module:Class' nor a .py file")
    try:
        cls = import_reference(reference, "intake.model.driver")
    except RegistryError as err:
        raise TaskRecordError(str(err)) from None
    return f"class:{reference}", lambda: _instantiate(cls, f"intake.model.driver {reference!r}")


def getattr_or_error(module: ModuleType, name: str, path: Path) -> type:
    cls = getattr(module, name, None)
    if cls is None:
        raise TaskRecordError(f"intake.model.driver: {path} defines no {name!r}")
    return cls


def _module_from_file(path: Path) -> ModuleType:
    if not path.is_file():
        raise TaskRecordError(f"intake.model.driver: driver file not found: {path}")
    # One stable module name per file, so classes defined there pickle and repeat imports share it.
    name = file_module_name(path)
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise TaskRecordError(f"intake.model.driver: cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[name]
        raise TaskRecordError(f"intake.model.driver: importing {path} failed: {type(err).__name__}: {err}") from err
    return module


def _function_driver(path: Path) -> ModelDriver:
    from omskills.models.generic import FunctionDriver

    return FunctionDriver(_module_from_file(path), path)


def _instantiate(cls: object, where: str) -> ModelDriver:
    if not (isinstance(cls, type) and issubclass(cls, ModelDriver)):
        raise TaskRecordError(f"{where}: {cls!r} is not a ModelDriver subclass")
    missing = [name for name in ("family", "inputs_model") if not hasattr(cls, name)]
    if missing:
        raise TaskRecordError(f"{where}: {cls.__name__} does not set {', '.join(missing)}")
    try:
        return cls()
    except TypeError as err:
        raise TaskRecordError(f"{where}: {cls.__name__}() failed: {err}") from None


def resolved_spec(spec: ModelSpec, base_dir: Path | None) -> ModelSpec:
    """The spec with its relative paths (source checkout, checkpoint, driver file) taken from `base_dir`."""
    if base_dir is None:
        return spec
    update: dict[str, str] = {}
    if spec.source != "package" and not Path(spec.source).expanduser().is_absolute():
        update["source"] = str((base_dir / spec.source).resolve())
    if spec.checkpoint and not Path(spec.checkpoint).expanduser().is_absolute():
        update["checkpoint"] = str((base_dir / spec.checkpoint).resolve())
    path_part, sep, name = (spec.driver or "").partition(":")
    if path_part.endswith(".py") and not Path(path_part).expanduser().is_absolute():
        update["driver"] = str((base_dir / path_part).resolve()) + sep + name
    return spec.model_copy(update=update) if update else spec


def localised_intake(intake: Intake, base_dir: Path) -> Intake:
    """The intake with every relative path (model source, checkpoint and driver file, and the inputs
    the driver marks `InputPath`) made absolute from `base_dir`, so a copy of the record elsewhere
    (a run folder) still finds them. A built-in clip ("builtin:shapes") is left as it is."""
    model = resolved_spec(intake.model, base_dir)
    driver = driver_for(model, base_dir)

    def localised(given: dict) -> dict:
        return input_files_from(driver.inputs_model, given, base_dir)

    return intake.model_copy(
        update={
            "model": model,
            "inputs": localised(intake.inputs),
            "shape_inputs": [localised(s) for s in intake.shape_inputs],
        }
    )


def intake_paths(intake: Intake, driver: ModelDriver) -> list[tuple[str, str]]:
    """Every file or folder the intake names, as (field, value): the source checkout, the
    checkpoint, the driver file and the inputs the driver marks `InputPath`, each item of a list of
    them too (`intake.inputs.frames[2]`; all but a built-in clip, "builtin:shapes", whatever colons a
    path holds)."""
    named = model_paths(intake.model)
    given = [("intake.inputs", intake.inputs)] + [
        (f"intake.shape_inputs[{k}]", s) for k, s in enumerate(intake.shape_inputs)
    ]
    for where, inputs in given:
        named += [(f"{where}.{field}", value) for field, value in input_files(driver.inputs_model, inputs)]
    return named


def model_paths(spec: ModelSpec) -> list[tuple[str, str]]:
    """(field, value) of every file or folder the model fields typed `InputPath` name (no driver
    needed to find them: the driver file is among them)."""
    named: list[tuple[str, str]] = []
    for name, info in ModelSpec.model_fields.items():
        value = getattr(spec, name)
        if is_input_path(info) and isinstance(value, str) and (path := _file_named(name, value)):
            named.append((f"intake.model.{name}", path))
    return named


def _file_named(field_name: str, value: str) -> str | None:
    """The file or folder a model field's value names: none for the installed package or a driver
    named by module, the .py part of a driver file reference."""
    if field_name == "source" and value == "package":
        return None
    if field_name == "driver":
        path = value.partition(":")[0]
        return path if path.endswith(".py") else None
    return value or None


def confine_intake(intake: Intake, base_dir: Path, roots: list[Path]) -> None:
    """Every path the intake names must resolve (symlinks followed) inside one of `roots`; the
    first that does not is an InputError naming its field."""
    driver = driver_for(intake.model, base_dir)
    for where, value in intake_paths(intake, driver):
        confined_path(value, where, base_dir, roots)


@dataclass
class BoundIntake:
    """A record's intake read through its driver: the driver and the typed inputs and settings."""

    driver: ModelDriver
    inputs: BaseModel
    verification: BaseModel
    # intake.shape_inputs, each merged over intake.inputs and validated like them.
    shape_inputs: list[BaseModel] = field(default_factory=list)


def bind_intake(intake: Intake, base_dir: Path | None = None) -> BoundIntake:
    """The intake's driver, with intake.inputs and intake.verification validated by it."""
    driver = driver_for(intake.model, base_dir)
    try:
        inputs = driver.parse_inputs(intake.inputs)
    except ValidationError as err:
        raise TaskRecordError(f"{validation_problems(err, 'intake.inputs')} ({driver.family} driver)") from None
    try:
        verification = driver.parse_verification(intake.verification)
    except ValidationError as err:
        raise TaskRecordError(f"{validation_problems(err, 'intake.verification')} ({driver.family} driver)") from None
    shape_inputs = []
    for index, overrides in enumerate(intake.shape_inputs):
        try:
            shape_inputs.append(driver.parse_inputs({**intake.inputs, **overrides}))
        except ValidationError as err:
            where = f"intake.shape_inputs[{index}]"
            raise TaskRecordError(f"{validation_problems(err, where)} ({driver.family} driver)") from None
    return BoundIntake(driver=driver, inputs=inputs, verification=verification, shape_inputs=shape_inputs)


def installed_drivers() -> list[DriverListing]:
    """Every driver of the entry-point group, with its description (or why it does not load)."""
    listed = []
    for entry in DRIVERS.entries():
        try:
            cls = DRIVERS.get(entry.name)
            listed.append(
                DriverListing(
                    family=entry.name,
                    reference=entry.reference,
                    origin=entry.origin,
                    description=getattr(cls, "description", ""),
                )
            )
        except RegistryError as err:
            listed.append(
                DriverListing(family=entry.name, reference=entry.reference, origin=entry.origin, error=str(err))
            )
    return listed
