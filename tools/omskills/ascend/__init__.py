"""Ascend's toolchain from the outside: ATC options and runs, and the operator support table."""
