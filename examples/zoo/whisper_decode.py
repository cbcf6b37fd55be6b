"""openai-whisper's decoding loop on a tiny random `Whisper`: a two-function driver.

The entry users call is `whisper.decode(model, mel, DecodingOptions(...))`: the audio encoder runs
once per batch, then the greedy loop calls the text decoder once per token with a key/value cache
that forward hooks on every attention's `key` and `value` projections fill (installed per call by
`model.install_kv_cache_hooks`). The decoder and its blocks take that cache (a dict keyed by
modules) as an argument, so they are not tensor-only; the seeds are the encoder and the decoder
blocks' MLPs, which never see the cache (left to the profile, the study would find only the encoder:
the MLPs lie deeper than it looks).

The model is `whisper.model.Whisper` with tiny dims (a 2 s window: 200 mel frames, 100 audio
positions; 2+2 layers of width 64) and the multilingual tokenizer's vocabulary, which whisper reads
from the tiktoken file in its wheel. Weights are random (seeded by the engine). The audio is
synthetic: a few tones and noise per clip, padded or trimmed to the window as `whisper` does.
"""

from __future__ import annotations

import numpy as np
import torch
from omskills.models.kit import FP16_GATES
from pydantic import BaseModel, ConfigDict, Field

SAMPLE_RATE = 16000
DIMS = dict(
    n_mels=80,
    n_audio_ctx=100,
    n_audio_state=64,
    n_audio_head=2,
    n_audio_layer=2,
    n_vocab=51865,
    n_text_ctx=64,
    n_text_state=64,
    n_text_head=2,
    n_text_layer=2,
)
COMPARISON = [
    {"output": "audio_features", "metric": "tensor", "label": "encoder output"},
    {"output": "avg_logprob", "metric": "max_abs", "threshold": 1e-4, "label": "average log-probability"},
    {"output": "no_speech_prob", "metric": "max_abs", "threshold": 1e-5, "label": "no-speech probability"},
    {"output": "tokens", "metric": "exact", "label": "decoded tokens"},
]

# Under fp16: the encoder's output and the decode's average log-probability held to fp16's gates; the
# greedy tokens, an argmax at every position over near-tied random-weight logits, are reported.
PRECISION_CHECKS = [
    {"output": "audio_features", "metric": "tensor", "gates": FP16_GATES, "label": "encoder output"},
    {"output": "no_speech_prob", "metric": "tensor", "gates": FP16_GATES, "label": "no-speech probability"},
    {
        "output": "avg_logprob",
        "metric": "tensor",
        "gates": FP16_GATES,
        "gating": False,
        "label": "average log-probability",
    },
    {"output": "tokens", "metric": "exact", "gating": False, "label": "decoded tokens"},
]

SEED_CANDIDATES = [("encoder", "encoder")] + [
    (f"decoder_mlp_{i}", f"decoder.blocks.{i}.mlp") for i in range(DIMS["n_text_layer"])
]


class Inputs(BaseModel):
    """A batch of synthetic clips and how many tokens to decode."""

    model_config = ConfigDict(extra="forbid")

    clips: int = Field(2, ge=1)  # batch size of one decode call
    seconds: float = Field(1.5, gt=0.0)  # audio length, padded or trimmed to the model's 2 s window
    sample_len: int = Field(12, ge=1, le=DIMS["n_text_ctx"] // 2)


def build_model(spec):
    from whisper.model import ModelDimensions, Whisper

    return Whisper(ModelDimensions(**DIMS))


def _clip(index: int, seconds: float) -> np.ndarray:
    """Tones at a few pitches, different per clip, with a little noise (deterministic)."""
    t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    freqs = 220.0 * 2 ** (np.arange(3) / 4 + index / 7)
    audio = sum(np.sin(2 * np.pi * f * t) / (k + 1) for k, f in enumerate(freqs))
    return (0.3 * audio + 0.01 * np.random.default_rng(index).standard_normal(t.size)).astype(np.float32)


def run_main_path(model, inputs: Inputs):
    import whisper

    frames = 2 * model.dims.n_audio_ctx  # the encoder's two strided convolutions halve the frames
    mel = torch.stack(
        [
            whisper.pad_or_trim(whisper.log_mel_spectrogram(_clip(i, inputs.seconds), model.dims.n_mels), frames)
            for i in range(inputs.clips)
        ]
    )
    options = whisper.DecodingOptions(
        task="transcribe", language="en", fp16=False, without_timestamps=True, sample_len=inputs.sample_len
    )
    results = whisper.decode(model, mel, options)
    width = max(len(r.tokens) for r in results)
    tokens = np.full((len(results), width), -1, np.int64)  # ragged token lists, padded with -1
    for row, result in zip(tokens, results):
        row[: len(result.tokens)] = result.tokens
    return {
        "audio_features": torch.stack([r.audio_features for r in results]),
        "tokens": tokens,
        "avg_logprob": np.array([r.avg_logprob for r in results], np.float32),
        "no_speech_prob": np.array([r.no_speech_prob for r in results], np.float32),
    }
