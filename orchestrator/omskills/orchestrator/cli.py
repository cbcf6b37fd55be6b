"""`omskills` command line: a thin layer over the engine and the orchestrator."""

from __future__ import annotations

import argparse
import signal
import sys

from omskills.errors import OmskillsError, one_line
from omskills.orchestrator.command_table import COMMANDS, command
from omskills.orchestrator.version import installed_version


def _tool_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--list", action="store_true", help="list the tools and exit")
    p.add_argument("name", help="tool name (see `omskills tool --list`)", nargs="?")
    p.add_argument(
        "tool_args",
        nargs=argparse.REMAINDER,
        help="the tool's arguments: --args '{...}' or one flag per parameter (--task T)",
    )


@command("tool", _tool_args)
def _tool(ns: argparse.Namespace) -> int:
    """Call one skill tool by hand (the same CLI as running its script)."""
    from omskills.host.toolkit import discover_tools, run_cli, tool_listing

    tools = discover_tools()
    if ns.list or not ns.name:
        print(tool_listing([info for _, info in tools.items()]))
        return 0
    return run_cli(tools.get(ns.name).func, ns.tool_args, prog=f"omskills tool {ns.name}")


def _load_subcommand_modules() -> None:
    # Each front-end module registers its commands with @command on import.
    from omskills.orchestrator import (  # noqa: F401
        commands,
        deploy_commands,
        driver_commands,
        fleet_commands,
        job_commands,
    )


def build_parser() -> argparse.ArgumentParser:
    _load_subcommand_modules()
    parser = argparse.ArgumentParser(
        prog="omskills",
        description="Adapt PyTorch models to Huawei Ascend OM: cut, export, convert, splice back, verify.",
    )
    parser.add_argument("--version", action="version", version=f"omskills {installed_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (configure, handler) in COMMANDS.items():
        p = sub.add_parser(name, help=(handler.__doc__ or "").strip().splitlines()[0] if handler.__doc__ else None)
        configure(p)
        p.set_defaults(handler=handler)
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        return ns.handler(ns)
    except OmskillsError as err:
        print(f"omskills: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # a path the system refuses (too long, a full disk, a port in use): the user's to act on
        print(f"omskills: error: {one_line(err)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:  # Ctrl-C, or SIGTERM during a step (errors.Interrupted): 128 + the signal
        print("omskills: interrupted", file=sys.stderr)
        return 128 + getattr(err, "signum", signal.SIGINT)


if __name__ == "__main__":
    # Run as `python -m omskills.orchestrator.cli`: call the imported module's main, where the
    # subcommand modules register (this file would otherwise exist twice, as __main__ and by name).
    from omskills.orchestrator.cli import main as _main

    sys.exit(_main())
