"""`vitforge plan`: how long, how many GPU-hours, how many decode cores, how much object-store
traffic and how often to checkpoint, for a model, a dataset and a cluster, on paper."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, fields

from vitforge.trainer import PEAK_FLOPS

from .plan import PlanInput, plan, report

HELP = {
    "model": "timm model name (or a tiny CPU one)", "image_size": "input resolution in pixels",
    "dataset_images": "images per epoch", "epochs": "epochs in the run", "nodes": "nodes",
    "gpus_per_node": "GPUs per node", "device": f"one of {', '.join(PEAK_FLOPS)}",
    "mfu": "model FLOPs utilisation reached, 0-1", "cpu_decode_ms": "CPU ms per image decoding on the CPU",
    "gpu_decode_cpu_ms": "CPU ms per image left with GPU decoding", "mean_image_bytes": "mean encoded image size",
    "shard_bytes": "target shard size",
    "read_block_bytes": "loader read size, data.read_block_mb (0: one GET per sample)",
    "checkpoint_bandwidth": "bytes/s one rank writes", "store_bandwidth": "bytes/s the store accepts in all",
    "node_mtbf_hours": "mean time between failures of one node",
    "target_lost_fraction": "largest share of the run to lose to failures",
}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="vitforge plan", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for field in fields(PlanInput):
        kind = float if field.type in ("float", float) else int if field.type in ("int", int) else str
        p.add_argument(f"--{field.name.replace('_', '-')}", type=kind, default=field.default, help=HELP[field.name])
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = vars(p.parse_args(argv))
    as_json = args.pop("json")
    inputs = PlanInput(**args)
    result = plan(inputs)
    print(json.dumps({"inputs": asdict(inputs), **result}, indent=1, default=str) if as_json
          else report(inputs, result))
    return 0
