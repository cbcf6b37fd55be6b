"""Pictures for reports: instances (regions, boxes, ids) drawn over an image, side by side views."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

PALETTE = [(230, 25, 75), (60, 180, 75), (0, 130, 200), (245, 130, 48), (145, 30, 180), (70, 240, 240), (240, 50, 230)]


def draw_instances(image: Image.Image, ids: Sequence[int], regions: np.ndarray | None, boxes_xywh: Sequence[Sequence[float]],
                   title: str | None = None, normalised: bool = True) -> Image.Image:
    """Regions ((N, H, W) booleans) tinted per id, boxes outlined, ids labelled. Boxes are
    [x, y, w, h], as fractions of the image when `normalised`, else in pixels."""
    base = np.asarray(image.convert("RGB"), dtype=np.float32)
    out = base.copy()
    for obj_id, region in zip(ids, regions if regions is not None else []):
        color = np.asarray(PALETTE[obj_id % len(PALETTE)], dtype=np.float32)
        if region.shape == out.shape[:2]:
            out[region] = 0.45 * out[region] + 0.55 * color
    picture = Image.fromarray(out.clip(0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(picture)
    w, h = picture.size
    sx, sy = (w, h) if normalised else (1, 1)
    for obj_id, (x, y, bw, bh) in zip(ids, boxes_xywh):
        color = PALETTE[obj_id % len(PALETTE)]
        draw.rectangle([x * sx, y * sy, (x + bw) * sx, (y + bh) * sy], outline=color, width=3)
        draw.text((x * sx + 4, y * sy + 2), f"id {obj_id}", fill=color)
    if title:
        draw.rectangle([0, 0, w, 18], fill=(0, 0, 0))
        draw.text((4, 3), title, fill=(255, 255, 255))
    return picture


def titled(image: Image.Image, title: str) -> Image.Image:
    """The image with a title bar drawn over its top."""
    picture = image.convert("RGB").copy()
    draw = ImageDraw.Draw(picture)
    draw.rectangle([0, 0, picture.width, 18], fill=(0, 0, 0))
    draw.text((4, 3), title, fill=(255, 255, 255))
    return picture


def side_by_side(left: Image.Image, right: Image.Image) -> Image.Image:
    canvas = Image.new("RGB", (left.width + right.width + 8, max(left.height, right.height)), (255, 255, 255))
    canvas.paste(left, (0, 0))
    canvas.paste(right, (left.width + 8, 0))
    return canvas


def save_png(image: Image.Image, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)
    return path
