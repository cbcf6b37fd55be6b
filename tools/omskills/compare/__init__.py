"""Comparisons: a compiled graph's outputs against PyTorch (parity tiers), and a whole main path's
outputs under a driver's output checks (exact, tensor, IoU, max abs)."""
