"""Subcommands of `omskills` beyond `tool`; each is a thin call into the engine."""

from __future__ import annotations

import argparse

from .cli import command

# --------------------------------------------------------------------------- MCP server, agent, skills
# (serve, chat, new-skill, validate, install-skills; owned with mcp_server/agent/skills_admin)


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

    settings = agent_settings(model=ns.model, max_turns=ns.max_turns, max_tokens=ns.max_tokens)
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
    p.add_argument("--target", default=".claude/skills", help="where to install (default: .claude/skills)")


@command("install-skills", _install_skills_args)
def _install_skills(ns: argparse.Namespace) -> int:
    """Install the skills (SKILL.md, references, scripts) for Claude Code."""
    from pathlib import Path

    from .skills_admin import install_skills

    for folder in install_skills(Path(ns.target)):
        print(f"installed {folder}")
    return 0
