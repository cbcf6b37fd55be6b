"""diffusers' StableDiffusionPipeline on tiny random components: a two-function driver.

The entry users call is `pipe(prompt, num_inference_steps, height, width, generator, output_type="np")`:
the tokenizer and the CLIP text encoder run once, then the denoising loop calls the UNet once per
step on the classifier-free-guidance batch (unconditional and conditional halves), the scheduler
steps in Python, and the VAE decodes the last latents.

Every component is built from a small config (random weights, seeded by the engine): a 2-layer CLIP
text encoder of width 32, a UNet with two levels (32, 64 channels, one cross-attention level), a
VAE with two levels (latents at half the image size). The tokenizer is CLIP's BPE class on a
character-level vocabulary made here (the 256 byte symbols, alone and word-final), no merges: no
hub files. The pipeline holds its components as plain attributes, so the root the engine cuts is
a holder whose children are those same objects, and the driver gives the pipeline the holder's
children back after the engine replaces one (`_Components.__setattr__`).
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field

MAX_TOKENS = 32
COMPARISON = [{"output": "images", "metric": "tensor", "label": "decoded images"}]


class Inputs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: str = "a red cube on a blue floor"
    size: int = Field(64, ge=32, multiple_of=16)  # height and width of the image
    steps: int = Field(3, ge=1)
    guidance_scale: float = 7.5
    images_per_prompt: int = Field(1, ge=1)


class _Components(torch.nn.Module):
    """The pipeline's networks as children of one module; replacing a child (the engine splicing a
    graph in) replaces the pipeline's attribute too, so the pipeline calls what the engine cut."""

    def __init__(self, pipe) -> None:
        super().__init__()
        object.__setattr__(self, "pipe", pipe)
        for name in ("text_encoder", "unet", "vae"):
            setattr(self, name, getattr(pipe, name))

    def __setattr__(self, name: str, value) -> None:
        super().__setattr__(name, value)
        if name in ("text_encoder", "unet", "vae"):
            setattr(self.pipe, name, value)


def _tokenizer():
    from tokenizers import pre_tokenizers
    from transformers import CLIPTokenizer

    symbols = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    vocab.update({s: i + 2 for i, s in enumerate(symbols)})
    vocab.update({s + "</w>": i + 2 + len(symbols) for i, s in enumerate(symbols)})
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=MAX_TOKENS)


def build_model(spec):
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    tokenizer = _tokenizer()
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=MAX_TOKENS,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=1,
        )
    )
    unet = UNet2DConditionModel(
        block_out_channels=(32, 64),
        layers_per_block=1,
        sample_size=32,
        in_channels=4,
        out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=32,
        attention_head_dim=8,
        norm_num_groups=16,
    )
    vae = AutoencoderKL(
        block_out_channels=(16, 32),
        in_channels=3,
        out_channels=3,
        latent_channels=4,
        norm_num_groups=16,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
    )
    scheduler = DDIMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
    )
    pipe = StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe, _Components(pipe)


def run_main_path(pipe, inputs: Inputs):
    generator = torch.Generator("cpu").manual_seed(0)
    result = pipe(
        inputs.prompt,
        num_inference_steps=inputs.steps,
        height=inputs.size,
        width=inputs.size,
        guidance_scale=inputs.guidance_scale,
        num_images_per_prompt=inputs.images_per_prompt,
        generator=generator,
        output_type="np",
    )
    return {"images": result.images}
