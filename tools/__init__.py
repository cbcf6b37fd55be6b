"""omskills engine: everything the skill scripts call.

Import direction is one way: orchestrator -> (MCP) -> skills/*/scripts -> omskills (this package).
The engine knows nothing of LLMs; only host/mcp_server knows MCP. docs/architecture.md maps it.
"""

__version__ = "0.1.0"
