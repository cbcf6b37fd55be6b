"""An OM "built" by tests/fake_atc: the real `run_atc` command line, run against the fake `atc`
on PATH, so a test gets an OM file the InferSession double serves with the strategy's gears."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

from omskills.ascend.atc import AtcOptions, run_atc
from omskills.records.contracts import ShapeStrategy

FAKE_ATC = Path(__file__).with_name("fake_atc")


def built_om(folder: Path, onnx: Path, strategy: ShapeStrategy, output: Path) -> Path:
    """`onnx` converted with `strategy` to `output`.om by the fake atc; its logs under folder/atc."""
    bin_dir = folder / "bin"
    bin_dir.mkdir(exist_ok=True)
    shutil.copy(FAKE_ATC, bin_dir / "atc")
    (bin_dir / "atc").chmod((bin_dir / "atc").stat().st_mode | stat.S_IXUSR)
    path = os.environ["PATH"]
    os.environ["PATH"] = f"{bin_dir}{os.pathsep}{path}"
    try:
        options = AtcOptions.from_strategy(strategy, model=str(onnx), output=str(output), soc_version="Ascend910B4")
        built = run_atc(options, folder / "atc")
    finally:
        os.environ["PATH"] = path
    assert built.status == "converted", built.reason
    return Path(built.om_path)
