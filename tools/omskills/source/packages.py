"""Where a model's Python package lives: installed, or in a checkout the user names."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from omskills.errors import InputError


def package_root(source: str, package: str) -> Path:
    """Folder that holds `package`: the installed one (`source` "package", found without importing
    it), or a checkout given as the folder holding the package or as the package folder itself."""
    if source == "package":
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise InputError(f"intake.model.source: package {package!r} is not installed in {sys.executable}")
        return Path(list(spec.submodule_search_locations)[0]).resolve().parent
    path = Path(source).expanduser()
    if not path.exists():
        raise InputError(f"intake.model.source: path does not exist: {path}")
    if (path / package / "__init__.py").is_file():
        return path.resolve()
    if path.name == package and (path / "__init__.py").is_file():
        return path.resolve().parent
    raise InputError(
        f"intake.model.source: {path} does not contain the {package!r} package "
        f"(expected {path / package / '__init__.py'})"
    )
