"""Tool: write the deployment bundle of a verified adaptation."""

from pathlib import Path
from typing import Literal

from omskills.deploy.bundle import BundleSummary
from omskills.deploy.bundle import write_bundle as _write
from omskills.host.toolkit import WorkspacePath


def write_bundle(task: WorkspacePath, out: WorkspacePath | None = None,
                 artifact: Literal["auto", "onnx", "om"] = "auto", weights: bool = True) -> BundleSummary:
    """Write one self-contained, movable folder to deploy the verified adaptation from (default
    <run>/bundle): every integrated graph's ONNX (and OM where ATC built one) with sha256, the
    contracts and shape strategies as JSON, the ATC scripts with paths relative to the bundle, the
    checkpoint and input files, a README and example.py, which runs the user's main path through
    the public API (`omskills.deploy.load_adapted(folder, backend="auto"|"om"|"onnxruntime")`).
    The loader checks the files, format and contract schema and names what is missing or changed.
    artifact "om" needs an OM for every graph, "onnx" leaves the OMs out; weights false leaves the checkpoint out (the loader
    must then be given it)."""
    return _write(Path(task), Path(out) if out else None, artifact=artifact, weights=weights)


if __name__ == "__main__":
    import sys

    from omskills.host.toolkit import run_cli

    sys.exit(run_cli(write_bundle))
