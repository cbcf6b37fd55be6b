"""transformers' Wav2Vec2 CTC speech recogniser on synthetic audio, as a driver class.

The entry users call: `Wav2Vec2Processor(audio, sampling_rate=16000)` (normalise the waveform),
`Wav2Vec2ForCTC(input_values).logits`, greedy CTC (argmax per frame), then
`processor.batch_decode` (collapse repeats, drop blanks, join characters). One step per clip;
the clips are chirps plus a tone the driver synthesises, `seconds` long each, so no audio file is
needed. Outputs: the frame logits (the gating, continuous check), the argmax ids and the text.

Weights are random from a tiny Wav2Vec2Config (7 conv layers of 32 channels, 2 transformer
layers of width 64; `builder_kwargs` override it); the Wav2Vec2CTCTokenizer reads a character
vocab.json the driver writes at load time.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from omskills.models.kit import (
    LoadedModel,
    MainPathRun,
    ModelDriver,
    ModelSpec,
    OutputCheck,
    RunHooks,
    StepOutput,
    package_root,
)
from pydantic import BaseModel, ConfigDict, Field

SAMPLE_RATE = 16000
VOCAB = ["<pad>", "<s>", "</s>", "<unk>", "|", *"abcdefghijklmnopqrstuvwxyz'"]
TINY_CONFIG = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=128,
    conv_dim=(32,) * 7,
    num_conv_pos_embeddings=16,
    num_conv_pos_embedding_groups=4,
)


class SpeechInputs(BaseModel):
    """Synthetic clips, one step each: their lengths in seconds."""

    model_config = ConfigDict(extra="forbid")

    seconds: list[float] = Field(min_length=1)


def synth_clip(index: int, seconds: float) -> np.ndarray:
    """A rising chirp under a steady tone, different for every clip index (float32, 16 kHz)."""
    t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    start, sweep, tone = 150.0 + 50 * index, 300.0 + 100 * index, 440.0 * (1 + index % 3)
    wave = 0.5 * np.sin(2 * np.pi * (start * t + sweep * t**2)) + 0.2 * np.sin(2 * np.pi * tone * t)
    return wave.astype(np.float32)


class Wav2Vec2CtcDriver(ModelDriver):
    family = "hf-wav2vec2-ctc"
    description = "transformers Wav2Vec2ForCTC (tiny config, random) with its processor and greedy CTC decoding"
    inputs_model = SpeechInputs
    step_name = "clip"

    def source_root(self, spec: ModelSpec) -> Path:
        return package_root(spec.source, "transformers")

    def load(self, spec: ModelSpec) -> LoadedModel:
        from transformers import (
            Wav2Vec2Config,
            Wav2Vec2CTCTokenizer,
            Wav2Vec2FeatureExtractor,
            Wav2Vec2ForCTC,
            Wav2Vec2Processor,
        )

        with tempfile.TemporaryDirectory() as folder:  # the tokenizer keeps its vocabulary in memory
            vocab = Path(folder) / "vocab.json"
            vocab.write_text(json.dumps({c: i for i, c in enumerate(VOCAB)}), encoding="utf-8")
            tokenizer = Wav2Vec2CTCTokenizer(str(vocab), unk_token="<unk>", pad_token="<pad>", word_delimiter_token="|")
        features = Wav2Vec2FeatureExtractor(
            feature_size=1, sampling_rate=SAMPLE_RATE, padding_value=0.0, do_normalize=True, return_attention_mask=False
        )
        processor = Wav2Vec2Processor(feature_extractor=features, tokenizer=tokenizer)
        torch.manual_seed(spec.seed)
        config = Wav2Vec2Config(
            vocab_size=len(VOCAB), pad_token_id=tokenizer.pad_token_id, **(TINY_CONFIG | spec.builder_kwargs)
        )
        model = Wav2Vec2ForCTC(config).eval().to(spec.device)
        return LoadedModel(
            entry=(processor, model),
            root=model,
            source_root=self.source_root(spec),
            weights="random",
            notes=[f"random weights (seed {spec.seed}); vocab.json of {len(VOCAB)} characters written by the driver"],
        )

    def load_inputs(self, inputs: SpeechInputs, base_dir: Path) -> list[np.ndarray]:
        if any(s < 0.1 for s in inputs.seconds):
            raise ValueError(f"intake.inputs.seconds: clips must be at least 0.1 s long, got {inputs.seconds}")
        return [synth_clip(i, s) for i, s in enumerate(inputs.seconds)]

    def run_main_path(
        self,
        loaded: LoadedModel,
        data: list[np.ndarray],
        inputs: SpeechInputs,
        verification: BaseModel,
        hooks: RunHooks,
    ) -> MainPathRun:
        processor, model = loaded.entry
        steps, start = [], time.perf_counter()
        with torch.no_grad():
            for index, clip in enumerate(data):
                t0 = time.perf_counter()
                features = processor(clip, sampling_rate=SAMPLE_RATE, return_tensors="pt").to(model.device)
                logits = model(**features).logits
                ids = logits.argmax(-1)
                [text] = processor.batch_decode(ids)
                steps.append(
                    StepOutput(
                        index=index,
                        seconds=time.perf_counter() - t0,
                        outputs={
                            "logits": logits[0].cpu().numpy(),
                            "ids": ids[0].cpu().numpy(),
                            "text": np.asarray(text),
                        },
                    )
                )
                hooks.step(index)
        return MainPathRun(steps=steps, setup_seconds=0.0, total_seconds=time.perf_counter() - start)

    def comparison(self, verification: BaseModel) -> list[OutputCheck]:
        return [
            OutputCheck(output="logits", metric="tensor", label="CTC frame logits"),
            OutputCheck(output="ids", metric="exact", label="greedy CTC ids per frame"),
            OutputCheck(output="text", metric="exact", label="decoded text"),
        ]
