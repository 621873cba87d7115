"""Crop windows and flips, decided before decoding and shared by every backend.

Each sample's parameters are a hash of (seed, epoch, position in the epoch's order), so they do
not depend on the backend, the batch it lands in, the world size, or whether the run was resumed:
DALI and torch crop the same window, and a resumed run augments exactly as an uninterrupted one.
Train: torchvision's RandomResizedCrop algorithm (10 tries, then a centre crop) and a horizontal
flip. Eval: the centre square that 'resize shorter side to S / 0.875, centre crop S' keeps.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .order import mix
from .spec import LoaderSpec

TRIES = 10


@dataclass
class Windows:
    x: np.ndarray  # float64 pixels, left edge
    y: np.ndarray
    w: np.ndarray
    h: np.ndarray
    flip: np.ndarray  # bool


def uniforms(seed: int, epoch: int, positions: np.ndarray, count: int, stream: int = 4) -> np.ndarray:
    """`count` uniforms in [0, 1) per position; `stream` keeps one augmentation's draws apart from another's."""
    bits = mix(seed, epoch, stream, positions.astype(np.uint64)[:, None], np.arange(count, dtype=np.uint64)[None, :])
    return (bits >> np.uint64(11)).astype(np.float64) * 2.0**-53


def crop_windows(
    widths: np.ndarray, heights: np.ndarray, positions: np.ndarray, spec: LoaderSpec, epoch: int
) -> Windows:
    width, height = widths.astype(np.float64), heights.astype(np.float64)
    if not spec.train:
        resized_short = int(spec.image_size / spec.eval_crop_fraction)
        side = np.minimum(width, height) * spec.image_size / resized_short
        return Windows((width - side) / 2, (height - side) / 2, side, side, np.zeros(len(width), bool))
    u = uniforms(spec.seed, epoch, positions, 4 * TRIES + 1)
    area = (width * height)[:, None]
    target = area * (spec.scale[0] + (spec.scale[1] - spec.scale[0]) * u[:, :TRIES])
    log_lo, log_hi = np.log(spec.ratio[0]), np.log(spec.ratio[1])
    aspect = np.exp(log_lo + (log_hi - log_lo) * u[:, TRIES : 2 * TRIES])
    w = np.round(np.sqrt(target * aspect))
    h = np.round(np.sqrt(target / aspect))
    ok = (w > 0) & (w <= width[:, None]) & (h > 0) & (h <= height[:, None])
    rows = np.arange(len(width))
    first = ok.argmax(axis=1)
    cw, ch = w[rows, first], h[rows, first]
    x = np.floor(u[rows, 2 * TRIES + first] * (width - cw + 1))
    y = np.floor(u[rows, 3 * TRIES + first] * (height - ch + 1))
    fallback = ~ok.any(axis=1)
    if fallback.any():
        fx, fy, fw, fh = _centre_fallback(width[fallback], height[fallback], spec.ratio)
        x[fallback], y[fallback], cw[fallback], ch[fallback] = fx, fy, fw, fh
    flip = (u[:, 4 * TRIES] < 0.5) if spec.flip else np.zeros(len(width), bool)
    return Windows(x, y, cw, ch, flip)


def _centre_fallback(width: np.ndarray, height: np.ndarray, ratio: tuple[float, float]):
    in_ratio = width / height
    w, h = width.copy(), height.copy()
    narrow, wide = in_ratio < ratio[0], in_ratio > ratio[1]
    h[narrow] = np.round(w[narrow] / ratio[0])
    w[wide] = np.round(h[wide] * ratio[1])
    return np.floor((width - w) / 2), np.floor((height - h) / 2), w, h
