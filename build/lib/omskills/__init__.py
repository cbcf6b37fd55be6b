"""omskills engine: everything the skill scripts call.

Import direction is one way: orchestrator -> (MCP) -> skills/*/scripts -> omskills (this package).
The engine knows nothing of MCP or LLMs.
"""

__version__ = "0.1.0"
