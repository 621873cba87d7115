"""`vitforge loader-bench`: how fast a loader backend feeds batches from your own shards."""

from __future__ import annotations

import argparse
import os
import resource
import time

import torch

from vitforge.core import is_remote, setup_logging
from vitforge.core.cli_args import bounded, non_negative_int, positive_float, positive_int

from .backend import backend_names
from .loader import build_loader
from .spec import LoaderSpec


def cpu_seconds() -> float:
    """CPU time of the whole process tree so far: this process (all its threads, DALI's too), its
    live descendants (DataLoader workers) and those already reaped. Read at both ends of a window,
    it charges every loader the same way, whether it decodes in threads or in processes."""
    import psutil

    own, reaped = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    total = own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime
    for child in psutil.Process().children(recursive=True):
        try:
            times = child.cpu_times()
            total += times.user + times.system
        except psutil.NoSuchProcess:  # reaped meanwhile: RUSAGE_CHILDREN has it next time
            pass
    return total


def measure(spec: LoaderSpec, steps: int, warmup: int, device: str) -> dict:
    """Images/s and CPU-seconds per image over `steps` batches after `warmup` batches: a
    steady-state window, with the CPU of the whole process tree (workers stay alive through it)."""
    loader = build_loader(spec, device=device)
    done, start, cpu_start = 0, None, None
    while done < warmup + steps:
        for batch in loader:  # noqa: B007 - only held until `del batch` frees it below
            if done == warmup:
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
                start, cpu_start = time.perf_counter(), cpu_seconds()
            done += 1
            if done == warmup + steps:
                break
        del batch
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    elapsed, cpu = time.perf_counter() - start, cpu_seconds() - cpu_start
    images = steps * spec.batch_size
    # Reads over every batch, warm-up included: shards are fetched whole, ahead of the batches that need them.
    delivered, reads = done * spec.batch_size, loader.reads
    return {
        "images_per_s": images / elapsed,
        "cpu_ms_per_image": 1000 * cpu / images,
        "requests_per_1000_images": 1000 * reads["requests"] / delivered,
        "bytes_per_image": reads["bytes"] / delivered,
        "images_read": delivered,
        "shard_opens": reads["opens"],
        "shard_fetches": reads["fetches"],
        "images_per_cpu_s": images / cpu if cpu else float("inf"),
        "seconds": elapsed,
        "backend": loader.backend.name,
    }


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="vitforge loader-bench", description=__doc__)
    p.add_argument("dataset", help="folder or s3:// prefix with dataset.json, or tar paths ('shards-{0..9}.tar')")
    p.add_argument("--backend", choices=("auto", *backend_names()), default="auto")
    p.add_argument("--batch", type=positive_int, default=64, help="batch size (default 64)")
    p.add_argument("--steps", type=positive_int, default=50, help="timed batches (default 50)")
    p.add_argument("--warmup", type=non_negative_int, default=5, help="batches before timing starts (default 5)")
    p.add_argument("--image-size", type=bounded(int, low=8), default=224)
    p.add_argument(
        "--workers",
        type=non_negative_int,
        default=len(os.sched_getaffinity(0)),
        help="decode processes (torch) or threads (DALI); default: CPUs available",
    )
    p.add_argument("--eval", action="store_true", help="eval transform (resize + centre crop) instead of train")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--cache-dir",
        help="s3:// datasets: the node's shard cache folder (default: $VITFORGE_CACHE_DIR, "
        "else the temp folder); a second run finds the shards there",
    )
    p.add_argument("--cache-gb", type=positive_float, default=32.0, help="shard cache size limit (default 32)")
    p.add_argument("--read-block-mb", type=positive_float, default=16, help="bytes per ranged GET, in MiB (default 16)")
    args = p.parse_args(argv)
    setup_logging()
    spec = LoaderSpec(
        args.dataset,
        batch_size=args.batch,
        image_size=args.image_size,
        train=not args.eval,
        backend=args.backend,
        workers=args.workers,
        cache_dir=args.cache_dir,
        cache_gb=args.cache_gb,
        read_block_mb=args.read_block_mb,
    )
    result = measure(spec, args.steps, args.warmup, args.device)
    chosen = result["backend"] + (" (chosen by auto)" if args.backend == "auto" else "")
    print(
        f"{chosen} on {args.device}: {result['images_per_s']:.0f} images/s, "
        f"{result['cpu_ms_per_image']:.2f} CPU-ms per image "
        f"({result['images_per_cpu_s']:.0f} images per CPU-second), "
        f"batch {args.batch} x {args.steps} steps, {args.image_size} px, {args.workers} workers"
    )
    if is_remote(args.dataset):
        opens, fetches = result["shard_opens"], result["shard_fetches"]
        print(
            f"object store: {result['requests_per_1000_images']:.0f} GETs per 1,000 images, "
            f"{result['bytes_per_image'] / 1024:.1f} KiB read per image, over {result['images_read']} images"
        )
        print(
            f"shard cache: {opens} shard opens, {fetches} fetched, cache hit rate "
            f"{100 * (1 - fetches / opens) if opens else 0:.0f}%"
        )
    return 0
