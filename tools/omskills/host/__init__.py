"""The machine and the clients around the engine: the MCP server, the skill-tool convention and
discovery, and the environment probe (packages, CANN, NPU)."""
