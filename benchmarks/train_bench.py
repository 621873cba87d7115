"""Overhead of our training loop against a bare DeepSpeed loop: same tiny ViT, synthetic data, one run.

    python benchmarks/train_bench.py [--steps 200] [--nproc 2]

Both run under torchrun with gloo on the CPU, ZeRO-2, fp32, micro-batch 32, and are timed over
the same steps after the same warm-up (one rank: a plain process, as torchrun would start it).
Goal: ours at most 5% slower.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.common import FORK_HELP, preload, run_child  # noqa: E402

ENV = {**os.environ, "TORCH_EXTENSIONS_DIR": str(REPO / ".venv" / "torch_extensions"), "OMP_NUM_THREADS": "1",
       "PYTHONPATH": str(REPO)}

BARE = r'''
import json, sys, time, torch, deepspeed, torch.distributed as dist
from vitforge.trainer.model import build_model, weight_decay_groups
steps, warmup, micro = int(sys.argv[1]), int(sys.argv[2]), 32
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
model = build_model("vit_small_cpu", 1000, 32)
config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
          "zero_optimization": {"stage": 2}, "steps_per_print": 2**31 - 1}
# The same optimizer as ours (AdamW, no decay on norms/biases/embeddings): what differs is the loop.
optimizer = torch.optim.AdamW(weight_decay_groups(model, 0.1), lr=1e-4)
engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
images, labels = torch.randn(micro, 3, 32, 32), torch.randint(0, 1000, (micro,))
for step in range(steps):
    if step == warmup:
        dist.barrier(); start = time.perf_counter()
    loss = torch.nn.functional.cross_entropy(engine(images), labels)
    engine.backward(loss); engine.step()
dist.barrier()
if dist.get_rank() == 0:
    print(json.dumps({"images_per_s": (steps - warmup) * micro * dist.get_world_size() / (time.perf_counter() - start)}))
dist.destroy_process_group()
'''


# What a rank imports: with --fork, imported once by the benchmark's own process. DeepSpeed's muon
# optimizer (imported by deepspeed.initialize's optimizer check) applies torch.compile as it is
# imported, which imports torch's inductor: 2.5 s of CPU in every rank here.
RANK_MODULES = ("torch", "deepspeed", "timm", "deepspeed.runtime.zero.muon.muon_optimizer", "torch.utils.tensorboard",
                "vitforge.cli", "vitforge.trainer.cli", "vitforge.trainer.entry")


def _port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def on_ranks(nproc: int, argv: list[str]) -> tuple[list[str], dict]:
    """The command and environment that run `python *argv` on `nproc` ranks of one node: torchrun,
    or for one rank the rank alone, with the variables torchrun would give it (torchrun's agent is
    a process that imports torch, and its rank's collectives need no agent)."""
    if nproc > 1:
        return ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
                 _port(), "--no-python", sys.executable, *argv], {})
    return [sys.executable, *argv], {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": _port()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--fork", action="store_true", help=FORK_HELP)
    args = p.parse_args()
    if args.fork:
        preload(*RANK_MODULES)
    cmd, env = on_ranks(args.nproc, ["-c", BARE, str(args.steps), str(args.warmup)])
    bare = run_child(cmd, env={**ENV, **env}, cwd=REPO, fork=args.fork)
    bare_rate = json.loads(bare.stdout.strip().splitlines()[-1])["images_per_s"]
    with tempfile.TemporaryDirectory() as tmp:
        sets = ["data.train=synthetic", "model.name=vit_small_cpu", "model.num_classes=1000", "model.image_size=32",
                f"train.steps={args.steps}", f"train.log_every={args.warmup}", "checkpoint.save=false",
                "train.micro_batch=32", f"train.global_batch={32 * args.nproc}", "train.zero_stage=2",
                "train.precision=fp32", "optimizer.warmup_steps=1", f"checkpoint.dir={tmp}", "checkpoint.run=bench"]
        cmd, env = on_ranks(args.nproc, ["-m", "vitforge", "train", "tiny_cpu",
                                          *(arg for item in sets for arg in ("--set", item))])
        run_child(cmd, env={**ENV, **env}, cwd=REPO, fork=args.fork)
        logged = [json.loads(line) for line in Path(tmp, "bench", "metrics.jsonl").read_text().splitlines()]
    windows = [m for m in logged if m["step"] > args.warmup]  # the same steps the bare loop times
    ours = len(windows) / sum(1 / m["images_per_s"] for m in windows)  # harmonic mean of equal windows
    print(f"bare DeepSpeed loop        {bare_rate:8.0f} images/s")
    print(f"vitforge train (synthetic) {ours:8.0f} images/s")
    print(f"overhead: {100 * (bare_rate / ours - 1):+.1f}% (goal <= 5%)  [{args.nproc} ranks, ZeRO-2, fp32, "
          f"vit_small_cpu 32 px, micro-batch 32, steps {args.warmup + 1}-{args.steps}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
