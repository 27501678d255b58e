"""What a toy-world creature looks like, and its pictures: three attributes from small closed sets (colour × shape ×
white pattern) drawn as a 56 px image with jittered position, size and colour, pixel noise and a distractor blob.
Pure functions of an entity and a random generator (toy/world.py decides which images to draw).
"""

from __future__ import annotations

import math

import numpy as np
from PIL import Image, ImageDraw

COLOURS = {
    "red": (210, 40, 40),
    "orange": (240, 140, 30),
    "yellow": (235, 215, 40),
    "green": (50, 160, 60),
    "blue": (40, 80, 210),
    "purple": (130, 50, 180),
    "pink": (240, 120, 180),
    "brown": (120, 75, 35),
}
SHAPES = ["circle", "square", "triangle", "star", "cross", "diamond"]
PATTERNS = ["plain", "striped", "dotted", "checkered"]
ATTRIBUTES = ("colour", "shape", "pattern")
ATTRIBUTE_VALUES = {"colour": list(COLOURS), "shape": SHAPES, "pattern": PATTERNS}
IMAGE_SIZE = 56


def _shape_polygon(shape: str, cx: float, cy: float, r: float):
    if shape == "square":
        return [(cx - r, cy - r), (cx + r, cy - r), (cx + r, cy + r), (cx - r, cy + r)]
    if shape == "diamond":
        return [(cx, cy - r), (cx + r, cy), (cx, cy + r), (cx - r, cy)]
    if shape == "triangle":
        return [(cx, cy - r), (cx + r, cy + r * 0.8), (cx - r, cy + r * 0.8)]
    if shape == "star":
        pts = []
        for k in range(10):
            rad = r if k % 2 == 0 else r * 0.45
            a = -math.pi / 2 + k * math.pi / 5
            pts.append((cx + rad * math.cos(a), cy + rad * math.sin(a)))
        return pts
    if shape == "cross":
        w = r * 0.38
        return [
            (cx - w, cy - r),
            (cx + w, cy - r),
            (cx + w, cy - w),
            (cx + r, cy - w),
            (cx + r, cy + w),
            (cx + w, cy + w),
            (cx + w, cy + r),
            (cx - w, cy + r),
            (cx - w, cy + w),
            (cx - r, cy + w),
            (cx - r, cy - w),
            (cx - w, cy - w),
        ]
    raise ValueError(f"unknown shape {shape!r}")


def _pattern_mask(pattern: str, size: int, phase: int) -> np.ndarray:
    yy, xx = np.mgrid[0:size, 0:size]
    if pattern == "plain":
        return np.zeros((size, size), bool)
    if pattern == "striped":
        return ((yy + phase) // 4) % 2 == 0
    if pattern == "dotted":
        return (((yy + phase) % 7) < 3) & (((xx + phase) % 7) < 3)
    if pattern == "checkered":
        return (((yy + phase) // 5) + ((xx + phase) // 5)) % 2 == 0
    raise ValueError(f"unknown pattern {pattern!r}")


def _erode(mask: np.ndarray) -> np.ndarray:
    """Pixels whose four neighbours are all inside ``mask``."""
    m = np.pad(mask, 1)
    return m[1:-1, 1:-1] & m[:-2, 1:-1] & m[2:, 1:-1] & m[1:-1, :-2] & m[1:-1, 2:]


def render(e: dict, rng: np.random.Generator, noise: float = 8.0):
    """Draw one image of entity ``e`` with per-image variation; returns a PIL image."""
    s = IMAGE_SIZE
    bg = int(rng.integers(200, 236))
    canvas = np.full((s, s, 3), bg, np.float32)
    # distractor: a small grey blob somewhere
    if rng.random() < 0.7:
        dx, dy, dr = rng.integers(4, s - 4), rng.integers(4, s - 4), rng.integers(2, 5)
        yy, xx = np.mgrid[0:s, 0:s]
        canvas[(yy - dy) ** 2 + (xx - dx) ** 2 <= dr * dr] = float(rng.integers(90, 170))
    r = float(rng.uniform(15, 21))
    cx, cy = rng.uniform(r + 2, s - r - 2, size=2)
    mask_img = Image.new("L", (s, s), 0)
    if e["shape"] == "circle":
        ImageDraw.Draw(mask_img).ellipse([cx - r, cy - r, cx + r, cy + r], fill=255)
    else:
        ImageDraw.Draw(mask_img).polygon(_shape_polygon(e["shape"], cx, cy, r), fill=255)
    mask = np.asarray(mask_img) > 127
    colour = np.clip(np.asarray(COLOURS[e["colour"]], np.float32) + rng.normal(0, 12, 3), 0, 255)
    canvas[mask] = colour
    canvas[mask & _pattern_mask(e["pattern"], s, int(rng.integers(0, 6)))] = 250.0
    canvas[mask & ~_erode(_erode(mask))] = 45.0  # a dark outline keeps the silhouette when the pattern is white
    canvas += rng.normal(0, noise, canvas.shape)
    return Image.fromarray(np.clip(canvas, 0, 255).astype(np.uint8))
