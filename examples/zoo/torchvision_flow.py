"""RAFT optical flow from torchvision as an omskills driver (an example written against omskills.models.kit).

The entry users call is `model(image1, image2, num_flow_updates=N)`: a feature and a context
encoder run once per pair of frames, then an update block refines the flow N times in a Python
loop (the correlation lookup between iterations stays in Python). The update block is one
candidate called N times per pair. The driver names no seed candidates: the study ranks the
module tree from a profile.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch
from omskills.models.kit import (
    InputPath,
    LoadedModel,
    MainPathRun,
    ModelDriver,
    ModelSpec,
    OutputCheck,
    RunHooks,
    StepOutput,
    load_state_dict,
    load_video,
    package_root,
    side_by_side,
    titled,
)
from PIL import Image
from pydantic import BaseModel, ConfigDict, Field, model_validator

DEFAULT_BUILDER = "raft_small"


class FlowInputs(BaseModel):
    """Consecutive frame pairs of a video (or a built-in clip), resized to width x height."""

    model_config = ConfigDict(extra="forbid")

    video: InputPath = "builtin:shapes"
    frames: int = Field(3, ge=2)  # frames - 1 pairs
    width: int = 160
    height: int = 128
    num_flow_updates: int = Field(4, ge=1)

    @model_validator(mode="after")
    def _raft_sizes(self) -> FlowInputs:
        # RAFT works at 1/8 resolution and its correlation pyramid needs 16 cells there.
        if self.width % 8 or self.height % 8 or min(self.width, self.height) < 128:
            raise ValueError(
                f"width and height must be multiples of 8 and at least 128, got {self.width}x{self.height}"
            )
        return self


def _tensor(image: Image.Image) -> torch.Tensor:
    return torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1).float()[None] / 127.5 - 1.0


class RaftDriver(ModelDriver):
    family = "torchvision-raft"
    description = "torchvision RAFT optical flow (raft_small / raft_large): frame pairs in, flow out"
    inputs_model = FlowInputs
    step_name = "pair"
    entry_methods = ("forward",)
    entry_classes = ("RAFT",)

    def source_root(self, spec: ModelSpec) -> Path:
        return package_root(spec.source, "torchvision")

    def source_package(self, spec: ModelSpec) -> str:
        return "torchvision"

    def builder_name(self, spec: ModelSpec) -> str:
        return spec.builder or DEFAULT_BUILDER

    def load(self, spec: ModelSpec) -> LoadedModel:
        from torchvision.models import optical_flow

        name = self.builder_name(spec)
        builder = getattr(optical_flow, name, None)
        if builder is None:
            raise ValueError(f"intake.model.builder: torchvision.models.optical_flow has no {name!r}")
        torch.manual_seed(spec.seed)
        model = builder(weights=None, **spec.builder_kwargs)
        if spec.checkpoint:
            load_state_dict(model, Path(spec.checkpoint), spec.device)
        model = model.eval().to(spec.device)
        return LoadedModel(
            entry=model,
            root=model,
            source_root=self.source_root(spec),
            weights=spec.checkpoint or "random",
            notes=[] if spec.checkpoint else [f"random weights (seed {spec.seed})"],
        )

    def load_inputs(self, inputs: FlowInputs, base_dir: Path) -> list[Image.Image]:
        frames = load_video(inputs.video, inputs.frames, base_dir=base_dir)
        return [frame.resize((inputs.width, inputs.height), Image.BILINEAR) for frame in frames]

    def run_main_path(
        self, loaded: LoadedModel, data: list[Image.Image], inputs: FlowInputs, verification: BaseModel, hooks: RunHooks
    ) -> MainPathRun:
        steps = []
        start = time.perf_counter()
        with torch.no_grad():
            for index, (first, second) in enumerate(zip(data, data[1:])):
                t0 = time.perf_counter()
                flows = loaded.entry(_tensor(first), _tensor(second), num_flow_updates=inputs.num_flow_updates)
                steps.append(
                    StepOutput(
                        index=index, seconds=time.perf_counter() - t0, outputs={"flow": flows[-1][0].cpu().numpy()}
                    )
                )
                hooks.step(index)
        return MainPathRun(steps=steps, setup_seconds=0.0, total_seconds=time.perf_counter() - start)

    def comparison(self, verification: BaseModel) -> list[OutputCheck]:
        return [OutputCheck(output="flow", metric="tensor", label="flow (pixels)")]

    def picture(self, data: list[Image.Image], step: StepOutput, title: str) -> Image.Image:
        from torchvision.utils import flow_to_image

        flow = flow_to_image(torch.from_numpy(step.outputs["flow"])).permute(1, 2, 0).numpy()
        return side_by_side(titled(data[step.index], title), Image.fromarray(flow))
