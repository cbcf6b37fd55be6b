"""transformers' T5 through `generate`, the decoding loop users call, as a two-function driver.

Each step is one prompt: ByT5's byte tokeniser (no vocabulary files), then
`model.generate(..., max_new_tokens, num_beams)`: the encoder once, the decoder once per new
token with its key/value cache, the logits processors and the search in Python. The raw logits
of every generated position (`output_logits`) are the continuous, gating output; the generated
token ids are checked exactly.

Weights are random from a tiny T5Config (2 + 2 layers of width 64; `builder_kwargs` override
it). A random T5 repeats the pad token forever, so generation suppresses it and forbids repeated
bigrams (`suppress_tokens`, `no_repeat_ngram_size`): the decoder then sees varied tokens.

The decoder stays in PyTorch: its calls take the key/value cache object (EncoderDecoderCache),
which a graph cannot take; the engine says so and deploys the encoder.
"""

from __future__ import annotations

import torch
from omskills.models.kit import OutputCheck
from pydantic import BaseModel, ConfigDict, Field
from transformers import ByT5Tokenizer, T5Config, T5ForConditionalGeneration

FAMILY = "hf-t5-generate"
STEP_NAME = "prompt"
TINY_CONFIG = dict(d_model=64, d_ff=128, d_kv=32, num_layers=2, num_decoder_layers=2, num_heads=2)


class Inputs(BaseModel):
    """Prompts, one step each, and how generate decodes them."""

    model_config = ConfigDict(extra="forbid")

    prompts: list[str] = Field(min_length=1)
    max_new_tokens: int = Field(12, ge=1)
    num_beams: int = Field(1, ge=1)


COMPARISON = [
    OutputCheck(output="logits", metric="tensor", label="decoder logits of every generated position"),
    OutputCheck(output="sequences", metric="exact", label="generated token ids"),
]


def build_model(spec):
    tokenizer = ByT5Tokenizer()
    config = T5Config(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
        **(TINY_CONFIG | spec.builder_kwargs),
    )
    return T5ForConditionalGeneration(config)


def run_main_path(model, inputs: Inputs):
    tokenizer = ByT5Tokenizer()
    for prompt in inputs.prompts:
        encoded = tokenizer([prompt], return_tensors="pt").to(model.device)
        out = model.generate(
            **encoded,
            max_new_tokens=inputs.max_new_tokens,
            num_beams=inputs.num_beams,
            do_sample=False,
            suppress_tokens=[tokenizer.pad_token_id],
            no_repeat_ngram_size=2,
            output_logits=True,
            return_dict_in_generate=True,
        )
        yield {"logits": torch.stack(out.logits, 1)[0], "sequences": out.sequences[0]}
