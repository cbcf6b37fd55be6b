"""Base model for everything stored in a task record: strict (unknown fields are errors)."""

from pydantic import BaseModel, ConfigDict


class Record(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
