"""Errors a user should read: one line, naming the field, path or argument at fault."""

import signal


class OmskillsError(Exception):
    """An error whose message is meant for the user (CLI prints it on one line, MCP as ToolError)."""


class TaskRecordError(OmskillsError):
    """The task record is missing, malformed or inconsistent."""


class InputError(OmskillsError):
    """A path or argument given by the user does not exist or is not usable."""


class StageError(OmskillsError):
    """A stage cannot run because an earlier stage has not produced what it needs."""


class Interrupted(KeyboardInterrupt):
    """A signal (SIGTERM) asked the process to stop: raised where SIGINT raises KeyboardInterrupt,
    so the step in progress records why before the process exits (128 + the signal's number)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def one_line(err: BaseException | str, limit: int = 500) -> str:
    """The first non-empty line of an error (or of a text), whitespace collapsed, at most `limit` characters.

    An OmskillsError is already written for the user, so its message stands alone; any other exception is
    prefixed with its type name ("KeyError: 'x'"), which is often the only clue; an exception with no
    message gives its type name. A cut line ends with "…" so the reader knows it was cut.
    """
    line = _first_line(err if isinstance(err, str) else str(err))
    if isinstance(err, BaseException):
        if not line:
            line = type(err).__name__
        elif not isinstance(err, OmskillsError):
            line = f"{type(err).__name__}: {line}"
    return line if len(line) <= limit else line[: max(limit - 1, 0)] + "…"


def _first_line(text: str) -> str:
    lines = (" ".join(line.split()) for line in text.splitlines())
    return next((line for line in lines if line), "")
