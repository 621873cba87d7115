"""RandAugment (Cubuk et al., 2020): `num_ops` operations per image, drawn from 14, at one magnitude.

Which operations, in which order and with which sign, is decided here per (seed, epoch, position)
before decoding, like the crop windows, so both backends apply the same operations to the same
samples and a resumed run augments as an uninterrupted one. The magnitudes are torchvision's and
DALI's (31 bins): shear 0-0.3, translation 0-150/331 of the side, rotation 0-30 degrees,
brightness/contrast/colour/sharpness factor 1 +- 0-0.9, posterize 8-4 bits, solarize threshold
255-0; empty areas are filled with grey 128, resampling is bilinear. This module applies them with
torchvision on the torch backend; the DALI backend applies DALI's implementations of the same
operations (`nvidia.dali.auto_aug`), so pixels agree closely but not bit for bit.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .augment import uniforms

OPS = (
    "translate_x",
    "translate_y",
    "shear_x",
    "shear_y",
    "rotate",
    "brightness",
    "contrast",
    "color",
    "sharpness",
    "posterize",
    "solarize",
    "equalize",
    "auto_contrast",
    "identity",
)
SIGNED = {
    "translate_x",
    "translate_y",
    "shear_x",
    "shear_y",
    "rotate",
    "brightness",
    "contrast",
    "color",
    "sharpness",
}  # their magnitude is negated half the time
BINS = 31
TRANSLATE = 150 / 331  # of the image side, at the largest magnitude
FILL = 128


def plan(seed: int, epoch: int, positions: np.ndarray, num_ops: int) -> tuple[np.ndarray, np.ndarray]:
    """(ops, negate), each (samples, num_ops): indices into OPS, and whether the magnitude is negated."""
    draws = uniforms(seed, epoch, positions, 2 * num_ops, stream=5)
    ops = np.minimum((draws[:, :num_ops] * len(OPS)).astype(np.int32), len(OPS) - 1)
    return ops, (draws[:, num_ops:] < 0.5).astype(np.int32)


def magnitude(op: str, bin_: int) -> float:
    """The operation's parameter at this magnitude bin, before any sign."""
    ranges = {
        "translate_x": (0, TRANSLATE),
        "translate_y": (0, TRANSLATE),
        "shear_x": (0, 0.3),
        "shear_y": (0, 0.3),
        "rotate": (0, 30),
        "brightness": (0, 0.9),
        "contrast": (0, 0.9),
        "color": (0, 0.9),
        "sharpness": (0, 0.9),
        "posterize": (8, 4),
        "solarize": (255, 0),
    }
    low, high = ranges.get(op, (0, 0))
    return low + (high - low) * bin_ / (BINS - 1)


def apply(image: torch.Tensor, ops: np.ndarray, negate: np.ndarray, bin_: int) -> torch.Tensor:
    """One image (uint8, 3 x H x W) through its planned operations, in order."""
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms import functional as F

    bilinear, fill = InterpolationMode.BILINEAR, [float(FILL)] * 3
    height, width = image.shape[-2:]
    for op_index, negative in zip(ops, negate):
        op = OPS[op_index]
        value = magnitude(op, bin_) * (-1 if negative and op in SIGNED else 1)
        if op in ("translate_x", "translate_y"):
            shift = [value * width, 0.0] if op == "translate_x" else [0.0, value * height]
            image = F.affine(
                image, angle=0.0, translate=shift, scale=1.0, shear=[0.0, 0.0], interpolation=bilinear, fill=fill
            )
        elif op in ("shear_x", "shear_y"):
            # DALI maps input to output (x' = x + s*y); torchvision's angle shears the other way
            degrees = -math.degrees(math.atan(value))
            image = F.affine(
                image,
                angle=0.0,
                translate=[0, 0],
                scale=1.0,
                interpolation=bilinear,
                fill=fill,
                shear=[degrees, 0.0] if op == "shear_x" else [0.0, degrees],
                center=[0, 0],
            )
        elif op == "rotate":
            image = F.rotate(image, value, interpolation=bilinear, fill=fill)
        elif op in ("brightness", "contrast", "color", "sharpness"):
            adjust = {
                "brightness": F.adjust_brightness,
                "contrast": F.adjust_contrast,
                "color": F.adjust_saturation,
                "sharpness": F.adjust_sharpness,
            }[op]
            image = adjust(image, 1.0 + value)
        elif op == "posterize":
            image = F.posterize(image, round(value))
        elif op == "solarize":
            image = F.solarize(image, value)
        elif op == "equalize":
            image = F.equalize(image)
        elif op == "auto_contrast":
            image = F.autocontrast(image)
    return image


def dali_suite():
    """DALI's implementations of OPS, in OPS's order, with the same ranges, fill and sampling."""
    from nvidia.dali import fn
    from nvidia.dali.auto_aug import augmentations as a
    from nvidia.dali.auto_aug.core import augmentation
    from nvidia.dali.auto_aug.rand_augment import get_rand_augment_suite

    # DALI's own sharpness and equalize still call the deprecated fn.experimental aliases (a
    # warning on every pipeline build): the same operations through fn.filter and fn.equalize.
    @augmentation(mag_range=(0, 0.9), randomly_negate=True, mag_to_param=a.sharpness_kernel, param_device="auto")
    def sharpness(data, kernel):
        return fn.filter(data, kernel)

    @augmentation
    def equalize(data, _):
        return fn.equalize(data)

    shipped = {aug.name: aug for aug in get_rand_augment_suite(use_shape=True, max_translate_rel=TRANSLATE)}
    shipped.update(
        solarize=a.solarize.augmentation((255, 0)),  # DALI's default starts at 256
        sharpness=sharpness,
        equalize=equalize,
    )
    return [shipped[name] for name in OPS]
