"""Tool: the model drivers installed here."""

from omskills.host.toolkit import tool_hints
from omskills.records.results import DriverListing
from pydantic import BaseModel, Field


class Drivers(BaseModel):
    drivers: list[DriverListing] = Field(
        description="Each installed driver: its model family, class reference, the distribution that registered it, "
        "what it adapts, or why it cannot be loaded here."
    )


@tool_hints(title="List the model drivers", read_only=True)
def list_drivers() -> Drivers:
    """The model families omskills has a driver for here (the omskills.drivers entry points), each
    with the class, the distribution that registered it and what it adapts.

    A model without one needs a driver: a task record can also name one directly
    (intake.model.driver: a "package.module:Class", a "file.py:Class", or a two-function file made
    by new_driver)."""
    from omskills.models.registry import installed_drivers

    return Drivers(drivers=installed_drivers())


if __name__ == "__main__":
    import sys

    from omskills.host.toolkit import run_cli

    sys.exit(run_cli(list_drivers))
