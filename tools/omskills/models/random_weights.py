"""Helpers for drivers whose model runs with random weights (no checkpoint)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def calibrate_batch_norm(model: nn.Module, run: Callable[[], Any]) -> int:
    """Every BatchNorm layer's running statistics estimated as the plain average over what `run()`
    feeds the model, the rest of the model in eval mode; returns how many layers.

    A random network keeps BatchNorm's default statistics (mean 0, variance 1), which shrink its
    activations layer after layer until every score ties (logits of 1e-8, every box the same):
    the outputs then say nothing and their parity little. Estimated from the task's own inputs,
    the activations keep the spread a trained model's have."""
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    for norm in norms:
        norm.reset_running_stats()
        norm.momentum = None  # a cumulative average over the calibration batches
        norm.train()
    try:
        with torch.no_grad():
            run()
    finally:
        for norm in norms:
            norm.eval()
    return len(norms)
