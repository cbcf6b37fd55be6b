"""Tool: scaffold a driver for a model omskills does not know yet."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from omskills.host.toolkit import WorkspacePath, tool_hints
from omskills.models.scaffold import ScaffoldedDriver
from pydantic import Field


@tool_hints(title="Scaffold a model driver", read_only=False, destructive=False, idempotent=True)
def new_driver(
    name: Annotated[
        str, Field(description="Lowercase identifier of the model, letters, digits and underscores (e.g. resnet18).")
    ],
    entry: Annotated[
        str, Field(description='What builds the model, "package.module:callable" (e.g. "torchvision.models:resnet18").')
    ],
    out_dir: Annotated[
        WorkspacePath,
        Field(description="Folder for the three files (created if missing); existing files are never overwritten."),
    ] = ".",
    shape: Annotated[
        list[int] | None,
        Field(description="Shape of the random input run_main_path feeds the model (default [1, 3, 224, 224])."),
    ] = None,
) -> ScaffoldedDriver:
    """Write a two-function driver for a model with no driver yet, its task record and a test:
    `<name>_driver.py`, `<name>.yaml` and `test_<name>_driver.py`.

    build_model calls `entry`; run_main_path calls the model on a random input of `shape`. Then edit
    the two functions so they call the model the way the user's application does (the entry users
    call, not a module's forward), run validate_driver, and adapt with the usual tools on the new
    record. Refuses to overwrite any of the three files.
    """
    from omskills.models.scaffold import new_driver as _new_driver

    return _new_driver(name, entry, Path(out_dir), shape)


if __name__ == "__main__":
    import sys

    from omskills.host.toolkit import run_cli

    sys.exit(run_cli(new_driver))
