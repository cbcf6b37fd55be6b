"""Environment probe: what is installed here, and which stages can really run on this machine."""

from __future__ import annotations

from typing import Annotated, Literal

from omskills.records.base import Record
from omskills.records.details import DETAIL
from pydantic import Field

StageName = Literal["inventory", "profile", "contracts", "export", "optimize", "precheck", "atc", "om_run", "verify"]
STAGES: tuple[StageName, ...] = (
    "inventory",
    "profile",
    "contracts",
    "export",
    "optimize",
    "precheck",
    "atc",
    "om_run",
    "verify",
)


class PackageProbe(Record):
    name: str  # import name, e.g. "onnxruntime", "auto_optimizer"
    importable: bool
    version: str | None = None
    detail: str | None = None  # why not importable, or extra facts (e.g. where it was found)


class TorchProbe(Record):
    version: str | None
    cuda_available: bool = False
    torch_npu_importable: bool = False
    torch_npu_detail: str | None = None


class CannProbe(Record):
    """A CANN toolkit install, if any (where, its set_env.sh, its version)."""

    home: str | None = None  # e.g. /usr/local/Ascend/ascend-toolkit/latest
    found_by: str | None = None  # ASCEND_TOOLKIT_HOME, a default path, ...
    set_env: str | None = None
    version: str | None = None
    version_file: str | None = None
    searched: list[str] = Field(default_factory=list)


class NpuProbe(Record):
    npu_smi: str | None = None  # path of npu-smi, if on PATH
    soc: str | None = None  # e.g. Ascend910B4, from `npu-smi info`
    detail: str | None = None


class StageCapability(Record):
    stage: StageName
    can_run: bool
    reason: str


class EnvironmentReport(Record):
    probed_at: str = Field(description="When this machine was probed (UTC, ISO 8601).")
    python: str = Field(description="The Python version and the interpreter's path.")
    platform: str = Field(
        description="The operating system, its release and the machine's architecture (platform.platform())."
    )
    torch: TorchProbe = Field(
        description=(
            "torch's version (null when it does not import), whether it sees a CUDA device "
            "and whether torch_npu imports."
        )
    )
    packages: Annotated[list[PackageProbe], DETAIL] = Field(
        description=(
            "onnx, onnxruntime, onnxscript, onnxslim, auto_optimizer, ais_bench and aclruntime: "
            "whether each imports, its version, why not."
        )
    )
    onnxruntime_providers: list[str] = Field(
        default_factory=list,
        description="ONNX Runtime's available execution providers; empty when onnxruntime does not import.",
    )
    atc: str | None = Field(None, description="Path of the `atc` executable when it is on PATH; null otherwise.")
    cann: CannProbe = Field(
        description="The CANN toolkit found, if any: its home, set_env.sh and version, and the folders searched."
    )
    npu: NpuProbe = Field(description="Where npu-smi is and the NPU SoC it reports, or why no NPU was seen.")
    stages: list[StageCapability] = Field(
        description="Per adaptation stage (inventory to verify): whether it can run here, and why or why not."
    )
    backends: list[str] = Field(
        description=(
            "Backends the verification can run graphs on: 'onnxruntime:<provider>' per provider, "
            "and 'om' when an NPU can run OM files."
        )
    )
    notes: list[str] = Field(
        default_factory=list,
        description="Where the intake's target differs from this machine (its SoC, its CANN version).",
    )
    checked: list[str] = Field(
        default_factory=list,
        description=(
            "What the gate checked of the task before probing, one line each: the input files (a video's frames), "
            "the builder, the checkpoint and its keys."
        ),
    )

    def package(self, name: str) -> PackageProbe | None:
        return next((p for p in self.packages if p.name == name), None)

    def stage(self, name: StageName) -> StageCapability:
        return next(s for s in self.stages if s.stage == name)

    def can_run(self, name: StageName) -> bool:
        return self.stage(name).can_run
