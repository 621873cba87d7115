"""GPU trainer check: ViT-H/14, bf16, ZeRO-2 on one GPU, synthetic data already on the device.

Finds the largest micro-batch that fits (trying the candidates from large to small), then prints
images/s, MFU (model FLOPs per image x images/s / the device's dense bf16 peak) and peak memory.
Goal: MFU >= 50% (the ViT-22B paper reports 54.9% on TPUv4).

    python benchmarks/gpu_train_check.py [--candidates 256,192,128,64] [--steps 30] [--out DIR]
    python benchmarks/gpu_train_check.py --collectives [--out DIR]   # issue 18: NCCL collectives
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
sys.path.insert(0, str(REPO))

from benchmarks.common import run_child  # noqa: E402


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


def collectives(timeout: float) -> dict:
    """Issue 18: every collective of a run on the engine's device. A tiny model trained for more
    than log_every steps with one evaluation (the log line's and eval's all-reduces), saved; a
    fine-tune from it (weights broadcast tensor by tensor) and `vitforge eval` of it (the same):
    under NCCL when a GPU is there, which has no CPU tensors. Returns {stage: "ok" or why not}."""
    from vitforge.synthetic import write_class_folders

    outcome = {}
    with tempfile.TemporaryDirectory() as work:
        # A small real dataset (the synthetic source is ImageNet-sized: its evaluation would take minutes)
        write_class_folders(f"{work}/images", num_classes=10, per_class=8, size=(40, 40))
        run_child([sys.executable, "-m", "vitforge", "shard", f"{work}/images", f"{work}/shards"], cwd=REPO,
                  timeout=timeout, env={**os.environ, "PYTHONPATH": str(REPO)})
        sets = [f"data.train={work}/shards", f"data.val={work}/shards", "data.backend=torch", "data.workers=0",
                "model.name=vit_tiny_cpu", "model.image_size=32", "train.micro_batch=8", "train.global_batch=8",
                "train.log_every=2", "optimizer.warmup_steps=1", "train.precision=fp32", f"checkpoint.dir={work}"]
        base = [f"--set={item}" for item in sets]
        stages = {
            "train (log every 2 of 6 steps, eval at 6)": ["train", "tiny_cpu", *base, "--set=checkpoint.run=base",
                                                          "--set=train.steps=6", "--set=train.eval_every=6"],
            "fine-tune init (weights broadcast)": ["train", "tiny_cpu", *base, "--set=checkpoint.run=tuned",
                                                   "--set=train.steps=3", "--set=train.eval_every=3",
                                                   f"--set=checkpoint.init_from={work}/base"],
            "eval (weights broadcast)": ["eval", "tiny_cpu", f"--checkpoint={work}/base", *base],
        }
        for label, args in stages.items():
            try:
                result = subprocess.run([sys.executable, "-m", "vitforge", *args], cwd=REPO, capture_output=True,
                                        text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": str(REPO)})
                tail = result.stderr.strip().splitlines()[-2:] or ["?"]
                outcome[label] = "ok" if result.returncode == 0 else \
                    f"exit {result.returncode}: " + " | ".join(line[:200] for line in tail)
            except subprocess.TimeoutExpired:
                outcome[label] = f"timed out after {timeout:.0f} s"
            print(f"  collectives, {label}: {outcome[label]}")
            if outcome[label] != "ok":
                break
    return outcome


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--collectives", action="store_true",
                   help="only the collectives check (issue 18; runs on a CPU too, with gloo)")
    p.add_argument("--candidates", default="256,192,128,64")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--model", default="vit_huge_patch14_224", help="(a tiny one checks the script on a CPU)")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--out", default=os.environ.get("VITFORGE_GPU_OUT"))
    args = p.parse_args()
    if args.collectives:
        outcome = collectives(timeout=60)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            Path(args.out, "collectives.json").write_text(json.dumps(outcome, indent=1))
        return 0 if all(v == "ok" for v in outcome.values()) and len(outcome) == 3 else 1
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
