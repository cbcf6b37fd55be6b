"""Errors a user should read: one line, naming the field, path or argument at fault."""


class OmskillsError(Exception):
    """An error whose message is meant for the user (CLI prints it on one line, MCP as ToolError)."""


class TaskRecordError(OmskillsError):
    """The task record is missing, malformed or inconsistent."""


class InputError(OmskillsError):
    """A path or argument given by the user does not exist or is not usable."""


class StageError(OmskillsError):
    """A stage cannot run because an earlier stage has not produced what it needs."""
