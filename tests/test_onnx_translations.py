"""omskills.convert.translations: aten ops the exporter translates itself, checked in ONNX Runtime.

Group norm over a large group (SAM 3's segmentation head normalises 288x288 maps) must come out
of ONNX Runtime as close to torch as fp32 allows, with ops ATC accepts at opset 18.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from omskills.convert.translations import translation_table
from torch import nn


class Norms(nn.Module):
    def __init__(self, channels: int, affine: bool) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(8, channels, affine=affine)
        if affine:
            with torch.no_grad():
                self.norm.weight.uniform_(0.5, 2.0)
                self.norm.bias.uniform_(-1.0, 1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)


def _export_and_run(module: nn.Module, x: torch.Tensor, tmp_path) -> tuple[np.ndarray, onnx.ModelProto]:
    path = tmp_path / "norm.onnx"
    torch.onnx.export(
        module.eval(),
        (x,),
        str(path),
        dynamo=True,
        opset_version=18,
        verbose=False,
        custom_translation_table=translation_table(),
    )
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x.numpy()})[0], onnx.load(str(path))


def test_group_norm_over_a_large_map_matches_torch_to_fp32_rounding(tmp_path):
    torch.manual_seed(0)
    module = Norms(64, affine=True)
    x = torch.randn(1, 64, 288, 288) * 2.0 + 3.0  # an offset mean: what a one-pass variance gets wrong
    got, model = _export_and_run(module, x, tmp_path)
    with torch.no_grad():
        expected = module(x).numpy()
    assert np.abs(got - expected).max() < 1e-5
    ops = {node.op_type for node in model.graph.node}
    assert "InstanceNormalization" not in ops and "ReduceMean" in ops
    assert max(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")) <= 18


@pytest.mark.parametrize("shape", [(3, 16, 10), (3, 16)])
def test_group_norm_without_affine_on_other_ranks(tmp_path, shape):
    torch.manual_seed(1)
    module = Norms(16, affine=False)
    x = torch.randn(*shape) + 1.0
    got, _ = _export_and_run(module, x, tmp_path)
    with torch.no_grad():
        np.testing.assert_allclose(got, module(x).numpy(), atol=1e-5)
