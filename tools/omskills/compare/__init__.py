"""Judging outputs against PyTorch's: a compiled graph's parity tiers, a whole main path under a
driver's output checks (exact, tensor, IoU, max abs)."""
