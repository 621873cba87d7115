"""GPU trainer check: ViT-H/14, bf16, ZeRO-2 on one GPU, synthetic data already on the device.

Finds the largest micro-batch that fits (trying the candidates from large to small), then prints
images/s, MFU (model FLOPs per image x images/s / the device's dense bf16 peak) and peak memory.
Goal: MFU >= 50% (the ViT-22B paper reports 54.9% on TPUv4).

    python benchmarks/gpu_train_check.py [--candidates 256,192,128,64] [--steps 30] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_recipe(sets: list[str], work: str, run_name: str, timeout: float, label: str) -> tuple[list[dict], str] | None:
    """`vitforge train vit_h14_pretrain` with these overrides, checkpoints off, its metrics in
    WORK/RUN_NAME: (the training log lines, its stderr); None, after saying why, when it timed
    out or failed."""
    cmd = [sys.executable, "-m", "vitforge", "train", str(REPO / "trainer" / "recipes" / "vit_h14_pretrain.yaml")]
    for item in [*sets, f"checkpoint.dir={work}", f"checkpoint.run={run_name}", "checkpoint.save=false"]:
        cmd += ["--set", item]
    try:
        result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                                env={**os.environ, "PYTHONPATH": str(REPO)})
    except subprocess.TimeoutExpired:
        print(f"  {label}: timed out after {timeout:.0f} s")
        return None
    metrics_file = Path(work, run_name, "metrics.jsonl")
    if result.returncode != 0 or not metrics_file.exists():
        tail = result.stderr.strip().splitlines()[-3:] or ["?"]
        print(f"  {label}: failed: " + " | ".join(line[:200] for line in tail))
        return None
    logged = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    return [m for m in logged if "loss" in m], result.stderr


def attempt(model: str, image_size: int, micro: int, steps: int, checkpointing: bool) -> dict | None:
    sets = ["data.train=synthetic", f"model.name={model}", "model.num_classes=1000",
            f"model.image_size={image_size}", f"model.grad_checkpointing={str(checkpointing).lower()}",
            f"train.steps={steps}", "train.log_every=10", f"train.micro_batch={micro}", f"train.global_batch={micro}",
            "train.zero_stage=2", "train.precision=bf16", "optimizer.warmup_steps=1", "data.val=null"]
    with tempfile.TemporaryDirectory() as tmp:
        ran = run_recipe(sets, tmp, "h14", 200, f"micro-batch {micro}")
    if ran is None:
        return None
    logged = ran[0]
    last = logged[-1]  # the first window includes warm-up
    return {"micro_batch": micro, "grad_checkpointing": checkpointing, "images_per_s": last["images_per_s"],
            "mfu": last["mfu"], "peak_memory_gb": max(m["memory_gb"] for m in logged)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--candidates", default="256,192,128,64")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--model", default="vit_huge_patch14_224", help="(a tiny one checks the script on a CPU)")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--out", default=os.environ.get("VITFORGE_GPU_OUT"))
    args = p.parse_args()
    best = None
    for micro in (int(c) for c in args.candidates.split(",")):
        best = attempt(args.model, args.image_size, micro, args.steps, checkpointing=False)
        if best:
            break
    if best is None:
        best = attempt(args.model, args.image_size, 64, args.steps, checkpointing=True)
    if best is None:
        print("trainer (ViT-H/14 bf16 ZeRO-2): no micro-batch fitted")
        return 1
    mfu = f"{best['mfu']:.1%}" if best["mfu"] is not None else "unknown (device not in the peak table)"
    print(f"trainer {args.model} bf16 ZeRO-2, 1 device, synthetic data: micro-batch {best['micro_batch']} "
          f"(activation checkpointing {'on' if best['grad_checkpointing'] else 'off'}), "
          f"{best['images_per_s']:.0f} images/s, MFU {mfu} (goal >= 50%), peak memory {best['peak_memory_gb']:.1f} GiB")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        Path(args.out, "trainer.json").write_text(json.dumps(best, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
