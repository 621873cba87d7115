"""The `dali` backend: DALI decodes (GPU "mixed" with nvJPEG and the hardware JPEG decoder, or CPU),
crops the window the reader chose (ROI decode), resizes, flips and normalises.

We feed DALI the encoded bytes ourselves (external source) instead of using its webdataset reader:
the order, the rank split and the crop windows are then the same as the torch backend's, resume is
a position rather than a DALI checkpoint, and a corrupt JPEG that slips past the reader's marker
check is handled here: DALI cannot skip it (NVIDIA/DALI#3913) and its pipeline is left unusable,
so we find the culprit with a strict CPU decode, replace it, rebuild the pipeline, and rerun the
batches it had in flight.

Overlap (the default on a GPU; `overlap="on"` forces it on a CPU device, where the step competes
for the same cores): DALI's pipelined, asynchronous executor pulls `prefetch` batches ahead from the external
source and decodes them in its own threads while the training step runs; a reader thread keeps
the next raw batch (bytes, labels, windows) ready for it, and a delivery thread takes DALI's
output into a torch tensor one batch ahead. The loader counts only batches it has delivered, so
what is decoded ahead is never in a saved position.
"""

from __future__ import annotations

import io
import logging
from collections import deque
from collections.abc import Generator, Iterator
from typing import Any

import numpy as np
import torch
from PIL import Image

from . import randaugment
from .ahead import read_ahead
from .backend import Batch, make_batch
from .index import DatasetIndex
from .order import RankSlice
from .reader import RawBatch, raw_batches
from .spec import LoaderSpec

log = logging.getLogger("vitforge.pipeline")


class Feed:
    """What DALI's external source pulls: the current epoch's raw batches as DALI inputs. DALI
    asks `prefetch` batches ahead; those asked for and not yet delivered are `in_flight`, in order."""

    def __init__(self, augmenting: bool = False):
        self.raws: Iterator[RawBatch] = iter(())
        self.in_flight: deque[RawBatch] = deque()
        self.augmenting = augmenting  # RandAugment's plan travels too

    def __iter__(self):
        return self

    def __next__(self):
        raw = next(self.raws)  # StopIteration ends DALI's epoch
        self.in_flight.append(raw)
        win = raw.windows
        w, h = raw.widths.astype(np.float64), raw.heights.astype(np.float64)
        anchor = np.stack([win.x / w, win.y / h], axis=1).astype(np.float32)
        shape = np.stack([win.w / w, win.h / h], axis=1).astype(np.float32)
        inputs: tuple[list, ...] = (
            [np.frombuffer(d, np.uint8) for d in raw.images],
            list(anchor),
            list(shape),
            list(win.flip.astype(np.int32)),
        )
        if self.augmenting:
            inputs += (list(raw.augment_ops), list(raw.augment_negate))
        return inputs


def _graph(spec: LoaderSpec, device_id: int | None, feed: Feed, overlap: bool):
    from nvidia.dali import fn, pipeline_def, types

    mixed = device_id is not None
    augmenting = feed.augmenting
    count = 6 if augmenting else 4

    # Conditionals let each sample of a batch take its own RandAugment operation.
    @pipeline_def(
        batch_size=spec.batch_size,
        num_threads=max(spec.workers, 1),
        device_id=device_id,
        prefetch_queue_depth=spec.prefetch if overlap else 1,
        exec_async=overlap,
        exec_pipelined=overlap,
        enable_conditionals=augmenting,
    )
    def graph():
        inputs = fn.external_source(
            source=feed,
            num_outputs=count,
            batch=True,
            dtype=[types.UINT8, types.FLOAT, types.FLOAT, types.INT32, types.INT32, types.INT32][:count],
            ndim=[1, 1, 1, 0, 1, 1][:count],
        )
        jpegs, anchor, shape, flip = inputs[:4]
        decoder_args = {"hw_decoder_load": spec.hw_decoder_load} if mixed else {}
        images = fn.decoders.image_slice(
            jpegs,
            anchor,
            shape,
            device="mixed" if mixed else "cpu",
            output_type=types.RGB,
            adjust_orientation=False,
            **decoder_args,
        )
        images = fn.resize(
            images, resize_x=spec.image_size, resize_y=spec.image_size, interp_type=types.INTERP_LINEAR, antialias=True
        )
        mirror = flip
        if augmenting:
            images, mirror = _randaugment(images, flip, inputs[4], inputs[5], spec), 0
        return fn.crop_mirror_normalize(
            images,
            mirror=mirror,
            dtype=types.FLOAT,
            output_layout="CHW",
            mean=[255 * m for m in spec.mean],
            std=[255 * s for s in spec.std],
        )

    pipe = graph()
    pipe.build()
    return pipe


def _randaugment(images, flip, ops, negate, spec: LoaderSpec):
    """The planned operations, after the flip (as the torch backend applies them), in DALI."""
    from nvidia.dali import fn, types
    from nvidia.dali.auto_aug.core import select, signed_bin

    images = fn.flip(images, horizontal=flip)
    suite = randaugment.dali_suite()
    for level in range(spec.randaugment[0]):
        images = select(
            suite,
            ops[level],
            data=images,
            num_magnitude_bins=randaugment.BINS,
            magnitude_bin=signed_bin(spec.randaugment[1], negate[level]),
            shape=(spec.image_size, spec.image_size),
            fill_value=randaugment.FILL,
            interp_type=types.INTERP_LINEAR,
        )
    return images


def strictly_decodes(data: bytes) -> bool:
    try:
        Image.open(io.BytesIO(data)).load()
        return True
    except Exception:
        return False


class DaliBackend:
    def __init__(self, spec: LoaderSpec, index: DatasetIndex, device: torch.device, mixed: bool):
        self.spec, self.index, self.device = spec, index, device
        self.device_id = (device.index or 0) if mixed else None
        self.name = "dali-mixed" if self.device_id is not None else "dali-cpu"
        # On a CPU device the step and the decoder share the same cores: decoding in line is faster.
        self.overlap = {"on": True, "off": False}.get(spec.overlap, device.type == "cuda")
        self.feed = Feed(augmenting=spec.train and spec.randaugment is not None)
        self.pipe: Any = None  # DALI's pipeline for the epoch being read

    def batches(self, epoch: int, rank_slice: RankSlice) -> Generator[Batch, None, None]:
        decoded = self._decoded(epoch, rank_slice)
        # With overlap, one thread drives DALI and copies its output out (tens of ms for a CPU batch
        # of floats) while the consumer's step runs.
        yield from read_ahead(decoded) if self.overlap else decoded

    def _decoded(self, epoch: int, rank_slice: RankSlice):
        dtype = getattr(torch, self.spec.dtype)
        raws = read_ahead(raw_batches(self.index, self.spec, epoch, rank_slice, range(rank_slice.num_batches)))
        # A fresh pipeline per epoch: one left mid-epoch still holds batches it prefetched.
        self._start(raws, [])
        try:
            while (images := self._next()) is not None:
                raw = self.feed.in_flight.popleft()
                yield make_batch(
                    images.to(dtype),
                    torch.from_numpy(raw.labels).to(self.device),
                    raw.positions,
                    raw.real,
                    raw.keys,
                    raw.bad,
                    raw.reads,
                )
        finally:
            raws.close()
            self.pipe = None

    def _start(self, rest: Iterator[RawBatch], first: list[RawBatch]) -> None:
        """A new pipeline that runs `first`, then `rest`; DALI prefetches from it at once."""
        self.feed.raws, self.feed.in_flight = _chain(first, rest), deque()
        self.pipe = _graph(self.spec, self.device_id, self.feed, self.overlap)
        self.pipe.schedule_run()

    def _next(self) -> torch.Tensor | None:
        """The next batch's images, or None at the end of the epoch."""
        for _ in range(sum(len(raw.images) for raw in self.feed.in_flight) + self.spec.prefetch + 1):
            try:
                (images,) = self.pipe.outputs()
                break
            except StopIteration:
                return None
            except RuntimeError as e:
                self._recover(e)
        else:
            raise RuntimeError("DALI kept failing on a batch after every bad sample was replaced")
        out = self._to_torch(images)  # before the next run: without overlap it reuses this buffer
        self.pipe.schedule_run()
        return out

    def _recover(self, error: RuntimeError) -> None:
        """Replace every sample of the in-flight batches that does not decode, then rerun them on a
        new pipeline, ahead of the rest of the epoch."""
        in_flight = list(self.feed.in_flight)
        culprits = [(raw, i) for raw in in_flight for i, data in enumerate(raw.images) if not strictly_decodes(data)]
        if not culprits:
            raise error
        for raw, i in culprits:
            raw.replace(i, f"DALI could not decode it: {str(error).splitlines()[0][:200]}")
        log.warning("rebuilding the DALI pipeline after a decode failure")
        self._start(self.feed.raws, in_flight)

    def _to_torch(self, images) -> torch.Tensor:
        dense = images.as_tensor()
        if self.device_id is None:
            # A view of DALI's buffer (reused after the next outputs()), copied by torch, which
            # releases the GIL: DALI's own copy holds it, stalling the consumer for a CPU batch.
            return torch.from_numpy(np.asarray(dense)).clone()
        from nvidia.dali.plugin.pytorch import feed_ndarray

        out = torch.empty(dense.shape(), dtype=torch.float32, device=self.device)
        feed_ndarray(dense, out, cuda_stream=torch.cuda.current_stream(self.device))
        return out


def _chain(first: list[RawBatch], rest: Iterator[RawBatch]) -> Iterator[RawBatch]:
    yield from first
    yield from rest


def dali_backend(spec: LoaderSpec, index: DatasetIndex, device: torch.device, num_classes: int) -> DaliBackend:
    """The factory registered as "dali": mixed (nvJPEG) decode on a GPU; on a CPU device the same as dali-cpu."""
    return DaliBackend(spec, index, device, mixed=device.type == "cuda")


def dali_cpu_backend(spec: LoaderSpec, index: DatasetIndex, device: torch.device, num_classes: int) -> DaliBackend:
    """The factory registered as "dali-cpu"."""
    return DaliBackend(spec, index, device, mixed=False)
