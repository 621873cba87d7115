"""Overhead of the diagnostics on the training step: the tiny recipe's step time with each one on,
side by side with everything off, in one run.

    python benchmarks/tracking_bench.py [--steps 300] [--warmup 60] [--rounds 3] [--nproc 2]

Variants: all off (train.watchdog false, no tracker, train.straggler_every null); the hang watchdog;
straggler exchanges at their default interval (100 steps); MLflow (a real `mlflow server` on
127.0.0.1, testing/local_mlflow.py); W&B offline; a profiler window (steps 10-12, inside the
warm-up: the timed steps are the ones outside it). Each is `vitforge train tiny_cpu` on synthetic
data under torchrun (one rank: a plain process, as train_bench starts it; gloo on the CPU, ZeRO-2,
fp32); its step time is the global batch over the images/s of each metrics window after the
warm-up, the median over every window of every round.
The variants alternate within each round, each round starting at another one, so a drift of the
machine falls on all of them; "runs" lists each run's median: the noise to read the ratios against.
CPU: seconds of the whole process tree (torchrun, the ranks, the tracker's threads and children)
per 100 steps, start-up included. Each tracker's run is checked to exist (MLflow on the server,
W&B's offline folder, the trace files), so a variant that recorded nothing is not measured as free.
Goal: each variant's median step time within 1% of all off.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.common import FORK_HELP, preload, run_child  # noqa: E402
from benchmarks.train_bench import ENV, RANK_MODULES, on_ranks  # noqa: E402
from vitforge.testing.local_mlflow import start_local_mlflow  # noqa: E402

OFF = ["train.watchdog=false", "train.straggler_every=null"]
VARIANTS = {  # name: (overrides on top of the common ones, extra environment)
    "all off": (OFF, {}),
    "watchdog": (["train.watchdog=true", "train.straggler_every=null"], {}),
    "stragglers (every 100)": (["train.watchdog=false", "train.straggler_every=100"], {}),
    "MLflow": ([*OFF, "tracking.mlflow={}"], {}),
    "W&B offline": ([*OFF, "tracking.wandb={mode: offline}"], {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}),
    "profiler window, steps outside it": ([*OFF, "train.profile_steps=[10, 12]"], {}),
}


def run_variant(name: str, args, work: str, env: dict) -> dict:
    """One `vitforge train`: its step times after the warm-up and its process tree's CPU seconds."""
    overrides, extra = VARIANTS[name]
    run = f"{re.sub('[^a-z]+', '-', name.lower()).strip('-')}-{time.monotonic_ns()}"
    sets = ["data.train=synthetic", "model.num_classes=10", "checkpoint.save=false", f"checkpoint.dir={work}",
            f"checkpoint.run={run}", f"train.steps={args.steps}", f"train.log_every={args.log_every}",
            "train.eval_every=1000000", f"train.global_batch={16 * args.nproc}", "train.micro_batch=16",
            *overrides]
    cmd, ranks = on_ranks(args.nproc, ["-m", "vitforge", "train", "tiny_cpu",
                                       *(arg for item in sets for arg in ("--set", item))])
    # The venv's ninja first on PATH, as the tests run: another ninja rebuilds DeepSpeed's op (30-40 s).
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    os.makedirs(os.path.join(work, run))  # W&B's folder too
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    run_child(cmd, env={**ENV, **env, **extra, **ranks, "WANDB_DIR": os.path.join(work, run), "PATH": path},
              cwd=REPO, fork=args.fork)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    rows = [json.loads(line) for line in Path(work, run, "metrics.jsonl").read_text().splitlines()]
    batch = 16 * args.nproc
    steps = [batch / r["images_per_s"] for r in rows if "images_per_s" in r and r["step"] > args.warmup]
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return {"step_s": steps, "cpu_s": cpu, "run": run}


def recorded(name: str, run: dict, work: str, mlflow) -> bool | None:
    """Whether the variant left its record (None: it keeps none)."""
    if name == "MLflow":
        client = mlflow.client()
        return bool(client.search_runs([e.experiment_id for e in client.search_experiments()],
                                       filter_string=f"attributes.run_name = '{run['run']}'"))
    if name == "W&B offline":
        return bool(glob.glob(os.path.join(work, run["run"], "wandb", "offline-run-*")))
    if name.startswith("profiler"):
        return bool(glob.glob(os.path.join(work, run["run"], "profile", "*", "*.pt.trace.json")))
    return None


def start_mlflow(folder: str, meanwhile: Callable[[], object]):
    """The MLflow server, started (its own processes: about 15 s of CPU here) while `meanwhile`
    runs in this process; stopped again if `meanwhile` fails."""
    with ThreadPoolExecutor(1) as pool:  # its thread ends with the block: none is left to fork
        starting = pool.submit(start_local_mlflow, folder)
        try:
            meanwhile()
        except BaseException:
            starting.result().stop()
            raise
    return starting.result()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=60)
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--fork", action="store_true", help=FORK_HELP)
    args = p.parse_args()
    results = {name: {"step_s": [], "runs": [], "cpu_s": 0.0, "recorded": []} for name in VARIANTS}
    with tempfile.TemporaryDirectory() as work:
        # --fork: the ranks' imports and the trackers' clients, imported while the server starts
        mlflow = start_mlflow(os.path.join(work, "mlflow"),
                              lambda: preload(*RANK_MODULES, "mlflow", "wandb") if args.fork else None)
        try:
            names = list(VARIANTS)
            for round_ in range(args.rounds):
                # Each round starts at another variant: none always runs first (after the server's
                # start) or after the same neighbour.
                shift = round_ * len(names) // args.rounds
                for name in names[shift:] + names[:shift]:
                    folder = os.path.join(work, "runs")
                    run = run_variant(name, args, folder, mlflow.env)
                    results[name]["step_s"] += run["step_s"]
                    results[name]["runs"].append(statistics.median(run["step_s"]))
                    results[name]["cpu_s"] += run["cpu_s"]
                    results[name]["recorded"].append(recorded(name, run, folder, mlflow))
        finally:
            mlflow.stop()
    base = statistics.median(results["all off"]["step_s"])
    print(f"[{args.nproc} ranks, tiny_cpu (vit_tiny_cpu 32 px), synthetic data, ZeRO-2, fp32, global batch "
          f"{16 * args.nproc}; steps {args.warmup + 1}-{args.steps} of each run, {args.rounds} alternating rounds]")
    for name, got in results.items():
        median = statistics.median(got["step_s"])
        cpu = 100 * got["cpu_s"] / (args.rounds * args.steps)
        kept = [r for r in got["recorded"] if r is not None]
        notes = f"; its record written in {sum(kept)}/{len(kept)} runs" if kept else ""
        runs = "/".join(f"{1000 * m:.1f}" for m in got["runs"])
        figures = f"median step {1000 * median:.2f} ms (runs {runs}), CPU {cpu:.2f} s/100 steps"
        if name == "all off":
            print(f"{name}: {figures} (for comparison)")
        else:
            print(f"{name} overhead: {100 * (median / base - 1):+.1f}% (goal <= 1%)  [{figures}{notes}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
