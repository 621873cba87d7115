"""GPU end-to-end check: ViT-H/14, bf16, ZeRO-2 on one GPU for a few dozen steps, fed by the real
loader from real JPEG shards, once eager and once with `model.compile` (each transformer block
compiled). Prints images/s, data wait and MFU of the last log window for each, and the ratio.

The loader here is the torch backend (libjpeg-turbo decode in DataLoader workers, pinned-memory
copies on a side CUDA stream one batch ahead): DALI's wheel is too large to bring to the GPU
machine, and the loader has no nvJPEG path of its own; nvJPEG decode speed, DALI's stand-in, is
measured by gpu_loader_check.py. What differs from a cluster node: one GPU, local shards.

    python benchmarks/gpu_e2e_check.py [--images 3072] [--steps 40] [--micro-batch 64] [--out DIR]
    python benchmarks/gpu_e2e_check.py --model vit_tiny_cpu --image-size 32 --precision fp32 --images 256 \
        --steps 6 --micro-batch 8   # the script itself, on a CPU
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

from benchmarks.gpu_train_check import run_recipe  # noqa: E402
from vitforge.shards import ShardJob, run  # noqa: E402
from vitforge.synthetic import write_class_folders  # noqa: E402


def train(shards: str, work: str, args, compiled: bool) -> dict | None:
    run_name = "compiled" if compiled else "eager"
    sets = [f"data.train={shards}", "data.val=null", "data.backend=auto", f"data.workers={args.workers}",
            f"model.name={args.model}", f"model.image_size={args.image_size}", f"model.compile={str(compiled).lower()}",
            "model.grad_checkpointing=false", f"train.steps={args.steps}", f"train.log_every={args.steps // 2}",
            f"train.micro_batch={args.micro_batch}", f"train.global_batch={args.micro_batch}", "train.zero_stage=2",
            f"train.precision={args.precision}", "optimizer.warmup_steps=1", "data.partitions=null"]
    started = time.monotonic()
    ran = run_recipe(sets, work, run_name, args.timeout, run_name)
    if ran is None:
        return None
    logged, stderr = ran
    last = logged[-1]  # the first window holds start-up (and the compile)
    backend = next((line.split("loader backend: ", 1)[1].split(" (")[0] for line in stderr.splitlines()
                    if "loader backend: " in line), "?")
    return {"compile": compiled, "images_per_s": last["images_per_s"], "data_wait": last["data_wait_fraction"],
            "mfu": last["mfu"], "peak_memory_gb": max(m["memory_gb"] for m in logged), "backend": backend,
            "wall_s": time.monotonic() - started}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=3072)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--micro-batch", type=int, default=64)
    p.add_argument("--workers", type=int, default=max((os.cpu_count() or 2) - 2, 1))
    p.add_argument("--model", default="vit_huge_patch14_224")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--precision", default="bf16")
    p.add_argument("--timeout", type=int, default=170, help="seconds per training run")
    p.add_argument("--out", default=os.environ.get("VITFORGE_GPU_OUT"))
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="vitforge-e2e-") as work:
        started = time.monotonic()
        write_class_folders(f"{work}/src", num_classes=8, per_class=args.images // 8, realistic=True)
        run(ShardJob(src=f"{work}/src", dest=f"{work}/shards", shard_samples=256, workers=os.cpu_count() or 1))
        print(f"  {args.images} JPEGs of about 500x375 generated and sharded in {time.monotonic() - started:.0f} s")
        results = [r for r in (train(f"{work}/shards", work, args, compiled) for compiled in (False, True)) if r]
    for r in results:
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "unknown (device not in the peak table)"
        print(f"e2e {args.model} {args.precision} ZeRO-2, 1 device, {r['backend']} loader, "
              f"compile {'on' if r['compile'] else 'off'}: "
              f"{r['images_per_s']:.0f} images/s, data wait {100 * r['data_wait']:.1f}% (goal <= 5%), MFU {mfu}, "
              f"peak memory {r['peak_memory_gb']:.1f} GiB, run {r['wall_s']:.0f} s")
    if len(results) == 2:
        print(f"e2e compile on / off, images/s: {results[1]['images_per_s'] / results[0]['images_per_s']:.2f}x")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        Path(args.out, "e2e.json").write_text(json.dumps(results, indent=1))
    return 0 if len(results) == 2 else 1


if __name__ == "__main__":
    sys.exit(main())
