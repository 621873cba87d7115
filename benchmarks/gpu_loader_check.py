"""GPU loader check: JPEG decode on the GPU feeding 224 px training batches, from our shards.

DALI's wheel is too large to bring to the GPU machine, so this measures the stand-in the brief
names: torchvision's nvJPEG batch decode (`torchvision.io.decode_jpeg(..., device="cuda")`), fed by
our own reader (same order, rank split and crop windows as the DALI backend), then crop, resize,
flip and normalise on the GPU. The figure is a stand-in for DALI mixed decode, not DALI itself.

    python benchmarks/gpu_loader_check.py --device cuda [--images 4000] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torchvision  # noqa: E402

from vitforge.pipeline import LoaderSpec, load_index  # noqa: E402
from vitforge.pipeline.cli import cpu_seconds  # noqa: E402
from vitforge.pipeline.order import RankSlice  # noqa: E402
from vitforge.pipeline.reader import raw_batches  # noqa: E402
from vitforge.shards import ShardJob, run  # noqa: E402
from vitforge.synthetic import write_class_folders  # noqa: E402


def gpu_batches(spec: LoaderSpec, index, device: torch.device, steps: int):
    rank_slice = RankSlice(len(index), 0, 0, 1, spec.batch_size, "pad")
    mean = torch.tensor(spec.mean, device=device).view(1, 3, 1, 1)
    std = torch.tensor(spec.std, device=device).view(1, 3, 1, 1)
    for raw in raw_batches(index, spec, 0, rank_slice, (s % rank_slice.num_batches for s in range(steps))):
        data = [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in raw.images]
        decoded = torchvision.io.decode_jpeg(data, device=device)
        crops = []
        for image, x, y, w, h, flip in zip(decoded, raw.windows.x, raw.windows.y, raw.windows.w, raw.windows.h,
                                           raw.windows.flip):
            crop = image[:, int(y):int(y + h), int(x):int(x + w)].unsqueeze(0).float()
            crop = F.interpolate(crop, size=(spec.image_size, spec.image_size), mode="bilinear", antialias=True,
                                 align_corners=False)
            crops.append(crop.flip(-1) if flip else crop)
        images = ((torch.cat(crops) / 255 - mean) / std).to(torch.bfloat16)
        yield images, torch.from_numpy(raw.labels).to(device, non_blocking=True)


def consumer_wait(spec: LoaderSpec, device: str, batches: int = 40) -> dict:
    """Our loader on this machine with a consumer that sleeps (the step) 1.5x the loader's own
    time per batch: the fraction of the consumer's time spent waiting for data after batch 5."""
    from vitforge.pipeline import build_loader
    from vitforge.pipeline.cli import measure

    step_s = 1.5 * spec.batch_size / measure(spec, 20, 5, device)["images_per_s"]
    loader = build_loader(spec, device=device)
    stream = (batch for _ in range(batches) for batch in loader)
    for done in range(batches):
        if done == 5:
            loader.window()
        batch = next(stream)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        del batch
        time.sleep(step_s)
    return {"wait_fraction": loader.window()["data_wait_fraction"], "step_ms": 1000 * step_s,
            "workers": spec.workers}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--images", type=int, default=4000)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--out", default=os.environ.get("VITFORGE_GPU_OUT"))
    args = p.parse_args()
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory(prefix="vitforge-gpu-") as tmp:
        write_class_folders(os.path.join(tmp, "corpus"), num_classes=20, per_class=args.images // 20,
                            realistic=True, seed=1)
        run(ShardJob(src=os.path.join(tmp, "corpus"), dest=os.path.join(tmp, "shards"), workers=os.cpu_count() or 1,
                     shard_bytes=64 << 20))
        index = load_index(os.path.join(tmp, "shards"))
        spec = LoaderSpec(os.path.join(tmp, "shards"), batch_size=args.batch, image_size=224)
        batches = gpu_batches(spec, index, device, args.steps + 3)
        for _ in range(3):  # warm-up: nvJPEG handles, kernels
            next(batches)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start, cpu = time.perf_counter(), cpu_seconds()
        for images, labels in batches:
            pass
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed, cpu = time.perf_counter() - start, cpu_seconds() - cpu
        overlap = consumer_wait(LoaderSpec(os.path.join(tmp, "shards"), batch_size=64, image_size=224,
                                           backend="torch", workers=os.cpu_count() or 1), str(device))
    count = args.steps * args.batch
    figures = {
        "what": "torchvision nvJPEG decode (stand-in for DALI mixed) + crop/resize/flip/normalise on the GPU",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "images_per_s": count / elapsed, "cpu_ms_per_image": 1000 * cpu / count,
        "batch": args.batch, "steps": args.steps, "image_size": 224,
        "source_images": "generated, about 500x375, 106 KiB JPEG",
        "overlap": overlap,
    }
    print(f"loader (GPU decode stand-in: torchvision nvJPEG, not DALI) on {figures['device']}: "
          f"{figures['images_per_s']:.0f} images/s, {figures['cpu_ms_per_image']:.2f} CPU-ms per image "
          f"(goal >= 2000 images/s per H200, a few CPU-ms per image at most)")
    print(f"overlap: vitforge torch backend on {device} ({overlap['workers']} workers, batch 64), consumer at "
          f"{overlap['step_ms']:.0f} ms per batch (1.5x the loader's own time): data wait "
          f"{100 * overlap['wait_fraction']:.1f}% (goal <= 5%)")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "loader.json"), "w") as f:
            json.dump(figures, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
