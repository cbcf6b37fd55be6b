"""The Cube unit's rates per SoC, as the precision plan's cost model sees them: how long a plan's
multiply-accumulates take in fp16 and in fp32. Predicted, never measured here (no NPU).

fp16 rates are derived as 2 x 4096 MACs per cycle per AI core (the Da Vinci Cube, Huawei's figure
for the Ascend 910) x AI cores x Cube clock, where a source gives cores and clock; each family
says what its figures rest on. fp32 on the Cube: the Atlas A2 family (910B) computes it (aclnn's
`cubeMathType` KEEP_DTYPE); Atlas training and inference products (910, 310P) do not ("Cube单元不支持
FLOAT32计算", aclnnMatmul), so their fp32 Cube time is not predicted.
"""

from __future__ import annotations

from dataclasses import dataclass

CUBE_MACS_PER_CYCLE = 4096
FP32_NOT_ON_CUBE = (
    "this SoC's Cube unit does not compute fp32 (aclnnMatmul, cubeMathType: 'Atlas 训练系列产品、Atlas 推理系列产品"
    "Cube计算单元暂不支持' FLOAT; hiascend.com CANN 8.0 aclnnMatmul): its fp32 Cube time is not predicted"
)
A2_FP32_SOURCE = (
    "fp32 on the Atlas A2 Cube (aclnnBatchMatMul cubeMathType KEEP_DTYPE) at 87/328 of the 16-bit rate: a "
    "third-party matmul benchmark's figures (no Huawei figure found), an assumption"
)


@dataclass(frozen=True)
class CubeRate:
    soc_prefix: str
    fp16_tflops: float | None
    fp32_ratio: float | None  # fp32 rate / fp16 rate; None: the Cube does not compute fp32
    source: str


def _derived(cores: int, ghz: float) -> float:
    return round(2 * CUBE_MACS_PER_CYCLE * cores * ghz / 1000, 1)


# Most specific prefix first.
CUBE_RATES = (
    CubeRate(
        "Ascend910B4",
        _derived(20, 1.5),
        87 / 328,
        "20 AI cores at 1.5 GHz (third-party copy of CANN's platform config, a weak source); " + A2_FP32_SOURCE,
    ),
    CubeRate(
        "Ascend910B3",
        _derived(20, 1.8),
        87 / 328,
        "20 AI cores at 1.8 GHz (third-party copy of CANN's platform config); " + A2_FP32_SOURCE,
    ),
    CubeRate(
        "Ascend910B",
        _derived(24, 1.8),
        87 / 328,
        "24 AI cores at 1.8 GHz (third-party copy of CANN's platform config for 910B2; taken for the other "
        "910B parts, an assumption); " + A2_FP32_SOURCE,
    ),
    CubeRate("Ascend910", 256.0, None, "256 TFLOPS fp16, Huawei's launch figure (32 AI cores); " + FP32_NOT_ON_CUBE),
    CubeRate(
        "Ascend310B",
        4.0,
        None,
        "Atlas 200I DK A2: 1 AI core at 500 MHz, 4 TFLOPS fp16 (hiascend.com product description); no fp32 Cube "
        "figure found",
    ),
    CubeRate("Ascend310P", None, None, "no published fp16 Cube rate found; " + FP32_NOT_ON_CUBE),
    CubeRate(
        "Ascend310", 16.0, None, "16 TOPS 'Float16/INT8' (Atlas 300 guide, not split by type); " + FP32_NOT_ON_CUBE
    ),
)


def cube_rate(soc: str) -> CubeRate | None:
    return next((r for r in CUBE_RATES if soc.startswith(r.soc_prefix)), None)


def cube_ms(macs: int, tflops: float | None) -> float | None:
    """Milliseconds for `macs` multiply-accumulates at a peak rate of `tflops` (2 flops per MAC)."""
    if tflops is None:
        return None
    return 2 * macs / (tflops * 1e12) * 1e3
