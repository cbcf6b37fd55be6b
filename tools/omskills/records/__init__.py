"""The task record with every typed record stored in it (pydantic, no torch), one module per stage."""
