"""`vitforge plan`: how long (compute and communication per ZeRO stage), how many GPU-hours, how
many decode cores, how much object-store traffic, how often to checkpoint, how long a restart takes
and how much host memory a rank needs, for a model, a dataset and a cluster, on paper."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, fields

from vitforge.trainer import PEAK_FLOPS

from .mixture_plan import mixture_figures, mixture_report, parse_mixture
from .planner import PlanInput, plan
from .planner_report import report

HELP = {
    "model": "timm model name (or a tiny CPU one)",
    "image_size": "input resolution in pixels",
    "dataset_images": "images per epoch",
    "epochs": "epochs in the run",
    "nodes": "nodes",
    "gpus_per_node": "GPUs per node",
    "device": f"one of {', '.join(PEAK_FLOPS)}",
    "mfu": "model FLOPs utilisation reached, 0-1",
    "cpu_decode_ms": "CPU ms per image decoding on the CPU",
    "gpu_decode_cpu_ms": "CPU ms per image left with GPU decoding",
    "mean_image_bytes": "mean encoded image size",
    "shard_bytes": "target shard size",
    "read_block_bytes": "loader read size, data.read_block_mb (0: one GET per sample)",
    "checkpoint_bandwidth": "bytes/s one rank writes",
    "store_bandwidth": "bytes/s the store accepts in all",
    "node_mtbf_hours": "mean time between failures of one node",
    "target_lost_fraction": "largest share of the run to lose to failures",
    "global_batch": "images per optimizer step",
    "micro_batch": "images per GPU per forward pass",
    "nvlink_bandwidth": "bytes/s per GPU within a node",
    "network_bandwidth": "bytes/s per node between nodes",
    "comm_overlap": "share of the communication hidden behind compute, 0-1",
    "node_read_bandwidth": "bytes/s one node reads from the store",
    "warmup_s": "seconds from process start to the first step (NCCL init, compile)",
    "index_bytes_per_sample": "host bytes per sample of the loader's index",
    "cache_limit_bytes": "node cache bound (data.cache_gb)",
    "shards_ahead": "shards each reader fetches ahead",
    "offload_optimizer": "DeepSpeed CPU optimizer offload (fp32 master and Adam on the host)",
    "node_ram_bytes": "host memory per node",
}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="vitforge plan", description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    for field in fields(PlanInput):
        flag = f"--{field.name.replace('_', '-')}"
        if field.type in ("bool", bool):
            p.add_argument(flag, action="store_true", help=HELP[field.name])
            continue
        kind = float if field.type in ("float", float) else int if field.type in ("int", int) else str
        p.add_argument(flag, type=kind, default=field.default, help=HELP[field.name])
    p.add_argument(
        "--mixture",
        nargs="+",
        metavar="IMAGES:WEIGHT",
        help="train on a mixture of these sources (data.train a list): each one's samples, passes, "
        "egress and node cache; --dataset-images becomes their sum",
    )
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = vars(p.parse_args(argv))
    as_json, mixture = args.pop("json"), args.pop("mixture")
    sources = parse_mixture(mixture) if mixture else []
    if sources:
        args["dataset_images"] = sum(images for images, _ in sources)
    inputs = PlanInput(**args)
    result = plan(inputs)
    if sources:
        result["mixture"] = mixture_figures(inputs, result, sources)
    text = report(inputs, result) + ("\n" + "\n".join(mixture_report(result["mixture"])) if sources else "")
    print(json.dumps({"inputs": asdict(inputs), **result}, indent=1, default=str) if as_json else text)
    return 0
