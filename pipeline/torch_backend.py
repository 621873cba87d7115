"""The `torch` backend: libjpeg-turbo (simplejpeg) or Pillow decode in DataLoader workers.

Worker w of N builds batches w, w+N, w+2N... and the DataLoader hands them out round-robin, so
batches arrive in order. Images travel as uint8 planes (N x 3 x S x S) and are normalised by the
loader's device (4x less copying). JPEGs decode at the smallest DCT scale of 1/2 or below that still
covers the crop at the output size, else whole.
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Generator

import numpy as np
import simplejpeg
import torch
from PIL import Image

from . import randaugment
from .ahead import copy_ahead, read_ahead
from .backend import Batch, make_batch
from .index import DatasetIndex
from .order import EpochOrder, RankSlice
from .reader import RawBatch, rank_order, raw_batches
from .spec import LoaderSpec


def decode_crop(
    data: bytes, x: float, y: float, w: float, h: float, flip: bool, width: int, height: int, out: np.ndarray
) -> None:
    """Decode, crop the window (x, y, w, h) in source pixels, resize it into `out` (3 x S x S
    uint8, a row of the batch), maybe flipped."""
    size = out.shape[1]
    if data[:2] == b"\xff\xd8":
        # Only DCT scales of 1/2 and below: libjpeg-turbo's 5/8-7/8 scales cost more than a full
        # decode (no SIMD inverse DCT), so a crop less than twice the output decodes whole.
        min_w = min(width, math.ceil(width * size / max(w, 1)))
        min_h = min(height, math.ceil(height * size / max(h, 1)))
        pixels = simplejpeg.decode_jpeg(data, colorspace="RGB", min_width=min_w, min_height=min_h, min_factor=2)
        sx, sy = pixels.shape[1] / width, pixels.shape[0] / height
        box = (x * sx, y * sy, (x + w) * sx, (y + h) * sy)
        if all(edge.is_integer() for edge in box):
            _resize_window(pixels, box, flip, out)
            return
        image = Image.fromarray(pixels)
    else:
        image = Image.open(io.BytesIO(data)).convert("RGB")
        sx, sy = image.width / width, image.height / height
        box = (x * sx, y * sy, (x + w) * sx, (y + h) * sy)
    resized = image.resize((size, size), Image.Resampling.BILINEAR, box=box)
    if flip:
        resized = resized.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    # Planes, as the device wants them: Pillow splits the bands in C, and the consumer's
    # normalisation then reads and writes contiguous memory.
    for plane, band in zip(out, resized.split()):
        plane[:] = np.asarray(band)


def _resize_window(pixels: np.ndarray, box: tuple[float, ...], flip: bool, out: np.ndarray) -> None:
    """A window on whole pixels (every train crop of a whole decode): torch's antialiased bilinear
    resize of uint8 RGB (vectorised; 2-3x faster than Pillow's) on the window itself, as
    torchvision's crop-then-resize and DALI's region-of-interest decode see it."""
    left, top, right, bottom = (int(edge) for edge in box)
    window = torch.from_numpy(pixels).permute(2, 0, 1)[None, :, top:bottom, left:right]
    resized = torch.nn.functional.interpolate(window, size=out.shape[1:], mode="bilinear", antialias=True)[0]
    torch.from_numpy(out).copy_(resized.flip(2) if flip else resized)


def decode_batch(raw: RawBatch, size: int, magnitude: int = 0) -> Batch:
    """`magnitude`: RandAugment's magnitude bin, for a batch that carries its plan."""
    out = np.empty((len(raw.images), 3, size, size), np.uint8)
    for i, data in enumerate(raw.images):
        win = raw.windows
        args = (
            float(win.x[i]),
            float(win.y[i]),
            float(win.w[i]),
            float(win.h[i]),
            bool(win.flip[i]),
            int(raw.widths[i]),
            int(raw.heights[i]),
        )
        try:
            decode_crop(data, *args, out[i])
        except Exception as e:
            raw.replace(i, f"does not decode: {e}")
            decode_crop(
                raw.images[i],
                0,
                0,
                raw.widths[i],
                raw.heights[i],
                False,
                int(raw.widths[i]),
                int(raw.heights[i]),
                out[i],
            )
        if raw.augment_ops is not None:
            out[i] = randaugment.apply(torch.from_numpy(out[i]), raw.augment_ops[i], raw.augment_negate[i], magnitude)
    return make_batch(
        torch.from_numpy(out), torch.from_numpy(raw.labels), raw.positions, raw.real, raw.keys, raw.bad, raw.reads
    )


class Normalise:
    """N x 3 x S x S uint8 -> (x / 255 - mean) / std in `spec.dtype`, one multiply and one add per
    element; the constants are made once, on the device that normalises."""

    def __init__(self, spec: LoaderSpec, device: torch.device):
        mean, std = (torch.tensor(v, device=device).view(1, 3, 1, 1) for v in (spec.mean, spec.std))
        self.scale, self.shift, self.dtype = 1 / (255 * std), -mean / std, getattr(torch, spec.dtype)

    def __call__(self, pixels: torch.Tensor) -> torch.Tensor:
        if pixels.device.type == "cpu":
            images = np.empty(pixels.shape, np.float32)
            self.into(pixels.numpy(), images)
            return torch.from_numpy(images).to(self.dtype)
        images = pixels.to(torch.float32)
        return torch.addcmul(self.shift, images, self.scale, out=images).to(self.dtype)

    def into(self, pixels: np.ndarray, out: np.ndarray) -> None:
        """CPU uint8 pixels normalised into float32 `out` of their shape. numpy's ufuncs cast uint8
        in cache-sized pieces on one thread: a third of the CPU time of torch's cast and
        multiply-add (which also wake every intra-op thread for it)."""
        np.multiply(pixels, self.scale.numpy(), out=out)
        np.add(out, self.shift.numpy(), out=out)


class _Batches(torch.utils.data.IterableDataset):
    def __init__(self, index: DatasetIndex, spec: LoaderSpec, epoch: int, rank_slice: RankSlice):
        self.index, self.spec, self.epoch, self.rank_slice = index, spec, epoch, rank_slice
        # Once per rank, before the workers start: they inherit it, and the index of its shards.
        self.order: EpochOrder = rank_order(index, spec, epoch, rank_slice)

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        mine = range(worker, self.rank_slice.num_batches, workers)
        for raw in raw_batches(self.index, self.spec, self.epoch, self.rank_slice, mine, self.order):
            yield decode_batch(raw, self.spec.image_size, self.spec.randaugment[1] if self.spec.randaugment else 0)


def _lower_priority(_worker: int) -> None:
    """Decode workers yield the CPU to the training process's own thread: when they fill every core,
    the step's thread would otherwise wait for a time slice each time it wakes up."""
    os.nice(5)


class TorchBackend:
    name = "torch"

    def __init__(self, spec: LoaderSpec, index: DatasetIndex, device: torch.device):
        self.spec, self.index, self.device = spec, index, device
        self.normalise = Normalise(spec, device)
        # False: a CPU device's batches keep their uint8 pixels, for a caller that normalises them
        # itself once it has put them where they go (a mixture's batch: no float copy in between).
        self.normalises = True

    def batches(self, epoch: int, rank_slice: RankSlice) -> Generator[Batch, None, None]:
        # uint8 travels from the workers (4x less to copy through shared memory, and to pin) and the
        # loader's device normalises.
        on_gpu = self.device.type == "cuda"
        workers = self.spec.workers
        loader = torch.utils.data.DataLoader(
            _Batches(self.index, self.spec, epoch, rank_slice),
            batch_size=None,
            num_workers=workers,
            prefetch_factor=self.spec.prefetch if workers else None,
            pin_memory=on_gpu,
            worker_init_fn=_lower_priority,
            # Its own generator: each DataLoader iterator draws a seed, which from the global RNG would
            # shift the dropout masks of a resumed run (it starts one more iterator than the original).
            generator=torch.Generator().manual_seed(self.spec.seed),
        )
        if on_gpu:
            # From pinned memory, on a side stream, one batch ahead: the copy overlaps the step.
            yield from copy_ahead(iter(loader), self._to_device, torch.cuda.Stream(self.device))
        else:
            # Receiving a batch from a worker (unpickling, mapping its shared memory) and normalising
            # it take the consumer's process some ms per batch; a thread does both while the step
            # runs, so the step's own thread does no loader work.
            received = map(self._normalised, loader) if self.normalises else iter(loader)
            yield from read_ahead(received) if workers else received

    def _normalised(self, batch: Batch) -> Batch:
        return {**batch, "image": self.normalise(batch["image"])}

    def _to_device(self, batch: Batch) -> Batch:
        return {
            **batch,
            "image": self.normalise(batch["image"].to(self.device, non_blocking=True)),
            "label": batch["label"].to(self.device, non_blocking=True),
        }


def torch_backend(spec: LoaderSpec, index: DatasetIndex, device: torch.device, num_classes: int) -> TorchBackend:
    """The factory registered as "torch" (backend.py)."""
    return TorchBackend(spec, index, device)
