"""Probe this machine: which packages, toolchains and devices exist, and so which stages can run.

Nothing here claims more than it saw: the Ascend side (CANN, `atc`, NPUs, the OM runtime) is
probed by `omskills.ascend.probe`; the backends are those of the `omskills.backends` registry that
say they run here (`RuntimeBackend.runs_here`), a third party's among them. Packages whose import
may have side effects or crash without Ascend drivers (torch_npu, ais_bench, aclruntime,
auto_optimizer) are imported in a child process.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from omskills.ascend.probe import (
    DEFAULT_ASCEND_ROOT,
    OM_RUNTIME_PACKAGES,
    atc_problem,
    om_run_problems,
    probe_atc,
    probe_cann,
    probe_npu,
)
from omskills.records.environment import (
    CannProbe,
    EnvironmentReport,
    NpuProbe,
    PackageProbe,
    StageCapability,
    TorchProbe,
)
from omskills.records.intake import Intake
from omskills.runtime import BACKENDS, available_backends

SUBPROCESS_TIMEOUT_S = 120
# Environment variables that change what imports or runs here (the rest cannot change a probe's answer).
PROBED_VARIABLES = ("PATH", "LD_LIBRARY_PATH", "PYTHONPATH", "CUDA_VISIBLE_DEVICES")
PROBED_PREFIXES = ("ASCEND", "TOOLCHAIN_HOME")
# Imported in this process: plain Python/C extensions without device side effects.
IN_PROCESS = ("onnx", "onnxruntime", "onnxscript", "onnxslim")
# Imported in a child process: they may load Ascend drivers, patch libraries or abort.
IN_CHILD = OM_RUNTIME_PACKAGES


@functools.lru_cache(maxsize=1)
def _distributions_by_package() -> dict[str, list[str]]:
    # Reads every installed distribution's file list: a second or more in a big environment.
    return importlib.metadata.packages_distributions()


def _distribution_version(import_name: str) -> str | None:
    dists = _distributions_by_package().get(import_name, [])
    for dist in dists:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _import_in_process(name: str) -> PackageProbe:
    try:
        module = importlib.import_module(name)
    except Exception as err:  # noqa: BLE001 - any import failure means "not usable here"
        return PackageProbe(name=name, importable=False, detail=f"{type(err).__name__}: {err}")
    version = getattr(module, "__version__", None) or _distribution_version(name)
    return PackageProbe(name=name, importable=True, version=str(version) if version else None)


def _import_in_child(name: str, statement: str | None = None) -> PackageProbe:
    """Import in a fresh interpreter; `statement` replaces the plain `import name` if given."""
    return _start_import_in_child(name, statement)()


def _start_import_in_child(name: str, statement: str | None = None) -> Callable[[], PackageProbe]:
    """Start the import in a fresh interpreter now; the call returned waits for its verdict (so
    the slow imports of the child probes overlap each other and this process's own)."""
    if statement is None and importlib.util.find_spec(name) is None:
        return lambda: PackageProbe(name=name, importable=False, detail="not installed")
    child = subprocess.Popen(
        [sys.executable, "-c", statement or f"import {name}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )

    def verdict() -> PackageProbe:
        try:
            _, stderr = child.communicate(timeout=SUBPROCESS_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            child.kill()
            child.communicate()
            return PackageProbe(name=name, importable=False, detail=f"import timed out after {SUBPROCESS_TIMEOUT_S} s")
        if child.returncode != 0:
            last = (stderr.strip().splitlines() or [f"exit code {child.returncode}"])[-1]
            return PackageProbe(name=name, importable=False, version=_distribution_version(name), detail=last[:300])
        return PackageProbe(name=name, importable=True, version=_distribution_version(name))

    return verdict


def _start_auto_optimizer_probe() -> Callable[[], PackageProbe]:
    # Huawei's auto_optimizer imports onnx.mapping (gone in onnx >= 1.19); when the project's
    # compatibility shim exists, probe through it, as the optimize stage will import it.
    if importlib.util.find_spec("auto_optimizer") is None:
        return lambda: PackageProbe(
            name="auto_optimizer", importable=False, detail="not installed (msit surgeon / ait-surgeon)"
        )
    if importlib.util.find_spec("omskills.convert.auto_optimizer") is None:
        return _start_import_in_child("auto_optimizer")
    started = _start_import_in_child(
        "auto_optimizer", "from omskills.convert.auto_optimizer import load_auto_optimizer\nload_auto_optimizer()"
    )
    via = "imported through omskills.convert.auto_optimizer (onnx.mapping rebuilt)"

    def verdict() -> PackageProbe:
        probe = started()
        return probe.model_copy(update={"detail": f"{probe.detail}; {via}" if probe.detail else via})

    return verdict


def _probe_torch() -> TorchProbe:
    try:
        import torch
    except Exception as err:  # noqa: BLE001
        return TorchProbe(version=None, torch_npu_detail=f"torch not importable: {type(err).__name__}: {err}")
    npu = _import_in_child("torch_npu")
    return TorchProbe(
        version=torch.__version__,
        cuda_available=bool(torch.cuda.is_available()),
        torch_npu_importable=npu.importable,
        torch_npu_detail=npu.detail,
    )


def _onnxruntime_providers(ort: PackageProbe) -> list[str]:
    if not ort.importable:
        return []
    import onnxruntime

    return list(onnxruntime.get_available_providers())


@dataclass
class _Facts:
    """What the stage rules look at."""

    packages: dict[str, PackageProbe]
    torch: TorchProbe
    providers: list[str]
    backends: list[str]  # what the registered backends run here
    atc: str | None
    cann: CannProbe
    npu: NpuProbe
    device: str
    model_problem: str | None  # why the model source cannot be found, None if it can

    def ok(self, name: str) -> bool:
        probe = self.packages.get(name)
        return probe is not None and probe.importable

    def missing(self, *names: str) -> list[str]:
        return [n for n in names if not self.ok(n)]


def _stage(stage: str, problems: list[str], ok_reason: str) -> StageCapability:
    problems = [p for p in problems if p]
    return StageCapability(stage=stage, can_run=not problems, reason="; ".join(problems) if problems else ok_reason)  # type: ignore[arg-type]


def _needs(facts: _Facts, *names: str) -> str:
    missing = facts.missing(*names)
    return f"not importable: {', '.join(missing)}" if missing else ""


def device_problem(torch_probe: TorchProbe, device: str) -> str:
    """Why the PyTorch reference cannot run on `device` here ("" when it can)."""
    kind = device.split(":")[0]
    if kind == "cuda" and not torch_probe.cuda_available:
        return f"{device}, but torch sees no CUDA device here"
    if kind == "npu" and not torch_probe.torch_npu_importable:
        return f"{device}, but torch_npu is not importable here ({torch_probe.torch_npu_detail})"
    return ""


def _device_problem(facts: _Facts) -> str:
    problem = device_problem(facts.torch, facts.device)
    return f"intake.model.device is {problem}" if problem else ""


def _atc_stage(facts: _Facts) -> StageCapability:
    return _stage("atc", [atc_problem(facts.atc, facts.cann)], f"atc on PATH: {facts.atc}")


def _om_run_stage(facts: _Facts) -> StageCapability:
    problems = om_run_problems(facts.missing(*OM_RUNTIME_PACKAGES), facts.npu)
    return _stage("om_run", problems, f"ais_bench and aclruntime import, NPU {facts.npu.soc}")


def _stages(facts: _Facts) -> list[StageCapability]:
    torch_problem = "" if facts.torch.version else "torch not importable"
    runs_model = [torch_problem, facts.model_problem or "", _device_problem(facts)]
    optimizers = (
        "onnxslim and auto_optimizer" if facts.ok("auto_optimizer") else "onnxslim only (auto_optimizer not importable)"
    )
    backends_problem = "" if facts.backends else f"no runtime backend: none of {BACKENDS.names()} runs here"
    return [
        _stage("inventory", [facts.model_problem or ""], "static ast scan: needs only Python and the model source"),
        _stage("profile", runs_model, f"runs the main path with torch {facts.torch.version} on {facts.device}"),
        _stage("contracts", runs_model, f"runs the main path with torch {facts.torch.version} on {facts.device}"),
        _stage(
            "export",
            [torch_problem, _needs(facts, "onnx", "onnxscript")],
            "torch.onnx (dynamo) with onnx and onnxscript",
        ),
        _stage("optimize", [_needs(facts, "onnx", "onnxslim")], optimizers),
        _stage("precheck", [_needs(facts, "onnx")], "operator check against the ATC support list (no CANN needed)"),
        _atc_stage(facts),
        _om_run_stage(facts),
        _stage("verify", [torch_problem, backends_problem], "compare torch with: " + ", ".join(facts.backends)),
    ]


def _notes(intake: Intake | None, cann: CannProbe, npu: NpuProbe) -> list[str]:
    if intake is None:
        return []
    notes = []
    target = intake.target
    if npu.soc and npu.soc != target.soc:
        notes.append(
            f"intake.target.soc is {target.soc} but npu-smi reports {npu.soc}: "
            "ATC's --soc_version must match the device"
        )
    if cann.version and target.cann_version and not cann.version.startswith(target.cann_version):
        notes.append(
            f"intake.target.cann_version is {target.cann_version} but CANN {cann.version} is installed at {cann.home}"
        )
    return notes


def probe_environment(
    intake: Intake | None = None, model_problem: str | None = None, ascend_root: Path = DEFAULT_ASCEND_ROOT
) -> EnvironmentReport:
    """Probe packages, toolchains and devices; with an intake, also its device. `model_problem`:
    why the model source cannot be found (the caller asks the driver), None when it can."""
    from omskills.records.task import now_iso

    in_children = [_start_auto_optimizer_probe()] + [_start_import_in_child(name) for name in IN_CHILD]
    packages = [_import_in_process(name) for name in IN_PROCESS]
    packages += [verdict() for verdict in in_children]
    by_name = {p.name: p for p in packages}
    torch_probe = _probe_torch()
    facts = _Facts(
        packages=by_name,
        torch=torch_probe,
        providers=_onnxruntime_providers(by_name["onnxruntime"]),
        backends=available_backends(),
        atc=probe_atc(),
        cann=probe_cann(ascend_root),
        npu=probe_npu(),
        device=intake.model.device if intake else "cpu",
        model_problem=model_problem,
    )
    return EnvironmentReport(
        probed_at=now_iso(),
        python=f"{platform.python_version()} ({sys.executable})",
        platform=platform.platform(),
        torch=torch_probe,
        packages=packages,
        onnxruntime_providers=facts.providers,
        atc=facts.atc,
        cann=facts.cann,
        npu=facts.npu,
        stages=_stages(facts),
        backends=facts.backends,
        notes=_notes(intake, facts.cann, facts.npu),
    )


def machine_state(
    intake: Intake | None = None, model_problem: str | None = None, ascend_root: Path = DEFAULT_ASCEND_ROOT
) -> str:
    """A hash of everything `probe_environment` answers from, read in a fraction of a second: the
    host, the interpreter, every installed distribution's version, the variables that change what
    imports (PATH, LD_LIBRARY_PATH, ASCEND_*...), where atc and npu-smi are, CANN's install, the
    registered runtime backends, and what the intake asks of them (device, target). The same state
    gets the same probe: a rerun reuses the recorded one instead of importing every package again
    in children."""
    distributions = sorted({(d.metadata["Name"] or "", d.version) for d in importlib.metadata.distributions()})
    variables = {k: v for k, v in os.environ.items() if k in PROBED_VARIABLES or k.startswith(PROBED_PREFIXES)}
    state = {
        "host": platform.node(),
        "python": [sys.executable, sys.version],
        "distributions": distributions,
        "variables": variables,
        "tools": [probe_atc(), shutil.which("npu-smi")],
        "backends": BACKENDS.names(),
        "cann": probe_cann(ascend_root).model_dump(mode="json"),
        "intake": [intake.model.device, intake.target.model_dump(mode="json")] if intake else None,
        "model_problem": model_problem,
    }
    return hashlib.sha256(json.dumps(state, sort_keys=True).encode()).hexdigest()[:16]
