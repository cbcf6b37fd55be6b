"""Input videos: the built-in synthetic clips and real videos (mp4, gif, folder of frames).

Frames are returned as RGB PIL images; video predictors take such a list directly, so no
temporary files are written and the same frames feed the reference and the spliced run.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from omskills.errors import InputError, one_line
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


def _texture(
    rng: np.random.Generator, height: int, width: int, base: tuple[int, int, int], amplitude: int
) -> np.ndarray:
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
# Each built-in clip's length: the three shapes have all left the 640x480 picture by frame 30.
BUILTIN_CLIP_FRAMES = {"shapes": 30}


@dataclass(frozen=True)
class VideoFacts:
    """What the gate learns of a video without decoding it all."""

    where: str  # the path, or builtin:<name>
    frames: int  # its length in frames, or (when `whole` is False) a lower bound
    # False when counting stopped early: the video has at least `frames` frames, maybe more.
    whole: bool = True
    # Frames decoded to count them (0 when the length came from metadata): these are known to decode.
    decoded: int = 0


def _frame_paths(folder: Path, field: str) -> list[Path]:
    paths = sorted((p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES), key=_frame_sort_key)
    if not paths:
        raise InputError(f"{field}: video folder {folder} holds no image frames ({', '.join(sorted(IMAGE_SUFFIXES))})")
    return paths


def _read_folder(folder: Path, frames: int, field: str) -> list[Image.Image]:
    images = []
    for path in _frame_paths(folder, field)[:frames]:  # only the frames asked for are opened
        try:
            images.append(Image.open(path).convert("RGB"))
        except OSError as err:
            raise InputError(f"{field}: cannot read frame {path}: {err}") from None
    return images


def _frame_sort_key(path: Path) -> tuple[int, int | str]:
    return (0, int(path.stem)) if path.stem.isdigit() else (1, path.stem)


def _read_file(path: Path, frames: int, field: str) -> list[Image.Image]:
    import imageio.v3 as iio

    try:
        images = []
        for i, frame in enumerate(iio.imiter(path)):
            if i >= frames:
                break
            images.append(Image.fromarray(np.asarray(frame)[..., :3]).convert("RGB"))
    except Exception as err:  # imageio raises many types for unreadable files
        raise InputError(f"{field}: cannot read video {path}: {one_line(err, 200)}") from None
    if not images:
        raise InputError(f"{field}: video {path} has no frames")
    return images


def _count_file_frames(path: Path, field: str, enough: int | None) -> tuple[int, bool, int]:
    """Frames of a video file, whether that is its whole length, and how many were decoded to
    tell: from the container's metadata when it records the length (none decoded), else by
    decoding, stopping once more than `enough` frames are seen (the caller only needs to know
    there are enough; decoding a long clip to the end costs minutes)."""
    import imageio.v3 as iio

    try:
        shape = iio.improps(path).shape
        count = int(shape[0]) if len(shape) == 4 else 1
        if count > 0:
            return count, True, 0
        # The container does not record its length (improps says 0): count the frames it holds.
        for _ in iio.imiter(path):
            count += 1
            if enough is not None and count > enough:
                return count, False, count
    except Exception as err:  # imageio raises many types for unreadable files
        raise InputError(f"{field}: cannot read video {path}: {one_line(err, 200)}") from None
    if count <= 0:
        raise InputError(f"{field}: video {path} has no frames")
    return count, True, count


def _video_path(spec: str, base_dir: Path | None, field: str) -> Path:
    path = Path(spec).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    if not path.exists():
        raise InputError(f"{field}: video not found: {path}")
    if not path.is_dir() and path.suffix.lower() not in VIDEO_SUFFIXES | {".gif"}:
        raise InputError(
            f"{field}: video {path}: unsupported type {path.suffix!r} (mp4/gif/folder of frames or builtin:<name>)"
        )
    return path


def _builtin(spec: str, field: str) -> str:
    name = spec.split(":", 1)[1]
    if name not in BUILTIN_CLIPS:
        raise InputError(f"{field}: unknown built-in clip {name!r}; known: {', '.join(BUILTIN_CLIPS)}")
    return name


def probe_video(spec: str, base_dir: Path | None = None, field: str = "video", enough: int | None = None) -> VideoFacts:
    """The video's length in frames (one-line errors naming `field`), read from its metadata; a file whose
    container does not record it is decoded, only until more than `enough` frames are seen when given."""
    if spec.startswith("builtin:"):
        return VideoFacts(where=spec, frames=BUILTIN_CLIP_FRAMES[_builtin(spec, field)])
    path = _video_path(spec, base_dir, field)
    if path.is_dir():
        return VideoFacts(where=str(path), frames=len(_frame_paths(path, field)))
    frames, whole, decoded = _count_file_frames(path, field, enough)
    return VideoFacts(where=str(path), frames=frames, whole=whole, decoded=decoded)


def check_frames_decode(spec: str, frames: int, base_dir: Path | None = None, field: str = "video") -> None:
    """The first and the last of the `frames` asked really decode (one line naming `field` if not):
    a container's header can promise frames a truncated file no longer holds."""
    if spec.startswith("builtin:"):
        return
    path = _video_path(spec, base_dir, field)
    if path.is_dir():
        for frame in {0, frames - 1}:
            _read_folder_frame(_frame_paths(path, field), frame, field)
        return
    import imageio.v3 as iio

    decoded = 0
    try:
        for decoded, _ in enumerate(iio.imiter(path), start=1):
            if decoded >= frames:
                return
    except Exception as err:  # imageio raises many types for unreadable files
        raise InputError(
            f"{field}: video {path}: frame {decoded + 1} of the {frames} asked does not decode ({one_line(err, 200)})"
        ) from None
    raise InputError(f"{field}: video {path}: only {decoded} frame(s) decode, {frames} asked (is the file truncated?)")


def _read_folder_frame(paths: list[Path], index: int, field: str) -> None:
    if index >= len(paths):
        raise InputError(f"{field}: the folder holds {len(paths)} frame(s), frame {index + 1} asked")
    try:
        with Image.open(paths[index]) as image:
            image.load()
    except OSError as err:
        raise InputError(f"{field}: cannot read frame {paths[index]}: {one_line(err, 200)}") from None


def load_video(spec: str, frames: int, base_dir: Path | None = None, field: str = "video") -> list[Image.Image]:
    """Frames of `spec` (builtin:<name>, a folder, an mp4/gif/... file), at most `frames`."""
    if spec.startswith("builtin:"):
        name = _builtin(spec, field)
        if frames > BUILTIN_CLIP_FRAMES[name]:  # checked before a frame is drawn
            raise InputError(
                f"{field}: the built-in clip {name!r} has {BUILTIN_CLIP_FRAMES[name]} frames, {frames} asked"
            )
        return BUILTIN_CLIPS[name](frames=frames)
    path = _video_path(spec, base_dir, field)
    if path.is_dir():
        return _read_folder(path, frames, field)
    return _read_file(path, frames, field)
