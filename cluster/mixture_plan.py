"""`vitforge plan --mixture IMAGES:WEIGHT ...`: what each source of a training mixture costs.

The run draws `steps x global_batch` samples; source s gives weight_s / sum(weights) of them
(pipeline/mixture.py holds every batch to that within a few samples). Each source cycles its own
epochs through its own loader, so it is read `taken_s / images_s` times over (its passes), each
pass one copy of its shards from the store (the loader's partitions: one node reads each shard);
its egress is its passes x its bytes, its node cache is its weight's share of data.cache_gb.
"""

from __future__ import annotations

import math

from vitforge.core import UsageError

from .planner import PlanInput, shards_per_node


def parse_mixture(items: list[str]) -> list[tuple[int, float]]:
    """[(images, weight)] from "IMAGES:WEIGHT" items."""
    sources = []
    for item in items:
        images, _, weight = item.partition(":")
        try:
            parsed = (int(images), float(weight))
        except ValueError:
            raise UsageError(f"--mixture {item!r}: give IMAGES:WEIGHT, e.g. 300000000:0.7") from None
        if parsed[0] < 1 or not 0 < parsed[1] < math.inf:
            raise UsageError(f"--mixture {item!r}: images must be >= 1 and the weight a number > 0")
        sources.append(parsed)
    return sources


def mixture_figures(inputs: PlanInput, result: dict, sources: list[tuple[int, float]]) -> list[dict]:
    samples = result["steps"] * inputs.global_batch
    total = sum(weight for _, weight in sources)
    figures = []
    for images, weight in sources:
        share = weight / total
        taken = samples * share
        shards = math.ceil(images * inputs.mean_image_bytes / inputs.shard_bytes)
        per_pass_node = shards_per_node(shards, inputs.nodes) * inputs.shard_bytes
        passes = taken / images
        figures.append({"images": images, "weight": weight, "share": share, "samples": taken, "passes": passes,
                        "shards": shards, "egress_bytes": passes * images * inputs.mean_image_bytes,
                        "egress_bytes_per_node": passes * per_pass_node,
                        "cache_bytes_per_node": inputs.cache_limit_bytes * share})
    return figures


def mixture_report(figures: list[dict]) -> list[str]:
    lines = ["  mixture: each source read through its own loader, its epochs its own:"]
    for i, f in enumerate(figures):
        lines.append(f"    source {i}: {f['images']:,} images at weight {f['weight']:g} ({f['share']:.1%} of every "
                     f"batch): {f['samples']:,.0f} samples drawn, {f['passes']:,.2f} passes over it; "
                     f"{f['shards']:,} shards; egress {f['egress_bytes'] / 1e12:,.2f} TB in the run, at most "
                     f"{f['egress_bytes_per_node'] / 1e9:,.1f} GB per node; node cache {f['cache_bytes_per_node'] / 1e9:,.1f} GB")
    return lines
