"""Pictures for reports: instances (regions, boxes, ids) drawn over an image, side by side views."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

PALETTE = [(230, 25, 75), (60, 180, 75), (0, 130, 200), (245, 130, 48), (145, 30, 180), (70, 240, 240), (240, 50, 230)]


def draw_instances(
    image: Image.Image,
    ids: Sequence[int],
    regions: np.ndarray | None,
    boxes_xywh: Sequence[Sequence[float]],
    title: str | None = None,
    normalised: bool = True,
) -> Image.Image:
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
    return with_legend(picture, [(f"id {i}", PALETTE[i % len(PALETTE)]) for i in dict.fromkeys(ids)])


def with_legend(image: Image.Image, entries: Sequence[tuple[str, tuple[int, int, int]]]) -> Image.Image:
    """The image with a legend strip below it: one colour swatch and its label per entry (which
    colour is which object), wrapped over as many rows as the width needs."""
    font = ImageFont.load_default(size=14)
    swatch, gap, row_height = 14, 16, 22
    draw_probe = ImageDraw.Draw(image)
    labels = [label for label, _ in entries] or ["no objects"]
    widths = [swatch + 4 + int(draw_probe.textlength(label, font=font)) + gap for label in labels]
    rows, x = 1, 4
    for width in widths:
        if x + width > image.width and x > 4:
            rows, x = rows + 1, 4
        x += width
    canvas = Image.new("RGB", (image.width, image.height + rows * row_height + 4), (255, 255, 255))
    canvas.paste(image.convert("RGB"), (0, 0))
    draw = ImageDraw.Draw(canvas)
    x, y = 4, image.height + 4
    for (label, width), colour in zip(zip(labels, widths), [c for _, c in entries] or [None]):
        if x + width > image.width and x > 4:
            x, y = 4, y + row_height
        if colour is None:  # nothing drawn: the label alone says so
            draw.text((x, y + 1), label, fill=(0, 0, 0), font=font)
        else:
            draw.rectangle([x, y + 2, x + swatch, y + 2 + swatch], fill=colour, outline=(0, 0, 0))
            draw.text((x + swatch + 4, y + 1), label, fill=(0, 0, 0), font=font)
        x += width
    return canvas


def titled(image: Image.Image, title: str) -> Image.Image:
    """The image with a title bar drawn over its top."""
    picture = image.convert("RGB").copy()
    draw = ImageDraw.Draw(picture)
    draw.rectangle([0, 0, picture.width, 18], fill=(0, 0, 0))
    draw.text((4, 3), title, fill=(255, 255, 255))
    return picture


def side_by_side(left: Image.Image, right: Image.Image) -> Image.Image:
    """Two pictures next to each other on white, 8 pixels apart (each keeps its own title)."""
    canvas = Image.new("RGB", (left.width + right.width + 8, max(left.height, right.height)), (255, 255, 255))
    canvas.paste(left, (0, 0))
    canvas.paste(right, (left.width + 8, 0))
    return canvas


def save_png(image: Image.Image, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)
    return path
