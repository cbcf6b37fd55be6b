"""Tool: scaffold a driver for a model omskills does not know yet."""

from pathlib import Path

from omskills.host.toolkit import WorkspacePath
from omskills.models.scaffold import ScaffoldedDriver
from omskills.models.scaffold import new_driver as _new_driver


def new_driver(name: str, entry: str, out_dir: WorkspacePath = ".", shape: list[int] | None = None) -> ScaffoldedDriver:
    """Write a two-function driver for a model with no driver yet: `<name>_driver.py` (build_model calls
    `entry`, run_main_path calls the model on a random input of `shape`), the task record `<name>.yaml`
    naming it, and `test_<name>_driver.py`. Then edit the two functions so they call the model the way
    the user's application does (the entry users call, not a module's forward), run validate_driver,
    and adapt with the usual tools on the new record.

    name: lowercase identifier (e.g. resnet18). entry: what builds the model, "package.module:callable"
    (e.g. "torchvision.models:resnet18"). out_dir: folder for the three files. shape: input shape
    (default [1, 3, 224, 224]).
    """
    return _new_driver(name, entry, Path(out_dir), shape)


if __name__ == "__main__":
    import sys

    from omskills.host.toolkit import run_cli

    sys.exit(run_cli(new_driver))
