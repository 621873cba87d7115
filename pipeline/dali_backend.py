"""The `dali` backend: DALI decodes (GPU "mixed" with nvJPEG and the hardware JPEG decoder, or CPU),
crops the window the reader chose (ROI decode), resizes, flips and normalises.

We feed DALI the encoded bytes ourselves (external source) instead of using its webdataset reader:
the order, the rank split and the crop windows are then the same as the torch backend's, resume is
a position rather than a DALI checkpoint, and a corrupt JPEG that slips past the reader's marker
check is handled here: DALI cannot skip it (NVIDIA/DALI#3913) and its pipeline is left unusable,
so we find the culprit with a strict CPU decode, replace it, rebuild the pipeline, and rerun the batch.
"""

from __future__ import annotations

import io
import logging
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from PIL import Image

from .index import DatasetIndex
from .order import RankSlice
from .reader import RawBatch, raw_batches
from .spec import LoaderSpec

log = logging.getLogger("vitforge.pipeline")


def _graph(spec: LoaderSpec, device_id: int | None):
    from nvidia.dali import fn, pipeline_def, types

    mixed = device_id is not None

    @pipeline_def(batch_size=spec.batch_size, num_threads=max(spec.workers, 1), device_id=device_id,
                  prefetch_queue_depth=1, exec_async=False, exec_pipelined=False)
    def graph():
        jpegs = fn.external_source(name="jpegs", dtype=types.UINT8, ndim=1)
        anchor = fn.external_source(name="anchor", dtype=types.FLOAT, ndim=1)
        shape = fn.external_source(name="shape", dtype=types.FLOAT, ndim=1)
        flip = fn.external_source(name="flip", dtype=types.INT32, ndim=0)
        decoder_args = {"hw_decoder_load": spec.hw_decoder_load} if mixed else {}
        images = fn.decoders.image_slice(jpegs, anchor, shape, device="mixed" if mixed else "cpu",
                                         output_type=types.RGB, adjust_orientation=False, **decoder_args)
        images = fn.resize(images, resize_x=spec.image_size, resize_y=spec.image_size,
                           interp_type=types.INTERP_LINEAR, antialias=True)
        return fn.crop_mirror_normalize(images, mirror=flip, dtype=types.FLOAT, output_layout="CHW",
                                        mean=[255 * m for m in spec.mean], std=[255 * s for s in spec.std])

    pipe = graph()
    pipe.build()
    return pipe


def strictly_decodes(data: bytes) -> bool:
    try:
        Image.open(io.BytesIO(data)).load()
        return True
    except Exception:  # noqa: BLE001 - every decoder failure means the same thing here
        return False


class DaliBackend:
    def __init__(self, spec: LoaderSpec, index: DatasetIndex, device: torch.device, mixed: bool):
        self.spec, self.index, self.device = spec, index, device
        self.device_id = (device.index or 0) if mixed else None
        self.name = "dali-mixed" if self.device_id is not None else "dali-cpu"
        self.pipe = _graph(spec, self.device_id)

    def batches(self, epoch: int, rank_slice: RankSlice):
        dtype = getattr(torch, self.spec.dtype)
        source = raw_batches(self.index, self.spec, epoch, rank_slice, range(rank_slice.num_batches))
        try:
            # One thread reads batch b+1 while DALI decodes batch b.
            with ThreadPoolExecutor(1, thread_name_prefix="read-ahead") as ahead:
                pending = ahead.submit(next, source, None)
                while (raw := pending.result()) is not None:
                    pending = ahead.submit(next, source, None)
                    images = self._run(raw).to(dtype)
                    yield {"image": images, "label": torch.from_numpy(raw.labels).to(self.device), "key": raw.keys,
                           "bad": raw.bad}
        finally:
            source.close()

    def _run(self, raw: RawBatch) -> torch.Tensor:
        for _ in range(len(raw.images) + 1):
            try:
                return self._feed_and_run(raw)
            except RuntimeError as e:
                culprits = [i for i, data in enumerate(raw.images) if not strictly_decodes(data)]
                if not culprits:
                    raise
                for i in culprits:
                    raw.replace(i, f"DALI could not decode it: {str(e).splitlines()[0][:200]}")
                log.warning("rebuilding the DALI pipeline after a decode failure")
                self.pipe = _graph(self.spec, self.device_id)
        raise RuntimeError("DALI kept failing on a batch after every bad sample was replaced")

    def _feed_and_run(self, raw: RawBatch) -> torch.Tensor:
        from nvidia.dali.plugin.pytorch import feed_ndarray

        win = raw.windows
        w, h = raw.widths.astype(np.float64), raw.heights.astype(np.float64)
        anchor = np.stack([win.x / w, win.y / h], axis=1).astype(np.float32)
        shape = np.stack([win.w / w, win.h / h], axis=1).astype(np.float32)
        self.pipe.feed_input("jpegs", [np.frombuffer(d, np.uint8) for d in raw.images])
        self.pipe.feed_input("anchor", list(anchor))
        self.pipe.feed_input("shape", list(shape))
        self.pipe.feed_input("flip", list(win.flip.astype(np.int32)))
        (images,) = self.pipe.run()
        dense = images.as_tensor()
        on_gpu = self.device_id is not None
        out = torch.empty(dense.shape(), dtype=torch.float32, device=self.device if on_gpu else "cpu")
        feed_ndarray(dense, out, cuda_stream=torch.cuda.current_stream(self.device) if on_gpu else None)
        return out.to(self.device, non_blocking=True)
