"""The table of `omskills` subcommands: each front-end module registers its commands here with
`@command` on import, and `cli` builds the parser from the table (so no module imports `cli`)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

Handler = Callable[[argparse.Namespace], int]
Configure = Callable[[argparse.ArgumentParser], None]
COMMANDS: dict[str, tuple[Configure, Handler]] = {}


def command(name: str, configure: Configure) -> Callable[[Handler], Handler]:
    def register(handler: Handler) -> Handler:
        COMMANDS[name] = (configure, handler)
        return handler

    return register
