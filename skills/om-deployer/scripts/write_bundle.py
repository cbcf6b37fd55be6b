"""Tool: write the deployment bundle of a verified adaptation."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from omskills.host.toolkit import TaskPath, WorkspacePath, tool_hints
from omskills.records.choices import BundleArtifact
from omskills.records.results import BundleSummary
from pydantic import Field


# destructive: a rerun replaces the previous bundle folder whole, files a user added to it included.
@tool_hints(title="Write the deployment bundle", read_only=False, destructive=True, idempotent=True)
def write_bundle(
    task: TaskPath,
    out: Annotated[
        WorkspacePath | None,
        Field(
            description="Bundle folder (default <run>/bundle); an existing bundle "
            "there is replaced, any other non-empty folder refused."
        ),
    ] = None,
    artifact: Annotated[
        BundleArtifact,
        Field(
            description='"auto": the OMs ATC built plus every ONNX; "om": an OM for every '
            'graph (refused if one is missing); "onnx": no OMs.'
        ),
    ] = "auto",
    weights: Annotated[
        bool,
        Field(
            description="Copy the checkpoint into the bundle; false leaves it out (the loader must then be given it)."
        ),
    ] = True,
    precompute: Annotated[
        list[dict[str, Any]] | None,
        Field(
            description=(
                'Input sets the deployment will meet, each fields of intake.inputs (e.g. [{"prompt": "a red car"}]): '
                "the main path runs once on each (ONNX Runtime CPU), and graphs whose inputs derive from user "
                "inputs and the model's constants alone (a text tower) carry their outputs in the bundle, answered "
                "from memory when deployed. The result names what was stored (remembered: entries, bytes) and "
                "why nothing was for every other graph (not_remembered)."
            )
        ),
    ] = None,
) -> BundleSummary:
    """Write one self-contained, movable folder to deploy the verified adaptation from, with a
    README and an example.py that runs the user's main path through the public API.

    Holds every integrated graph's ONNX (and OM where ATC built one) with sha256, the contracts and
    shape strategies as JSON, the ATC scripts with paths relative to the bundle, the checkpoint and
    input files. The public API is `omskills.deploy.load_adapted(folder,
    backend="auto"|"om"|"onnxruntime")`; the loader checks the files, format and contract schema
    and names what is missing or changed."""
    from omskills.deploy.bundle import write_bundle as _write

    return _write(
        Path(task), Path(out) if out else None, artifact=artifact, weights=weights, precompute=precompute or []
    )


if __name__ == "__main__":
    import sys

    from omskills.host.toolkit import run_cli

    sys.exit(run_cli(write_bundle))
