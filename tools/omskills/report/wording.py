"""Counts as reports print them: a noun agrees with its number ("1 call", "2 batches")."""

from __future__ import annotations

VOWELS = "aeiou"


def plural(noun: str, count: float = 2) -> str:
    """`noun` for `count` of it: "frame" -> "frames", "batch" -> "batches", "query" -> "queries";
    one of it keeps the noun. A noun of several words agrees by its last."""
    if count == 1:
        return noun
    if noun.endswith(("s", "x", "z", "ch", "sh")):
        return f"{noun}es"
    if noun.endswith("y") and noun[-2:-1] not in VOWELS:
        return f"{noun[:-1]}ies"
    return f"{noun}s"


def counted(count: float, noun: str) -> str:
    """`count` and its noun: "1 call", "8 calls", "2 batches"."""
    number = f"{count:g}" if isinstance(count, float) else str(count)
    return f"{number} {plural(noun, count)}"
