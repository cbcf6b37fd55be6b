"""The agent side of omskills: CLI, MCP client, deterministic plan, Claude tool-use loop."""
