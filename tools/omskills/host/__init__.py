"""Serving the engine to clients over MCP: the server with its jobs, resources, prompts, the
skill-tool convention with its discovery."""
