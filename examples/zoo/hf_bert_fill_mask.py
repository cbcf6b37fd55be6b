"""transformers' BERT through the `fill-mask` pipeline, as a driver class.

The entry users call is `pipeline("fill-mask", model=..., tokenizer=...)(sentence)`: tokenising,
the masked-LM model, then the softmax at the [MASK] position and its top-k stay in the pipeline's
Python. One step per sentence; each step gives the top-k scores (continuous, the gating check)
and the top-k token ids.

Nothing comes from a hub: the model is `BertForMaskedLM(BertConfig(...))` with random weights
(a tiny config, `intake.model.builder_kwargs` overriding it), and the `BertTokenizer` reads a
vocab.txt the driver writes at load time (special tokens, a few words, word pieces, characters).
"""

from __future__ import annotations

import string
import tempfile
import time
from pathlib import Path

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

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = (
    "the a an is was on in of and to it cat dog bird sat ran flew mat house tree car road sky big small red "
    "blue green fast slow old new"
).split()
PIECES = ["##s", "##ed", "##ing", "##er", "##ly", "##est"]
VOCAB = (
    SPECIALS
    + WORDS
    + PIECES
    + list(string.ascii_lowercase)
    + [f"##{c}" for c in string.ascii_lowercase]
    + list(".,!?'")
)
TINY_CONFIG = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128, max_position_embeddings=128
)


class FillMaskInputs(BaseModel):
    """Sentences with one [MASK] each; every sentence is one step."""

    model_config = ConfigDict(extra="forbid")

    sentences: list[str] = Field(min_length=1)
    top_k: int = Field(5, ge=1)


class BertFillMaskDriver(ModelDriver):
    family = "hf-bert-fill-mask"
    description = "transformers BertForMaskedLM (tiny config, random) through pipeline('fill-mask')"
    inputs_model = FillMaskInputs
    step_name = "sentence"

    def source_root(self, spec: ModelSpec) -> Path:
        return package_root(spec.source, "transformers")

    def load(self, spec: ModelSpec) -> LoadedModel:
        from transformers import BertConfig, BertForMaskedLM, BertTokenizer, pipeline

        with tempfile.TemporaryDirectory() as folder:  # the tokenizer keeps its vocabulary in memory
            vocab = Path(folder) / "vocab.txt"
            vocab.write_text("\n".join(VOCAB) + "\n", encoding="utf-8")
            tokenizer = BertTokenizer(vocab=str(vocab))
        torch.manual_seed(spec.seed)
        config = BertConfig(vocab_size=len(VOCAB), **(TINY_CONFIG | spec.builder_kwargs))
        model = BertForMaskedLM(config).eval().to(spec.device)
        fill = pipeline("fill-mask", model=model, tokenizer=tokenizer, device=torch.device(spec.device))
        return LoadedModel(
            entry=fill,
            root=model,
            source_root=self.source_root(spec),
            weights="random",
            notes=[f"random weights (seed {spec.seed}); vocab.txt of {len(VOCAB)} tokens written by the driver"],
        )

    def load_inputs(self, inputs: FillMaskInputs, base_dir: Path) -> list[str]:
        missing = [s for s in inputs.sentences if s.count("[MASK]") != 1]
        if missing:
            raise ValueError(f"intake.inputs.sentences: each needs exactly one [MASK]: {missing}")
        return inputs.sentences

    def run_main_path(
        self, loaded: LoadedModel, data: list[str], inputs: FillMaskInputs, verification: BaseModel, hooks: RunHooks
    ) -> MainPathRun:
        steps, start = [], time.perf_counter()
        with torch.no_grad():
            for index, sentence in enumerate(data):
                t0 = time.perf_counter()
                found = loaded.entry(sentence, top_k=inputs.top_k)
                outputs = {
                    "scores": torch.tensor([f["score"] for f in found]),
                    "token_ids": torch.tensor([f["token"] for f in found]),
                }
                steps.append(
                    StepOutput(
                        index=index,
                        seconds=time.perf_counter() - t0,
                        outputs={k: v.numpy() for k, v in outputs.items()},
                    )
                )
                hooks.step(index)
        return MainPathRun(steps=steps, setup_seconds=0.0, total_seconds=time.perf_counter() - start)

    def comparison(self, verification: BaseModel) -> list[OutputCheck]:
        return [
            OutputCheck(output="scores", metric="tensor", label="top-k scores"),
            OutputCheck(output="token_ids", metric="exact", label="top-k token ids"),
        ]
