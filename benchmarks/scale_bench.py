"""Per-rank cost of the real code paths at fractions of the paper's scale, fitted and extrapolated.

    python benchmarks/scale_bench.py [--scales 0.001,0.01,0.1] [--work scale-out] [--json FILE]

The paper's scale: 300M samples in 30,000 shards of 10,000, 512 ranks (64 nodes x 8), ViT-H/14.
Each step runs in its own process at each scale (a fraction of the samples, shards and inputs;
the rank count stays 512, so a rank's share shrinks with the scale): its seconds, and its peak
resident memory above what the process held before the step (ru_maxrss after minus before). A
power law fitted through the scales (log-log least squares) extrapolates each figure to scale 1,
which is printed beside the issue's target, met or not. Where a step is cheap enough it also runs
at scale 1 (--full), and that measurement replaces the extrapolation.

Steps (the project's own functions, on synthetic inputs):
- index: one rank's start: dataset.json of every shard, then the index files of the shards its
  partition reads (each shard entry names one shared 10,000-sample .idx file, so disk stays small;
  every file is still read and parsed per shard). Also the index GETs of a node (its 8 ranks).
- order: the epoch order of one rank's partition (EpochOrder), for two epochs.
- subset: a 30% subset of the dataset, then that rank's order and index within it.
- node: when the node's 8 ranks next read each shard (shard_uses): the node cache's eviction input.
- cache: cache_footprint for 3.3 GB shards, 8 ranks, a 64 GB bound (a rule, not a measurement).
- weights: ViT-H/14's consolidated fp32 weights (scale x 2.4 GB) from rank 0 to 4 gloo CPU ranks,
  tensor by tensor (eval, fine-tune init) beside the old all_gather_object of every rank's copy.
- plan, slice, dedup: the sharder at scale x 14M inputs (a JSONL manifest of made-up paths):
  the planning task lists, plans and writes one plan slice per part of 10,000 inputs; another task
  loads only its slice; --dedup's digests with a bounded pool (content hashed from the names).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.common import FORK_HELP, preload, rss_mb, run_child  # noqa: E402
from benchmarks.scale_url_list import array_plan_figures, prepare, step_bucket, step_share  # noqa: E402

PAPER = {"samples": 300_000_000, "shards": 30_000, "ranks": 512, "ranks_per_node": 8}
SHARD_SAMPLES = PAPER["samples"] // PAPER["shards"]
VIT_H_FP32_MB = 632e6 * 4 / 2**20  # the consolidated fp32 weights of ViT-H/14
LARGEST_TENSOR_MB = 1280 * 5120 * 4 / 2**20  # its largest: an MLP's fc1 weight, 25 MB
RANK = 7  # the rank measured: any rank of the 512 costs the same
TARGETS = {  # step -> {figure: (limit, unit)} at the paper's scale, per rank
    "index": {"seconds": 30, "peak_mb": 1000, "node_index_gets": 500},
    "order": {"seconds": 1, "peak_mb": 50},
    "subset": {"seconds": 1, "peak_mb": 50},
    "node": {"seconds": 1, "peak_mb": 50},
    # The sharder's, at 14M inputs: the planning task's peak; any other task's load of its slice.
    "plan": {"peak_mb": 4000},
    "slice": {"seconds": 2, "peak_mb": 50},
    "dedup": {"peak_mb": 4000},
    # A receiving rank holds its model and one tensor in flight (16 MB here): its peak above that
    # one tensor, and gloo's and Python's buffers (a few MB), under ViT-H/14's largest tensor.
    "weights": {"peak_mb": LARGEST_TENSOR_MB},
}


def synthetic_dataset(folder: Path, scale: float) -> Path:
    """dataset.json for scale x 30,000 shards of 10,000 samples, every shard's index one shared file."""
    from vitforge.shards.manifest import FORMAT, FORMAT_VERSION

    folder.mkdir(parents=True, exist_ok=True)
    shards = max(1, round(PAPER["shards"] * scale))
    if (folder / "dataset.json").exists():
        return folder
    lines = ["v1.2 %d" % SHARD_SAMPLES]
    for i in range(SHARD_SAMPLES):
        at = 512 + i * 113_152
        lines.append(f"jpg {at} 110000 {i:09d}.jpg cls {at + 110_592} 3 {i:09d}.cls json {at + 111_616} 280 "
                     f"{i:09d}.json")
    (folder / "shared.idx").write_text("\n".join(lines) + "\n")
    manifest = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "classes": [str(c) for c in range(1000)],
        "num_classes": 1000, "parameters": {}, "totals": {"samples": shards * SHARD_SAMPLES, "shards": shards},
        "shards": [{"name": f"train-{s:06d}.tar", "index": "shared.idx", "samples": SHARD_SAMPLES,
                    "bytes": SHARD_SAMPLES * 113_152 + 1024, "sha256": "0" * 64, "index_sha256": "0" * 64}
                   for s in range(shards)],
    }
    (folder / "dataset.json").write_text(json.dumps(manifest))
    return folder


def rank_slice(num_samples: int, rank: int = RANK):
    from vitforge.pipeline.order import RankSlice

    return RankSlice(num_samples, 0, rank, PAPER["ranks"], 256, "drop", 1, PAPER["ranks"], PAPER["ranks_per_node"])


def step_index(work: Path, scale: float) -> dict:
    from vitforge.pipeline import LoaderSpec, load_index
    from vitforge.pipeline.order import partition_shards_of
    from vitforge.pipeline.reader import rank_order

    folder = synthetic_dataset(work / f"dataset-{scale:g}", scale)
    before, start = rss_mb(), time.perf_counter()
    index = load_index(str(folder))
    spec = LoaderSpec(str(folder), batch_size=256, image_size=224)
    rank_order(index, spec, 0, rank_slice(len(index)))
    seconds, peak = time.perf_counter() - start, rss_mb() - before
    node = rank_slice(len(index))
    shards = set()
    for r in node.node_ranks():
        parts = rank_slice(len(index), r).partitions_read()
        shards |= set(partition_shards_of(index.shard_samples, spec.seed, PAPER["ranks"], parts).tolist())
    return {"seconds": seconds, "peak_mb": peak, "rank_index_gets": len(index.loaded),
            "node_index_gets": len(shards), "samples_held": int(sum(len(s.start) for s in index.loaded.values()))}


def _counts(scale: float):
    import numpy as np

    return np.full(max(1, round(PAPER["shards"] * scale)), SHARD_SAMPLES, np.int64)


def step_order(work: Path, scale: float) -> dict:
    from vitforge.pipeline.order import EpochOrder

    counts = _counts(scale)
    part = rank_slice(int(counts.sum())).partitions_read()
    before, start = rss_mb(), time.perf_counter()
    for epoch in range(2):
        order = EpochOrder(counts, 0, epoch, 16384, PAPER["ranks"], part)
    return {"seconds": (time.perf_counter() - start) / 2, "peak_mb": rss_mb() - before,
            "samples_held": order.samples}


def step_subset(work: Path, scale: float) -> dict:
    from vitforge.pipeline import LoaderSpec, load_index
    from vitforge.pipeline.order import EpochOrder, partition_shards_of

    folder = synthetic_dataset(work / f"dataset-{scale:g}", scale)
    index = load_index(str(folder))
    before, start = rss_mb(), time.perf_counter()
    subset = index.with_subset(0.3, 0)
    spec = LoaderSpec(str(folder), batch_size=256, image_size=224, subset=0.3)
    order_start = time.perf_counter()
    order = EpochOrder(subset.shard_samples, spec.seed, 0, spec.shuffle_window, PAPER["ranks"],
                       rank_slice(len(subset)).partitions_read())
    choose = order_start - start
    order_s = time.perf_counter() - order_start
    peak = rss_mb() - before
    # Then the rank loads its shards' index files (the index step's cost) and picks its rows in them.
    load_start = time.perf_counter()
    subset.load(partition_shards_of(subset.shard_samples, spec.seed, PAPER["ranks"],
                                    rank_slice(len(subset)).partitions_read()))
    return {"seconds": choose + order_s, "peak_mb": peak, "choose_s": choose, "order_s": order_s,
            "load_and_pick_s": time.perf_counter() - load_start, "load_peak_mb": rss_mb() - before,
            "samples": len(subset), "samples_held": order.samples}


def step_node(work: Path, scale: float) -> dict:
    import numpy as np

    from vitforge.pipeline.order import shard_uses

    counts = _counts(scale)
    node = rank_slice(int(counts.sum()))
    before, start = rss_mb(), time.perf_counter()
    parts = np.unique(np.concatenate([rank_slice(int(counts.sum()), r).partitions_read() for r in node.node_ranks()]))
    uses = shard_uses(counts, 0, 0, 16384, PAPER["ranks"], parts)
    return {"seconds": time.perf_counter() - start, "peak_mb": rss_mb() - before, "shards": len(uses)}


SHARDER_INPUTS = 14_000_000  # the sharder scale: an ImageNet-21k-sized corpus


def _manifest_job(work: Path, scale: float):
    """A JSONL manifest of scale x 14M made-up inputs (nothing on disk: the planner only lists them)."""
    from vitforge.shards import ShardJob

    n = max(1000, round(SHARDER_INPUTS * scale))
    folder = work / f"corpus-{scale:g}"
    folder.mkdir(parents=True, exist_ok=True)
    manifest = folder / "manifest.jsonl"
    if not manifest.exists():
        with open(manifest, "w") as f:
            for i in range(n):
                f.write(json.dumps({"path": f"img/n{i % 1000:08d}/n{i % 1000:08d}_{i:09d}.JPEG", "label": i % 1000})
                        + "\n")
    parts = max(1, n // 10_000)
    return ShardJob(src=str(manifest), dest=str(folder / "shards"), shard_samples=10_000, shard_bytes=None,
                    num_parts=parts), n, parts


def step_plan(work: Path, scale: float) -> dict:
    """One array task lists the manifest, plans, and writes one slice per part (ensure_plan)."""
    import shutil

    from vitforge.shards import ensure_plan

    job, n, parts = _manifest_job(work, scale)
    shutil.rmtree(job.dest, ignore_errors=True)
    before, start = rss_mb(), time.perf_counter()
    ensure_plan(job)
    return {"seconds": time.perf_counter() - start, "peak_mb": rss_mb() - before, "inputs": n, "slices": parts}


def step_slice(work: Path, scale: float) -> dict:
    """Another task loads only the slice of its part (after step_plan wrote them)."""
    from vitforge.core import open_store
    from vitforge.shards.plan_slices import load_slice, read_header

    job, n, parts = _manifest_job(work, scale)
    store = open_store(job.dest)
    before, start = rss_mb(), time.perf_counter()
    header = read_header(store)
    items = load_slice(store, header, parts // 2, parts)
    return {"seconds": time.perf_counter() - start, "peak_mb": rss_mb() - before,
            "items": sum(len(v) for v in items.values())}


def step_dedup(work: Path, scale: float) -> dict:
    """--dedup over scale x 14M inputs (their content hashed from their names: no disk reads)."""
    from vitforge.shards.plan import deduplicate, synthetic_inputs

    inputs = synthetic_inputs(max(1000, round(SHARDER_INPUTS * scale)))
    before, start = rss_mb(), time.perf_counter()
    duplicates = deduplicate(inputs, 8, read=lambda source: source.encode())
    return {"seconds": time.perf_counter() - start, "peak_mb": rss_mb() - before, "inputs": len(inputs),
            "duplicates": len(duplicates)}


def step_weights(work: Path, scale: float) -> dict:
    """Consolidated weights on rank 0 reaching 4 CPU ranks, as eval and fine-tune init move them:
    tensor by tensor now, one all_gather_object of every rank's copy before (fine-tune init). Peak
    per rank above what it held, the largest of the ranks that receive (rank 0 holds the state)."""
    from benchmarks.weights_bench import measure_weight_move

    state_mb = VIT_H_FP32_MB * scale
    if scale >= 1:  # the whole model: 2 ranks (a receiver's peak does not depend on their number), new path only
        new = measure_weight_move(state_mb, 2, "tensor_by_tensor")
        return {"seconds": new["seconds"], "peak_mb": float(max(new["peak_extra_mb"][1:])), "state_mb": state_mb,
                "ranks": 2}
    new = measure_weight_move(state_mb, 4, "tensor_by_tensor")
    old = measure_weight_move(state_mb, 4, "all_gather_object")
    return {"seconds": new["seconds"], "peak_mb": float(max(new["peak_extra_mb"][1:])), "state_mb": state_mb,
            "ranks": 4, "old_seconds": old["seconds"], "old_peak_mb": float(max(old["peak_extra_mb"][1:]))}


STEPS = {"index": step_index, "order": step_order, "subset": step_subset, "node": step_node, "plan": step_plan,
         "slice": step_slice, "dedup": step_dedup, "share": step_share, "bucket": step_bucket,
         "weights": step_weights}


def measure(step: str, work: Path, scale: float, fork: bool) -> dict:
    """One step at one scale, in a process of its own."""
    # Freed buffers go back to the system at once (glibc keeps up to 32 MB of them otherwise), so
    # every path's peak is what it holds, not what the allocator kept: the same for old and new.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(2**20)}
    if step in ("share", "bucket"):
        run_child([sys.executable, __file__, "--prepare", step, "--scale", repr(scale), "--work", str(work)], env=env,
                  fork=fork)
    result = run_child([sys.executable, __file__, "--one", step, "--scale", repr(scale), "--work", str(work)], env=env,
                       fork=fork)
    return json.loads(result.stdout.strip().splitlines()[-1])


def fit(scales: list[float], values: list[float]) -> float:
    """A power law through (scale, value), least squares in log-log, evaluated at scale 1."""
    points = [(math.log(s), math.log(max(v, 1e-6))) for s, v in zip(scales, values)]
    if len(points) < 2:
        return values[-1] / scales[-1]
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    slope = sum((x - mx) * (y - my) for x, y in points) / max(sum((x - mx) ** 2 for x, _ in points), 1e-12)
    return math.exp(my - slope * mx)


def cache_rule() -> dict:
    from vitforge.pipeline import cache_footprint

    shard = int(3.3e9)
    lines = {}
    for open_shards in (1, 3):
        fp = cache_footprint(shard, PAPER["ranks_per_node"], 2, int(64e9), open_shards=open_shards)
        lines[open_shards] = {"ahead": fp.ahead, "peak_gb": fp.peak_bytes / 1e9, "streams": fp.streams}
    return lines


def fork_steps() -> None:
    """--fork: what the steps import, imported here once; the weights' ranks forked too (from a
    step, itself a fork of this process), not started afresh."""
    from benchmarks import weights_bench

    preload("torch", "pyarrow.parquet", "vitforge.trainer.distributed", "vitforge.pipeline.reader",
            "vitforge.shards.array_plan")
    weights_bench.START_METHOD = "fork"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scales", default="0.001,0.01,0.1")
    parser.add_argument("--full", default="order,node,index,subset,weights",
                        help="steps also measured at scale 1 (cheap enough here)")
    parser.add_argument("--steps", default=",".join(STEPS))
    parser.add_argument("--work", default="scale-out")
    parser.add_argument("--json", help="write every figure here")
    parser.add_argument("--fork", action="store_true", help=FORK_HELP)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--prepare", help=argparse.SUPPRESS)
    parser.add_argument("--scale", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    work = Path(args.work).resolve()
    if args.fork:
        fork_steps()
    if args.one:
        print(json.dumps(STEPS[args.one](work, args.scale)))
        return
    if args.prepare:
        prepare(args.prepare, work, args.scale)
        return
    scales = [float(s) for s in args.scales.split(",")]
    full = set(filter(None, args.full.split(",")))
    report = {}
    print(f"paper scale: {PAPER['samples']:,} samples, {PAPER['shards']:,} shards, {PAPER['ranks']} ranks "
          f"({PAPER['ranks_per_node']} per node); figures per rank")
    for step in args.steps.split(","):
        runs = {s: measure(step, work, s, args.fork) for s in scales + ([1.0] if step in full else [])}
        report[step] = {"runs": {str(s): r for s, r in runs.items()}, "at_paper_scale": {}}
        print(f"{step}:")
        for s, r in runs.items():
            print(f"  scale {s:g}: " + ", ".join(f"{k} {v:,.3g}" if isinstance(v, float) else f"{k} {v:,}"
                                                 for k, v in r.items()))
        for figure, limit in TARGETS.get(step, {}).items():
            if 1.0 in runs:
                value, how = runs[1.0][figure], "measured"
            else:
                value, how = fit(scales, [runs[s][figure] for s in scales]), "extrapolated"
            met = value <= limit
            report[step]["at_paper_scale"][figure] = {"value": value, "how": how, "target": limit, "met": met}
            print(f"  {step} {figure} at paper scale ({how}) {value:,.3g}, target {limit:,.3g}: "
                  f"{value / limit:.2f}x (goal <= 1x)")
        old = [s for s in scales if "old_peak_mb" in runs[s]]
        if old:  # all_gather_object: every rank receives every rank's copy, so it grows with the ranks too
            peak = fit(old, [runs[s]["old_peak_mb"] for s in old]) * PAPER["ranks"] / runs[old[-1]]["ranks"]
            report[step]["at_paper_scale"]["old_peak_mb"] = peak
            print(f"  before (all_gather_object), extrapolated to {PAPER['ranks']} ranks: peak_mb {peak:,.3g}")
    if "share" in report and "bucket" in report:
        report["array_plan"] = array_plan_figures(report)
    report["cache"] = cache_rule()
    for open_shards, line in report["cache"].items():
        print(f"cache: 3.3 GB shards, 8 ranks x {open_shards} open + 2 ahead under 64 GB: "
              f"really ahead {line['ahead']}, "
              f"peak {line['peak_gb']:.1f} GB, {'streams from the store' if line['streams'] else 'no streaming'}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
