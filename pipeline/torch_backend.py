"""The `torch` backend: libjpeg-turbo (simplejpeg) or Pillow decode in DataLoader workers.

Worker w of N builds batches w, w+N, w+2N... and the DataLoader hands them out round-robin, so
batches arrive in order. Images travel as uint8 and are normalised on the device (4x less copying).
JPEGs decode at the smallest DCT scale that still covers the crop at the output size.
"""

from __future__ import annotations

import io
import math
import os
from typing import Iterator

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


def decode_crop(data: bytes, x: float, y: float, w: float, h: float, flip: bool, width: int, height: int,
                size: int) -> np.ndarray:
    """Decode, crop the window (x, y, w, h) in source pixels, resize to size x size, maybe flip."""
    if data[:2] == b"\xff\xd8":
        min_w = min(width, math.ceil(width * size / max(w, 1)))
        min_h = min(height, math.ceil(height * size / max(h, 1)))
        pixels = simplejpeg.decode_jpeg(data, colorspace="RGB", min_width=min_w, min_height=min_h)
        image = Image.fromarray(pixels)
    else:
        image = Image.open(io.BytesIO(data)).convert("RGB")
    sx, sy = image.width / width, image.height / height
    box = (x * sx, y * sy, (x + w) * sx, (y + h) * sy)
    out = np.asarray(image.resize((size, size), Image.Resampling.BILINEAR, box=box))
    return out[:, ::-1] if flip else out


def decode_batch(raw: RawBatch, size: int, magnitude: int = 0) -> Batch:
    """`magnitude`: RandAugment's magnitude bin, for a batch that carries its plan."""
    out = np.empty((len(raw.images), size, size, 3), np.uint8)
    for i, data in enumerate(raw.images):
        win = raw.windows
        args = (float(win.x[i]), float(win.y[i]), float(win.w[i]), float(win.h[i]), bool(win.flip[i]),
                int(raw.widths[i]), int(raw.heights[i]), size)
        try:
            out[i] = decode_crop(data, *args)
        except Exception as e:  # noqa: BLE001 - any decoder failure makes this one sample bad, not the run
            raw.replace(i, f"does not decode: {e}")
            out[i] = decode_crop(raw.images[i], 0, 0, raw.widths[i], raw.heights[i], False,
                                 int(raw.widths[i]), int(raw.heights[i]), size)
        if raw.augment_ops is not None:
            pixels = torch.from_numpy(out[i]).permute(2, 0, 1)
            out[i] = randaugment.apply(pixels, raw.augment_ops[i], raw.augment_negate[i], magnitude).permute(1, 2, 0)
    return make_batch(torch.from_numpy(out), torch.from_numpy(raw.labels), raw.positions, raw.real, raw.keys, raw.bad,
                      raw.reads)


class Normalise:
    """NHWC uint8 -> NCHW (x / 255 - mean) / std in `spec.dtype`, one multiply-add per element;
    the constants are made once, on the device that normalises."""

    def __init__(self, spec: LoaderSpec, device: torch.device):
        mean, std = (torch.tensor(v, device=device).view(1, 3, 1, 1) for v in (spec.mean, spec.std))
        self.scale, self.shift, self.dtype = 1 / (255 * std), -mean / std, getattr(torch, spec.dtype)

    def __call__(self, pixels: torch.Tensor) -> torch.Tensor:
        images = torch.empty(pixels.shape[0], 3, *pixels.shape[1:3], device=pixels.device)
        images.copy_(pixels.permute(0, 3, 1, 2))
        return torch.addcmul(self.shift, images, self.scale, out=images).to(self.dtype)


class _Batches(torch.utils.data.IterableDataset):
    def __init__(self, index: DatasetIndex, spec: LoaderSpec, epoch: int, rank_slice: RankSlice,
                 normalise_here: bool):
        self.index, self.spec, self.epoch, self.rank_slice = index, spec, epoch, rank_slice
        self.normalise_here = normalise_here
        # Once per rank, before the workers start: they inherit it, and the index of its shards.
        self.order: EpochOrder = rank_order(index, spec, epoch, rank_slice)

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        mine = range(worker, self.rank_slice.num_batches, workers)
        normalise = Normalise(self.spec, torch.device("cpu")) if self.normalise_here else None
        for raw in raw_batches(self.index, self.spec, self.epoch, self.rank_slice, mine, self.order):
            batch = decode_batch(raw, self.spec.image_size, self.spec.randaugment[1] if self.spec.randaugment else 0)
            if normalise is not None:
                batch["image"] = normalise(batch["image"])
            yield batch


def _lower_priority(_worker: int) -> None:
    """Decode workers yield the CPU to the training process's own thread: when they fill every core,
    the step's thread would otherwise wait for a time slice each time it wakes up."""
    os.nice(5)


class TorchBackend:
    name = "torch"

    def __init__(self, spec: LoaderSpec, index: DatasetIndex, device: torch.device):
        self.spec, self.index, self.device = spec, index, device
        self.normalise = Normalise(spec, device) if device.type == "cuda" else None

    def batches(self, epoch: int, rank_slice: RankSlice) -> Iterator[Batch]:
        # For a GPU, uint8 travels (4x less to copy) and the GPU normalises; for the CPU the workers
        # normalise too, so the step's own thread does no loader work.
        on_gpu = self.device.type == "cuda"
        workers = self.spec.workers
        loader = torch.utils.data.DataLoader(
            _Batches(self.index, self.spec, epoch, rank_slice, normalise_here=not on_gpu), batch_size=None,
            num_workers=workers, prefetch_factor=self.spec.prefetch if workers else None, pin_memory=on_gpu,
            worker_init_fn=_lower_priority,
            # Its own generator: each DataLoader iterator draws a seed, which from the global RNG would
            # shift the dropout masks of a resumed run (it starts one more iterator than the original).
            generator=torch.Generator().manual_seed(self.spec.seed))
        if on_gpu:
            # From pinned memory, on a side stream, one batch ahead: the copy overlaps the step.
            yield from copy_ahead(iter(loader), self._to_device, torch.cuda.Stream(self.device))
        else:
            # Receiving a batch from a worker (unpickling, mapping its shared memory) takes a few ms of
            # the consumer's thread for a large batch; a thread takes it while the step runs. (On a
            # GPU the DataLoader's pin-memory thread already does.)
            yield from read_ahead(iter(loader)) if workers else loader

    def _to_device(self, batch: Batch) -> Batch:
        return {**batch, "image": self.normalise(batch["image"].to(self.device, non_blocking=True)),
                "label": batch["label"].to(self.device, non_blocking=True)}

