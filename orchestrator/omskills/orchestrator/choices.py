"""Closed sets of values of the set-up commands, standard library only so the parser stays light
(skills_admin, which uses them, imports the MCP server)."""

from __future__ import annotations

from typing import Literal

# install-client: the MCP clients whose configuration omskills can write.
Client = Literal["claude-code", "claude-desktop"]
# install-client --scope (Claude Code only): the project's .mcp.json or the user's ~/.claude.json.
Scope = Literal["project", "user"]
# install-client --env: the server's settings it may write into a client's entry (each checked in
# skills_admin), besides a driver's OMSKILLS_<DRIVER>_SOURCE.
ServerSetting = Literal[
    "OMSKILLS_INPUT_ROOTS", "OMSKILLS_SKILLS_DIR", "OMSKILLS_LOG_LEVEL", "OMSKILLS_HEARTBEAT_SECONDS"
]
