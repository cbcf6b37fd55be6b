"""This installation's version, for `omskills --version` and the install manifests (no heavy import)."""

from __future__ import annotations


def installed_version() -> str:
    """The version in the package metadata; a source tree that was never installed gives the package's own."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("omskills")
    except PackageNotFoundError:
        from omskills.version import __version__

        return __version__
