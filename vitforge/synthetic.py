"""Generated image corpora: small learnable ones for demos and tests, realistic-size ones for benchmarks.

Class k has its own hue and stripe angle, so a small ViT can learn the classes; per-image phase,
offset and noise keep samples distinct. Noise strength sets the JPEG size: `realistic=True`
gives about 500x375 images of about 100 KB at quality 90, like a typical ImageNet photo.
"""

from __future__ import annotations

import colorsys
import io
import os

import numpy as np
from PIL import Image


def class_image(
    label: int, num_classes: int, rng: np.random.Generator, size: tuple[int, int], noise: float, hue_jitter: float = 0.0
) -> np.ndarray:
    """`hue_jitter`: the hue varies by up to this many class widths either way, so neighbouring
    classes share hues and only the stripes' angle tells them apart."""
    width, height = size
    angle = np.pi * label / num_classes
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    period = 6 + 0.05 * max(width, height) + rng.uniform(-2, 2)
    wave = np.sin((x * np.cos(angle) + y * np.sin(angle)) * 2 * np.pi / period + rng.uniform(0, 2 * np.pi))
    # Without jitter, no draw: the corpora made before it keep their pixels.
    hue = (label + rng.uniform(-hue_jitter, hue_jitter)) / num_classes % 1.0 if hue_jitter else label / num_classes
    rgb = np.array(colorsys.hsv_to_rgb(hue, 0.7, 0.9), dtype=np.float32) * 255
    pixels = rgb * (0.6 + 0.3 * wave[..., None]) + rng.normal(0, noise, (height, width, 3))
    return pixels.clip(0, 255).astype(np.uint8)


def write_class_folders(
    root: str,
    num_classes: int = 10,
    per_class: int = 30,
    size: tuple[int, int] = (160, 120),
    quality: int = 90,
    seed: int = 0,
    realistic: bool = False,
    varied: bool = False,
) -> list[str]:
    """Write ROOT/class_KK/img_NNNNN.jpg; return the paths in writing order. Sizes are `size` within
    10%, or with `varied`, any of 48-256 px on the longer side at aspect ratios 1:2 to 2:1, and hues
    that overlap between neighbouring classes."""
    rng = np.random.default_rng(seed)
    if realistic:
        size = (500, 375)
    noise = 22.0 if realistic else 8.0
    paths = []
    for label in range(num_classes):
        folder = os.path.join(root, f"class_{label:02d}")
        os.makedirs(folder, exist_ok=True)
        for n in range(per_class):
            if varied:
                longer, aspect = int(rng.integers(48, 257)), float(np.exp(rng.uniform(np.log(0.5), np.log(2))))
                jitter = (
                    (longer, max(int(longer / aspect), 24)) if aspect >= 1 else (max(int(longer * aspect), 24), longer)
                )
            else:
                jitter = (
                    size[0] + int(rng.integers(-size[0] // 10, size[0] // 10 + 1)),
                    size[1] + int(rng.integers(-size[1] // 10, size[1] // 10 + 1)),
                )
            pixels = class_image(label, num_classes, rng, jitter, noise, hue_jitter=1.0 if varied else 0.0)
            path = os.path.join(folder, f"img_{n:05d}.jpg")
            Image.fromarray(pixels).save(path, "JPEG", quality=quality)
            paths.append(path)
    return paths


def write_broken_files(root: str) -> dict[str, str]:
    """Files a sharder must reject, among ROOT's class folders: path -> the reject reason expected."""
    good = jpeg_bytes(class_image(0, 10, np.random.default_rng(0), (96, 64), 8.0))
    broken = {
        "class_00/broken_empty.jpg": (b"", "empty"),
        "class_01/broken_truncated.jpg": (good[: len(good) // 2], "truncated"),
        "class_02/broken_text.jpg": (b"this is a text file with an image's name\n", "not_an_image"),
        "class_03/broken_scan.jpg": (
            good[: len(good) // 2] + b"\xff\x00" * 50 + good[len(good) // 2 + 100 :],
            "corrupt",
        ),
    }
    written = {}
    for rel, (data, reason) in broken.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
        written[path] = reason
    return written


def jpeg_bytes(pixels: np.ndarray, quality: int = 90, **kwargs) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "JPEG", quality=quality, **kwargs)
    return out.getvalue()
