"""A new driver from an entry callable: the two-function driver file, its task record and a test.

    omskills new-driver resnet18 --entry torchvision.models:resnet18 --shape 1,3,64,64

writes `resnet18_driver.py` (build_model calls the entry; run_main_path calls the model on a
random input of that shape), `resnet18.yaml` (the task record naming the driver file) and
`test_resnet18_driver.py` (validate-driver, then adapt with a passing verdict).
"""

from __future__ import annotations

import re
from pathlib import Path

import jinja2
from omskills.errors import InputError
from omskills.registry import RegistryError, import_reference
from pydantic import BaseModel, Field

TEMPLATES = Path(__file__).resolve().parent / "templates" / "driver"
NAME = re.compile(r"^[a-z][a-z0-9_]{0,62}$")


class ScaffoldedDriver(BaseModel):
    name: str = Field(description="The driver's name, which prefixes the three files.")
    entry: str = Field(description="The callable that builds the model, as 'package.module:callable'.")
    driver: str = Field(
        description="Path of the driver file written (<name>_driver.py: build_model and run_main_path)."
    )
    task: str = Field(description="Path of the task record written (<name>.yaml), naming the driver file.")
    test: str = Field(
        description=(
            "Path of the test written (test_<name>_driver.py): validate-driver, then adapt with a passing verdict."
        )
    )
    next_steps: list[str] = Field(
        description=(
            "What to do next, in order: edit the driver to call the model as your application does, validate it, adapt."
        )
    )


def new_driver(name: str, entry: str, folder: Path, shape: list[int] | None = None) -> ScaffoldedDriver:
    """Write the driver file, task record and test for `entry` ("package.module:callable") into `folder`."""
    if not NAME.match(name):
        raise InputError(f"name: {name!r} must be lowercase letters, digits and underscores, starting with a letter")
    module, sep, attribute = entry.partition(":")
    if not sep or not module or not attribute.isidentifier():
        raise InputError(f"entry: {entry!r} is not 'package.module:callable' (e.g. torchvision.models:resnet18)")
    try:
        target = import_reference(entry, "entry")
    except RegistryError as err:
        raise InputError(str(err)) from None
    if not callable(target):
        raise InputError(f"entry: {entry} is a {type(target).__name__}, not something to call")
    shape = shape or [1, 3, 224, 224]
    if not shape or any(d < 1 for d in shape):
        raise InputError(f"shape: {shape} must be positive sizes")
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise InputError(f"out_dir: {folder} is a file, not a folder")
    files = {
        "driver": folder / f"{name}_driver.py",
        "task": folder / f"{name}.yaml",
        "test": folder / f"test_{name}_driver.py",
    }
    existing = [str(p) for p in files.values() if p.exists()]
    if existing:
        raise InputError(f"not overwriting {', '.join(existing)}: move them away or choose another name")
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES), undefined=jinja2.StrictUndefined, keep_trailing_newline=True
    )
    values = {"name": name, "module": module, "attribute": attribute, "shape": list(shape)}
    folder.mkdir(parents=True, exist_ok=True)
    for key, template in (("driver", "DRIVER.py.j2"), ("task", "TASK.yaml.j2"), ("test", "test_DRIVER.py.j2")):
        files[key].write_text(env.get_template(template).render(**values))
    return ScaffoldedDriver(
        name=name,
        entry=entry,
        driver=str(files["driver"]),
        task=str(files["task"]),
        test=str(files["test"]),
        next_steps=[
            f"edit build_model and run_main_path in {files['driver'].name} to call the model as your application does",
            f"omskills validate-driver {files['task']}",
            f"omskills adapt {files['task']}",
        ],
    )
