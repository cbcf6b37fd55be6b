"""Overlay pictures: masks and boxes drawn over video frames."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

PALETTE = [(230, 25, 75), (60, 180, 75), (0, 130, 200), (245, 130, 48), (145, 30, 180), (70, 240, 240), (240, 50, 230)]


def draw_overlay(frame: Image.Image, obj_ids: list[int], masks: np.ndarray, boxes_xywh: list[list[float]], title: str | None = None) -> Image.Image:
    """Masks tinted per object id, boxes outlined, ids labelled (boxes are normalised xywh)."""
    base = np.asarray(frame.convert("RGB"), dtype=np.float32)
    out = base.copy()
    for obj_id, mask in zip(obj_ids, masks):
        color = np.asarray(PALETTE[obj_id % len(PALETTE)], dtype=np.float32)
        if mask.shape == out.shape[:2]:
            out[mask] = 0.45 * out[mask] + 0.55 * color
    image = Image.fromarray(out.clip(0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(image)
    w, h = image.size
    for obj_id, (x, y, bw, bh) in zip(obj_ids, boxes_xywh):
        color = PALETTE[obj_id % len(PALETTE)]
        draw.rectangle([x * w, y * h, (x + bw) * w, (y + bh) * h], outline=color, width=3)
        draw.text((x * w + 4, y * h + 2), f"id {obj_id}", fill=color)
    if title:
        draw.rectangle([0, 0, w, 18], fill=(0, 0, 0))
        draw.text((4, 3), title, fill=(255, 255, 255))
    return image


def side_by_side(left: Image.Image, right: Image.Image) -> Image.Image:
    canvas = Image.new("RGB", (left.width + right.width + 8, max(left.height, right.height)), (255, 255, 255))
    canvas.paste(left, (0, 0))
    canvas.paste(right, (left.width + 8, 0))
    return canvas


def save_png(image: Image.Image, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)
    return path
