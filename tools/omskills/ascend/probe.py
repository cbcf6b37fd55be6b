"""Probe this machine's Ascend side: the CANN toolkit, `atc`, the NPUs `npu-smi` lists, and the
ais_bench runtime that runs an OM.

Nothing here claims more than it saw: `atc` counts only when it is on PATH, OM inference only when
`ais_bench`/`aclruntime` import (in a child process: they may load Ascend drivers, patch
libraries or abort) and `npu-smi` lists an NPU.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from omskills.records.environment import CannProbe, NpuProbe

DEFAULT_ASCEND_ROOT = Path("/usr/local/Ascend")
# The packages an OM runs through (ais_bench's InferSession on aclruntime).
OM_RUNTIME_PACKAGES = ("ais_bench", "aclruntime")
IMPORT_TIMEOUT_S = 120
VERSION_LINE = re.compile(r"^\s*(?:version|Version|VERSION)\s*[=:]\s*(\S+)")
NPU_SMI_ROW = re.compile(r"^\|\s*\d+\s+((?:910|310|710)[A-Za-z0-9]*)\s+\|")


def probe_atc() -> str | None:
    """Where `atc` is, when it is on PATH."""
    return shutil.which("atc")


def _read_version(files: list[Path]) -> tuple[str | None, str | None]:
    for path in files:
        try:
            for line in path.read_text(errors="replace").splitlines():
                match = VERSION_LINE.match(line)
                if match:
                    return match.group(1), str(path)
        except OSError:
            continue
    return None, None


def _cann_homes(ascend_root: Path) -> list[tuple[Path, str]]:
    homes: list[tuple[Path, str]] = []
    for var in ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH"):
        if os.environ.get(var):
            homes.append((Path(os.environ[var]), var))
    homes.append((ascend_root / "ascend-toolkit" / "latest", "default path"))
    # CANN 8.x can also install as /usr/local/Ascend/cann-<version>.
    homes.extend((p, "default path") for p in sorted(ascend_root.glob("cann*"), reverse=True))
    return homes


def probe_cann(ascend_root: Path = DEFAULT_ASCEND_ROOT) -> CannProbe:
    searched: list[str] = []
    for home, found_by in _cann_homes(ascend_root):
        searched.append(str(home))
        if not home.is_dir():
            continue
        set_env = next((p for p in (home / "set_env.sh", home.parent / "set_env.sh") if p.is_file()), None)
        # *_install.info holds the toolkit's version; component version.info files come second.
        version_files = sorted(home.glob("*_install.info")) + sorted(home.glob("*/*_install.info"))
        version_files += [home / "version.info"] + sorted(home.glob("*/version.info"))
        version, version_file = _read_version(version_files)
        return CannProbe(
            home=str(home),
            found_by=found_by,
            set_env=str(set_env) if set_env else None,
            version=version,
            version_file=version_file,
            searched=searched,
        )
    return CannProbe(searched=searched)


def probe_npu() -> NpuProbe:
    npu_smi = shutil.which("npu-smi")
    if npu_smi is None:
        return NpuProbe(detail="npu-smi not on PATH (no Ascend driver here)")
    try:
        done = subprocess.run([npu_smi, "info"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as err:
        return NpuProbe(npu_smi=npu_smi, detail=f"npu-smi info failed: {err}")
    if done.returncode != 0:
        return NpuProbe(npu_smi=npu_smi, detail=f"npu-smi info exited {done.returncode}: {done.stderr.strip()[:200]}")
    for line in done.stdout.splitlines():
        match = NPU_SMI_ROW.match(line)
        if match:
            return NpuProbe(npu_smi=npu_smi, soc=f"Ascend{match.group(1)}")
    return NpuProbe(npu_smi=npu_smi, detail="npu-smi info lists no NPU")


def atc_problem(atc: str | None, cann: CannProbe) -> str:
    """Why ATC cannot run here ("" when `atc` is on PATH)."""
    if atc:
        return ""
    if cann.home:
        hint = f"source {cann.set_env}" if cann.set_env else "its set_env.sh was not found"
        return f"CANN found at {cann.home} but atc is not on PATH ({hint})"
    return f"atc not on PATH and no CANN toolkit found (searched {', '.join(cann.searched)})"


def om_run_problems(missing: list[str], npu: NpuProbe) -> list[str]:
    """Why an OM cannot run here, from the OM runtime packages that do not import and the NPU probe."""
    problems = [f"not importable: {', '.join(missing)}"] if missing else []
    if npu.soc is None:
        problems.append(npu.detail or "no NPU visible")
    return problems


def om_runtime_problem() -> str | None:
    """Why this machine cannot run an OM (each runtime package imported in a fresh interpreter,
    the NPUs listed), or None."""
    missing = [name for name in OM_RUNTIME_PACKAGES if not _imports_in_child(name)]
    return "; ".join(om_run_problems(missing, probe_npu())) or None


def _imports_in_child(name: str) -> bool:
    if importlib.util.find_spec(name) is None:
        return False
    try:
        done = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True, timeout=IMPORT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return False
    return done.returncode == 0
