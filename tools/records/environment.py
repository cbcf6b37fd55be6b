"""Environment probe: what is installed here, and which stages can really run on this machine."""

from __future__ import annotations

from typing import Literal

from omskills.records.base import Record
from pydantic import Field

StageName = Literal["inventory", "profile", "contracts", "export", "optimize", "precheck", "atc", "om_run", "verify"]
STAGES: tuple[StageName, ...] = ("inventory", "profile", "contracts", "export", "optimize", "precheck", "atc", "om_run", "verify")


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
    probed_at: str
    python: str
    platform: str
    torch: TorchProbe
    packages: list[PackageProbe]
    onnxruntime_providers: list[str] = Field(default_factory=list)
    atc: str | None = None  # path of `atc`, if on PATH
    cann: CannProbe
    npu: NpuProbe
    stages: list[StageCapability]
    backends: list[str]  # e.g. onnxruntime:CPUExecutionProvider, om
    notes: list[str] = Field(default_factory=list)

    def package(self, name: str) -> PackageProbe | None:
        return next((p for p in self.packages if p.name == name), None)

    def stage(self, name: StageName) -> StageCapability:
        return next(s for s in self.stages if s.stage == name)

    def can_run(self, name: StageName) -> bool:
        return self.stage(name).can_run
