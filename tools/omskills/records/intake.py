"""Intake: what to adapt (model, weights, inputs, target) and how to verify it.

The model's driver gives `inputs` and `verification` their meaning: it validates them with its
own pydantic models (`ModelDriver.inputs_model`, `verification_model`) when the record is loaded.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any, Literal

from omskills.errors import InputError
from omskills.records.base import Record
from omskills.records.names import InputPath, SafeName
from pydantic import Field, model_validator

# Folders outside the run folder that a record may name files in (os.pathsep-separated): the
# user's own inputs. `omskills adapt` adds the folder of the task record it was given.
INPUT_ROOTS_ENV = "OMSKILLS_INPUT_ROOTS"


# --soc_version values. ATC's guide gives no list (it says: "Ascend" + the Name column of
# `npu-smi info`; for Atlas A3, Chip Name + "_" + NPU Name); these are the SoC names CANN
# ships platform configurations for, as enumerated by torch_npu's SoC table and CANN's
# runtime sources: 310 / 310P / 310B inference chips, 910 (A1), 910B (Atlas A2), 910_93xx (A3).
KNOWN_SOCS: tuple[str, ...] = (
    "Ascend310",
    "Ascend310P1",
    "Ascend310P2",
    "Ascend310P3",
    "Ascend310P4",
    "Ascend310P5",
    "Ascend310P7",
    "Ascend310P3vir01",
    "Ascend310P3vir02",
    "Ascend310P3vir04",
    "Ascend310P3vir08",
    "Ascend310B1",
    "Ascend310B2",
    "Ascend310B3",
    "Ascend310B4",
    "Ascend910",
    "Ascend910A",
    "Ascend910B",
    "Ascend910ProA",
    "Ascend910ProB",
    "Ascend910PremiumA",
    "Ascend910B1",
    "Ascend910B2",
    "Ascend910B2C",
    "Ascend910B3",
    "Ascend910B4",
    "Ascend910B4-1",
    "Ascend910_9391",
    "Ascend910_9392",
    "Ascend910_9381",
    "Ascend910_9382",
    "Ascend910_9372",
    "Ascend910_9362",
)


class ModelSpec(Record):
    # A registered model family (`omskills drivers` lists them) ...
    family: str | None = None
    # ... or the driver named directly: "package.module:Class", "path/in/workspace.py:Class", or a
    # file "path.py" with the two functions build_model and run_main_path. Paths are relative to
    # the task record's folder.
    driver: InputPath | None = None
    # "package" = the installed package; otherwise a path to a checkout of the source.
    source: InputPath = "package"
    builder: str | None = None  # what builds the model, in the driver's terms (a builder function)
    builder_kwargs: dict[str, Any] = Field(default_factory=dict)
    scale: Literal["full", "tiny"] = "full"
    # None = random initialisation with `seed` (labelled "random" in every report).
    checkpoint: InputPath | None = None
    # numpy's generator takes seeds below 2**32; the engine seeds it (and torch's) with this.
    seed: int = Field(0, ge=0, lt=2**32)
    # Device of the PyTorch reference: cpu here, cuda where a GPU exists, npu with torch_npu.
    device: str = Field("cpu", pattern=r"^(cpu|cuda|npu)(:[0-9]{1,3})?$")

    @model_validator(mode="after")
    def _names_a_driver(self) -> ModelSpec:
        if not (self.family or self.driver):
            raise ValueError(
                "set family (a registered driver, see `omskills drivers`) or driver (module:Class or a file)"
            )
        return self


class TargetSpec(Record):
    soc: str = "Ascend910B4"
    cann_version: str | None = None
    # The NPU the deployed graphs run on (InferSession's device_id, the CANN provider's device_id).
    device_id: int = Field(default=0, ge=0)
    # Candidates to deploy whatever their share of the main path (the plan defers small ones);
    # for a driver that names no seeds, a profiled subtree of that name is a seed whatever its share.
    deploy: list[SafeName] = Field(default_factory=list)
    # Candidates left in PyTorch whatever their share (a share near the plan's line moves with the
    # machine's load; a module not worth a graph call of its own).
    defer: list[SafeName] = Field(default_factory=list)
    # The host<->device link for the traffic report's predicted link time; unset, the SoC family's
    # default (omskills.ascend.link says what each rests on).
    link_gb_s: float | None = Field(default=None, gt=0)  # copy bandwidth per direction, GB/s
    round_trip_us: float | None = Field(default=None, ge=0)  # one synchronous launch or copy, microseconds


class Intake(Record):
    model: ModelSpec
    inputs: dict[str, Any] = Field(default_factory=dict)  # the driver's inputs_model validates it
    # Other inputs the deployment must serve (other image sizes, batch sizes, lengths): each entry
    # overrides fields of `inputs`. The study captures every candidate on them too, and a dim that
    # varies across them takes every size between the smallest and the largest seen.
    shape_inputs: list[dict[str, Any]] = Field(default_factory=list)
    target: TargetSpec = Field(default_factory=TargetSpec)
    verification: dict[str, Any] = Field(default_factory=dict)  # the driver's verification_model validates it


def allowed_input_roots(workspace: Path, *extra: str | Path | None) -> list[Path]:
    """Where a path named in a record may lead: the workspace (run folder) first, then the roots in
    $OMSKILLS_INPUT_ROOTS and `extra`, each resolved (symlinks followed)."""
    given = [r for r in os.environ.get(INPUT_ROOTS_ENV, "").split(os.pathsep) if r.strip()]
    roots = [Path(workspace).resolve()]
    for root in [*given, *(e for e in extra if e)]:
        resolved = Path(root).expanduser().resolve()
        if resolved not in roots:
            roots.append(resolved)
    return roots


def confined_path(
    value: str,
    field: str,
    base_dir: Path,
    roots: list[Path],
    *,
    root_name: str = "the run folder",
    widened_by_env: bool = True,
) -> Path:
    """`value` (relative to `base_dir`) resolved with its symlinks followed; an InputError naming
    `field` when it leads outside every root, so a record cannot make a tool read any file.

    The one confinement check of omskills: the MCP server calls it too, for tool arguments and
    resources (`root_name="the workspace"`, `widened_by_env=False`: no variable widens the workspace).
    """
    if "\x00" in value:
        raise InputError(f"{field}: a path holds a NUL byte")
    path = Path(value).expanduser()
    try:
        resolved = (path if path.is_absolute() else Path(base_dir) / path).resolve()
    except (OSError, RuntimeError) as err:  # a name too long for the system, a symlink loop
        raise InputError(f"{field}: {value[:80]!r}: {err}") from None
    if not any(resolved.is_relative_to(root) for root in roots):
        via = f" (through a symlink to {resolved})" if resolved != Path(os.path.abspath(Path(base_dir) / path)) else ""
        others = f" or the allowed input roots ({', '.join(map(str, roots[1:]))})" if roots[1:] else ""
        widen = f"; add its folder to {INPUT_ROOTS_ENV} to allow it" if widened_by_env else ""
        raise InputError(f"{field}: {value} is outside {root_name} {roots[0]}{others}{via}{widen}")
    _refuse_special(resolved, field, value)
    return resolved


def _refuse_special(path: Path, field: str, value: str) -> None:
    """A FIFO, a socket or a device is no file a record may name: opening one can block forever
    (a FIFO) or read without end (/dev/zero). Checked before anything opens it."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return  # missing: the reader says so, naming the field
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise InputError(f"{field}: {value} is not a regular file or folder (a FIFO, socket or device): refused")
