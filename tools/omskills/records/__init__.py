"""The task record and every typed record stored in it (pydantic, no torch). Each stage owns one module."""
