"""Resemblyzer's speaker encoder with the TRAINED weights its PyPI wheel ships: a two-function driver.

The entry users call is `VoiceEncoder().embed_utterance(wav, return_partials=True)`: the mel
spectrogram (librosa), slicing it into overlapping 1.6 s partials, the 3-layer LSTM and a linear
layer on the batch of partials, then the mean of the partial embeddings, normalised, in Python.
The weights are the wheel's `resemblyzer/pretrained.pt` (trained), which `VoiceEncoder` loads
itself: no hub. The audio is synthetic: a voiced tone with vibrato and formant-like harmonics.
The LSTM is the candidate (a graph takes a module's place in its parent; the encoder is the root).
"""

from __future__ import annotations

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

WEIGHTS = "packaged: resemblyzer/pretrained.pt (trained)"
SEED_CANDIDATES = [("lstm", "lstm")]
STEP_NAME = "utterance"
COMPARISON = [
    {"output": "embedding", "metric": "tensor", "label": "utterance embedding"},
    {"output": "partial_embeddings", "metric": "tensor", "label": "partial embeddings"},
]


class Inputs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    seconds: float = Field(3.0, gt=1.0)
    pitch_hz: float = Field(140.0, gt=50.0, lt=400.0)


def build_model(spec):
    from resemblyzer import VoiceEncoder

    return VoiceEncoder(spec.device, verbose=False)


def voiced(seconds: float, pitch_hz: float, sample_rate: int = 16000) -> np.ndarray:
    """A voiced sound: a fundamental with vibrato, decaying harmonics, syllable-like loudness, a little noise."""
    t = np.arange(int(seconds * sample_rate)) / sample_rate
    f0 = pitch_hz * (1 + 0.03 * np.sin(2 * np.pi * 5 * t))
    phase = 2 * np.pi * np.cumsum(f0) / sample_rate
    wave = sum(np.sin(k * phase) / k for k in range(1, 12))
    envelope = 0.6 + 0.4 * np.sin(2 * np.pi * 3 * t) ** 2
    noise = 0.02 * np.random.default_rng(0).standard_normal(t.size)
    return (0.3 * envelope * wave / 3 + noise).astype(np.float32)


def run_main_path(encoder, inputs: Inputs):
    embedding, partials, _ = encoder.embed_utterance(voiced(inputs.seconds, inputs.pitch_hz), return_partials=True)
    return {"embedding": embedding, "partial_embeddings": partials}
