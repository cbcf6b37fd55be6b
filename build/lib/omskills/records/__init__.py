"""Typed records stored in the task record. Each stage owns one module here."""
