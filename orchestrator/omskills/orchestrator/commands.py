"""Subcommands of `omskills` beyond `tool`; each is a thin call into the engine."""

from __future__ import annotations

import argparse
from typing import get_args

from .choices import Client, Scope, ServerSetting
from .command_table import command

# --------------------------------------------------------------------------- MCP server, agent, skills
# (serve, chat, new-skill, validate, install-skills, install-client; owned with mcp_server/agent/skills_admin)


def _serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workspace", default=".", help="root folder every path argument must stay inside (default: cwd)")
    p.add_argument("--http", metavar="HOST:PORT", help="serve streamable HTTP on a loopback address instead of stdio")
    p.add_argument("--skills-dir", help="folder of skills to serve (default: the project's skills/)")


@command("serve", _serve_args)
def _serve(ns: argparse.Namespace) -> int:
    """Run the MCP server exposing every skill tool (stdio, or --http on loopback)."""
    from pathlib import Path

    from omskills.host.mcp_server import ServeOptions, parse_http_address, serve

    host, port = parse_http_address(ns.http) if ns.http else (None, None)
    serve(ServeOptions(Path(ns.workspace), Path(ns.skills_dir) if ns.skills_dir else None, host, port))
    return 0


def _agent_limits(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="Claude model id (default: $OMSKILLS_MODEL or the built-in default)")
    p.add_argument("--max-turns", type=int, default=None, help="stop after this many model turns")
    p.add_argument("--max-tokens", type=int, default=None, help="total token budget (input + output) for the run")
    p.add_argument(
        "--retry-seconds",
        type=float,
        default=None,
        help="how long to keep retrying an overloaded (429/529/5xx) or unreachable API before a line gives up "
        "(default: $OMSKILLS_API_RETRY_SECONDS or 600)",
    )


def _chat_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--task", help="task record the conversation works on")
    p.add_argument("--workspace", default=".", help="workspace root for the tool server (default: cwd)")
    _agent_limits(p)


@command("chat", _chat_args)
def _chat(ns: argparse.Namespace) -> int:
    """Talk to the Claude agent that drives the skills (type `exit` to quit)."""
    import asyncio
    from pathlib import Path

    from .agent import agent_settings, chat

    settings = agent_settings(
        model=ns.model, max_turns=ns.max_turns, max_tokens=ns.max_tokens, retry_seconds=ns.retry_seconds
    )
    asyncio.run(chat(ns.task, workspace=Path(ns.workspace), settings=settings))
    return 0


def _new_skill_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", help="skill name: lowercase letters, digits and hyphens")
    p.add_argument("--description", help="what the skill does and when to use it")
    p.add_argument("--skills-dir", help="where to create it (default: the project's skills/)")


@command("new-skill", _new_skill_args)
def _new_skill(ns: argparse.Namespace) -> int:
    """Create skills/NAME with SKILL.md, references/, an example tool and its test."""
    from pathlib import Path

    from .skills_admin import new_skill

    created = new_skill(ns.name, ns.description, Path(ns.skills_dir) if ns.skills_dir else None)
    print(f"created skill {ns.name!r} in {created.folder}")
    for path in created.files:
        print(f"  {path.relative_to(created.folder)}")
    print(f"next: edit SKILL.md and scripts/{created.tool}.py, then `omskills validate {created.folder}`")
    return 0


def _validate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("paths", nargs="*", help="skill folders, or folders of skills (default: every skill)")


@command("validate", _validate_args)
def _validate(ns: argparse.Namespace) -> int:
    """Check skills against the Agent Skills spec and the omskills tool rules."""
    from pathlib import Path

    from .skills_admin import validate_skills

    report = validate_skills([Path(p) for p in ns.paths] or None)
    for problem in report.problems:
        print(f"{problem.where}: {problem.message}")
    summary = f"{len(report.skills)} skill(s), {report.tools} tool(s), {len(report.problems)} problem(s)"
    print(("ok: " if report.ok else "FAILED: ") + summary)
    return 0 if report.ok else 1


def _install_skills_args(p: argparse.ArgumentParser) -> None:
    where = p.add_mutually_exclusive_group()
    where.add_argument("--target", help="where to install (default: .claude/skills under the current folder)")
    where.add_argument("--user", action="store_true", help="install for all your projects: ~/.claude/skills")
    p.add_argument(
        "--force", action="store_true", help="overwrite installed files that were edited since (shown as a diff)"
    )


@command("install-skills", _install_skills_args)
def _install_skills(ns: argparse.Namespace) -> int:
    """Install the skills (SKILL.md, references, scripts) for Claude Code, never silently over local edits."""
    import sys
    from pathlib import Path

    from .skills_admin import install_skills, user_skills_dir

    report = install_skills(user_skills_dir() if ns.user else Path(ns.target or ".claude/skills"), force=ns.force)
    edits = report.local_edits
    if not report.written:
        for change in edits:
            sys.stdout.write(change.diff)
        older = [str(s.dest) for s in report.skills if s.older_install and s.local_edits]
        edited = [c for s in report.skills if not s.older_install for c in s.local_edits]
        if older:
            print(
                f"omskills: error: {', '.join(older)} installed by an older omskills "
                "(no install manifest, diff above): "
                "nothing was installed; rerun with --force to update",
                file=sys.stderr,
            )
        if edited:
            print(
                f"omskills: error: {len(edited)} installed file(s) differ from what omskills installed (local edits, "
                f"diff above): nothing was installed; rerun with --force to overwrite them",
                file=sys.stderr,
            )
        return 1
    for skill in report.skills:
        counts = {kind: sum(c.change == kind for c in skill.changes) for kind in ("add", "update", "remove")}
        done = (
            ", ".join(f"{n} file(s) {verb}" for verb, n in zip(("added", "updated", "removed"), counts.values()) if n)
            or "already up to date"
        )
        print(f"installed {skill.dest}: {done}")
    for change in edits:
        print(f"  overwrote local edits: {change.path} ({change.change})")
    return 0


def _install_client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("client", choices=get_args(Client), help="the MCP client to configure")
    p.add_argument(
        "--workspace",
        help="root folder the server's path arguments must stay inside (default: the "
        "current folder, written as an absolute path)",
    )
    p.add_argument(
        "--scope",
        choices=get_args(Scope),
        help="claude-code only: WORKSPACE/.mcp.json (project, default) or ~/.claude.json (user)",
    )
    p.add_argument("--force", action="store_true", help="replace a different omskills entry already there")
    p.add_argument(
        "--follow-link",
        action="store_true",
        help="the configuration file is a symbolic link: write the file it points at (the link is kept)",
    )
    p.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"a setting for the server, written into the entry (repeatable): {', '.join(get_args(ServerSetting))}, "
        "or a driver's OMSKILLS_<DRIVER>_SOURCE; folders absolute and existing (OMSKILLS_INPUT_ROOTS: several "
        "joined by ':')",
    )


@command("install-client", _install_client_args)
def _install_client(ns: argparse.Namespace) -> int:
    """Write this installation's MCP server (absolute paths) into Claude Code's or Claude Desktop's config."""
    import sys
    from pathlib import Path

    from .skills_admin import install_client, parse_env_args

    result = install_client(
        ns.client,
        Path(ns.workspace) if ns.workspace else None,
        ns.scope,
        force=ns.force,
        follow_link=ns.follow_link,
        env=parse_env_args(ns.env),
    )
    sys.stdout.write(result.diff)
    for key in result.not_carried:
        print(
            f"omskills: note: {key} is set here but not written, so the server will not see it: "
            f'add --env {key}="${key}" to give it',
            file=sys.stderr,
        )
    where = f"mcpServers.omskills in {result.config_path}"
    if result.status == "refused":
        print(
            f"omskills: error: {where} is a different server (diff above); rerun with --force to replace it",
            file=sys.stderr,
        )
        return 1
    print(f"{result.status}: {where}")
    print(
        f"workspace: {result.entry['args'][result.entry['args'].index('--workspace') + 1]} (the server reads and "
        "writes only inside it; --workspace DIR to choose another)"
    )
    if result.status != "unchanged":
        then = "restart Claude Desktop" if ns.client == "claude-desktop" else "in Claude Code, run /mcp to connect it"
        print(f"next: {then}; the server starts with: {result.entry['command']} {' '.join(result.entry['args'])}")
    return 0
