"""Input videos: the built-in synthetic clips and real videos (mp4, gif, folder of frames).

Frames are returned as RGB PIL images; video predictors take such a list directly, so no
temporary files are written and the same frames feed the reference and the spliced run.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from omskills.errors import InputError
from PIL import Image, ImageDraw

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".webp"}
VIDEO_SUFFIXES = {".mp4", ".mov", ".avi", ".mkv", ".webm"}


@dataclass(frozen=True)
class MovingShape:
    kind: str  # "ellipse" | "rectangle" | "triangle"
    color: tuple[int, int, int]
    size: int
    start: tuple[float, float]  # centre, as fractions of width/height
    velocity: tuple[float, float]  # fraction of width/height per frame


SHAPES_CLIP = (
    MovingShape("ellipse", (220, 40, 40), 120, (0.20, 0.30), (0.03, 0.015)),
    MovingShape("rectangle", (40, 90, 220), 110, (0.75, 0.30), (-0.01, 0.03)),
    MovingShape("triangle", (40, 180, 60), 130, (0.50, 0.75), (-0.02, 0.0)),
)


def _texture(rng: np.random.Generator, height: int, width: int, base: tuple[int, int, int], amplitude: int) -> np.ndarray:
    """Deterministic blotchy texture: low-frequency noise upsampled plus fine grain."""
    coarse = rng.normal(0.0, 1.0, size=(height // 16 + 1, width // 16 + 1, 3))
    coarse = np.kron(coarse, np.ones((16, 16, 1)))[:height, :width]
    grain = rng.normal(0.0, 0.35, size=(height, width, 3))
    pixels = np.asarray(base, dtype=np.float64) + amplitude * (coarse + grain)
    return np.clip(pixels, 0, 255).astype(np.uint8)


def builtin_shapes(frames: int = 8, width: int = 640, height: int = 480, seed: int = 1234) -> list[Image.Image]:
    """Three textured shapes moving over a textured background; identical on every call."""
    rng = np.random.default_rng(seed)
    background = _texture(rng, height, width, (150, 140, 120), 18)
    object_textures = [_texture(rng, height, width, s.color, 22) for s in SHAPES_CLIP]
    images = []
    for t in range(frames):
        canvas = background.copy()
        for shape, texture in zip(SHAPES_CLIP, object_textures):
            mask = Image.new("L", (width, height), 0)
            cx = (shape.start[0] + shape.velocity[0] * t) * width
            cy = (shape.start[1] + shape.velocity[1] * t) * height
            r = shape.size / 2
            draw = ImageDraw.Draw(mask)
            if shape.kind == "ellipse":
                draw.ellipse([cx - r, cy - r * 0.8, cx + r, cy + r * 0.8], fill=255)
            elif shape.kind == "rectangle":
                draw.rectangle([cx - r, cy - r * 0.7, cx + r, cy + r * 0.7], fill=255)
            else:
                draw.polygon([(cx, cy - r), (cx - r, cy + r * 0.8), (cx + r, cy + r * 0.8)], fill=255)
            keep = np.asarray(mask) > 0
            canvas[keep] = texture[keep]
        images.append(Image.fromarray(canvas))
    return images


BUILTIN_CLIPS = {"shapes": builtin_shapes}


def _read_folder(folder: Path) -> list[Image.Image]:
    paths = sorted((p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES), key=_frame_sort_key)
    if not paths:
        raise InputError(f"video folder {folder} holds no image frames ({', '.join(sorted(IMAGE_SUFFIXES))})")
    return [Image.open(p).convert("RGB") for p in paths]


def _frame_sort_key(path: Path) -> tuple[int, int | str]:
    return (0, int(path.stem)) if path.stem.isdigit() else (1, path.stem)


def _read_file(path: Path, frames: int) -> list[Image.Image]:
    import imageio.v3 as iio

    try:
        images = []
        for i, frame in enumerate(iio.imiter(path)):
            if i >= frames:
                break
            images.append(Image.fromarray(np.asarray(frame)[..., :3]).convert("RGB"))
    except Exception as err:  # imageio raises many types for unreadable files
        raise InputError(f"cannot read video {path}: {err}") from None
    if not images:
        raise InputError(f"video {path} has no frames")
    return images


def load_video(spec: str, frames: int, base_dir: Path | None = None) -> list[Image.Image]:
    """Frames of `spec` (builtin:<name>, a folder, an mp4/gif/... file), at most `frames`."""
    if spec.startswith("builtin:"):
        name = spec.split(":", 1)[1]
        if name not in BUILTIN_CLIPS:
            raise InputError(f"unknown built-in clip {name!r}; known: {', '.join(BUILTIN_CLIPS)}")
        return BUILTIN_CLIPS[name](frames=frames)
    path = Path(spec).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    if not path.exists():
        raise InputError(f"video not found: {path}")
    if path.is_dir():
        return _read_folder(path)[:frames]
    if path.suffix.lower() in VIDEO_SUFFIXES | {".gif"}:
        return _read_file(path, frames)
    raise InputError(f"video {path}: unsupported type {path.suffix!r} (mp4/gif/folder of frames or builtin:<name>)")
