"""The torch backend's CPU path (pipeline/torch_backend.py): train crops resized from the window alone, as
torchvision's crop-then-resize does; uint8 planes from the workers, normalised by the consumer."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from common.checks import dataset_samples
from common.cli import vitforge
from vitforge.pipeline import IMAGENET_MEAN, IMAGENET_STD, LoaderSpec, build_loader
from vitforge.pipeline.augment import crop_windows


@pytest.fixture(scope="module")
def textured(tmp_path_factory):
    """Detailed images (noise over gradients): a window one pixel off, or border pixels taken from
    outside it, show in the mean difference."""
    root = tmp_path_factory.mktemp("textured")
    rng = np.random.default_rng(1)
    (root / "src" / "c").mkdir(parents=True)
    for i in range(12):
        w, h = int(rng.integers(90, 160)), int(rng.integers(70, 130))
        y, x = np.mgrid[0:h, 0:w].astype(np.float32)
        base = np.stack([255 * x / w, 255 * y / h, 128 + 0 * x], axis=-1)
        pixels = np.clip(base + rng.normal(0, 40, base.shape), 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(root / "src" / "c" / f"{i}.jpg", quality=95)
    vitforge("shard", root / "src", root / "out", "--workers", "1")
    return root / "out", {s["key"]: s["image_bytes"] for s in dataset_samples(root / "out")}


def _normalised(pixels: np.ndarray) -> torch.Tensor:
    image = torch.from_numpy(pixels.astype(np.float32) / 255).permute(2, 0, 1)
    return (image - torch.tensor(IMAGENET_MEAN).view(3, 1, 1)) / torch.tensor(IMAGENET_STD).view(3, 1, 1)


def test_train_crops_equal_torchvision_crop_then_resize(textured):
    dataset, sources = textured
    size = 48
    spec = LoaderSpec(str(dataset), batch_size=6, image_size=size, backend="torch", workers=0, seed=5)
    batch = next(iter(build_loader(spec)))
    images = [Image.open(io.BytesIO(sources[key.split(":")[1]])).convert("RGB") for key in batch["key"]]
    windows = crop_windows(np.array([i.width for i in images]), np.array([i.height for i in images]),
                           batch["position"].numpy(), spec, 0)
    errors, shifted = [], []
    for i, image in enumerate(images):
        x, y, w, h = (int(v) for v in (windows.x[i], windows.y[i], windows.w[i], windows.h[i]))
        assert (x, y, w, h) == (windows.x[i], windows.y[i], windows.w[i], windows.h[i])  # train windows: whole pixels

        def reference(left, top):
            crop = image.crop((left, top, left + w, top + h))
            pixels = np.asarray(crop.resize((size, size), Image.Resampling.BILINEAR))
            return _normalised(pixels[:, ::-1] if windows.flip[i] else pixels)

        errors.append(float((batch["image"][i] - reference(x, y)).abs().mean()))
        other = (x + 1, y) if x + w < image.width else (x - 1, y)
        shifted.append(float((batch["image"][i] - reference(*other)).abs().mean()))
    # The same decoder (libjpeg-turbo) and the same antialiased bilinear filter: rounding apart.
    assert max(errors) < 0.01, errors
    assert all(e < 0.25 * s for e, s in zip(errors, shifted)), (errors, shifted)


def test_workers_ship_uint8_and_the_consumer_normalises_to_the_same_batches(textured):
    dataset, _ = textured
    specs = [LoaderSpec(str(dataset), batch_size=4, image_size=32, backend="torch", workers=n) for n in (0, 2)]
    in_line, from_workers = ([b["image"] for b in build_loader(s)] for s in specs)
    assert len(in_line) == len(from_workers) == 3
    for a, b in zip(in_line, from_workers):
        assert a.dtype == b.dtype == torch.float32 and a.shape == (4, 3, 32, 32) and a.is_contiguous()
        assert torch.equal(a, b)
