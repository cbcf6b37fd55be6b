"""Everything a model driver is written against, in one import.

    from omskills.models.kit import ModelDriver, LoadedModel, MainPathRun, StepOutput, OutputCheck

A driver subclasses `ModelDriver` (see `omskills.models.api` for what each method is for) and
registers under the `omskills.drivers` entry-point group, or is named in a task record's
`intake.model.driver`. The helpers below are the engine's parts a driver may use: reading videos
and images, drawing instances, the device-portability layer for CUDA-minded code, and the
records that describe comparisons, shape ranges and shape-derived arguments.
"""

from omskills.errors import InputError
from omskills.models.api import (
    InputPath,
    LoadedModel,
    MainPathRun,
    ModelDriver,
    NoSettings,
    ProvenanceSource,
    RunHooks,
    SeedCandidate,
    StepOutput,
    as_arrays,
    check_builder_kwargs,
)
from omskills.models.checkpoints import load_state_dict
from omskills.models.media import load_video
from omskills.models.random_weights import calibrate_batch_norm
from omskills.records.contracts import DimRef, QuantityLimit, QuantitySchedule, ShapeDerivedArg
from omskills.records.intake import ModelSpec
from omskills.records.parity import FP16_GATES, ParityGates
from omskills.records.verify import OutputCheck
from omskills.report.pictures import draw_instances, side_by_side, titled
from omskills.source.packages import package_root
from omskills.source.portability import DevicePortability, FunctionFix, WatchedImport

__all__ = [
    "DevicePortability",
    "FP16_GATES",
    "DimRef",
    "FunctionFix",
    "InputError",
    "InputPath",
    "LoadedModel",
    "MainPathRun",
    "ModelDriver",
    "ModelSpec",
    "NoSettings",
    "OutputCheck",
    "ParityGates",
    "ProvenanceSource",
    "QuantityLimit",
    "QuantitySchedule",
    "RunHooks",
    "SeedCandidate",
    "ShapeDerivedArg",
    "StepOutput",
    "WatchedImport",
    "as_arrays",
    "calibrate_batch_norm",
    "check_builder_kwargs",
    "draw_instances",
    "load_state_dict",
    "load_video",
    "package_root",
    "side_by_side",
    "titled",
]
