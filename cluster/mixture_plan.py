"""`vitforge plan --mixture IMAGES:WEIGHT ...`: what each source of a training mixture costs.

The run draws `steps x global_batch` samples; source s gives weight_s / sum(weights) of them
(pipeline/mixture.py holds every batch to that within a few samples). Each source cycles its own
epochs through its own loader, so it is read `taken_s / images_s` times over (its passes). The node
cache is shared out as the loader shares it (pipeline's node_cache_shares: working sets first, then
the sources read most often per byte). A source's first pass is fetched whole; each later pass
fetches again what its share does not keep: nothing when the share holds all the node reads of it,
else all but (share - working set) / what the node reads (an estimate: each pass is reshuffled, and
the cache keeps what the next pass needs soonest). One node reads each shard (the loader's
partitions), so the egress is the fetches of every node. Not counted: the few shards the last
batch of a pass opens for its padding (the loader counts them: pipeline's node_shards).
"""

from __future__ import annotations

import math

from vitforge.core import UsageError
from vitforge.pipeline import CacheDemand, node_cache_shares

from .planner import PlanInput
from .planner_formulas import shards_per_node


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
    shards = [math.ceil(images * inputs.mean_image_bytes / inputs.shard_bytes) for images, _ in sources]
    per_node = [shards_per_node(n, inputs.nodes) * inputs.shard_bytes for n in shards]
    working = inputs.gpus_per_node * (1 + inputs.shards_ahead) * inputs.shard_bytes
    caches = node_cache_shares(
        int(inputs.cache_limit_bytes),
        [CacheDemand(weight, images, node, working) for (images, weight), node in zip(sources, per_node)],
    )
    figures = []
    for (images, weight), n, node, cache in zip(sources, shards, per_node, caches):
        share = weight / total
        taken = samples * share
        passes = taken / images
        kept = 1.0 if cache >= node else max(0, cache - working) / node
        fetched = min(passes, 1) + max(0.0, passes - 1) * (1 - kept)  # passes' worth of bytes fetched
        # the step whose batch takes the source's last unseen sample (its batches hold share x
        # global_batch within a few samples): train.steps for a run that stops when it runs out
        first_pass_step = math.ceil(images / (share * inputs.global_batch))
        figures.append(
            {
                "images": images,
                "weight": weight,
                "share": share,
                "samples": taken,
                "passes": passes,
                "first_pass_step": first_pass_step,
                "shards": n,
                "egress_bytes": fetched * images * inputs.mean_image_bytes,
                "egress_bytes_per_node": fetched * node,
                "cache_bytes_per_node": cache,
                "cache_kept_fraction": kept,
            }
        )
    return figures


def mixture_report(figures: list[dict]) -> list[str]:
    lines = ["  mixture: each source read through its own loader, its epochs its own:"]
    for i, f in enumerate(figures):
        lines.append(
            f"    source {i}: {f['images']:,} images at weight {f['weight']:g} ({f['share']:.1%} of every "
            f"batch): {f['samples']:,.0f} samples drawn, {f['passes']:,.2f} passes over it (the first "
            f"ends at step {f['first_pass_step']:,}); "
            f"{f['shards']:,} shards; egress {f['egress_bytes'] / 1e12:,.2f} TB in the run, at most "
            f"{f['egress_bytes_per_node'] / 1e9:,.1f} GB per node; "
            f"node cache {f['cache_bytes_per_node'] / 1e9:,.1f} GB "
            f"(keeps {f['cache_kept_fraction']:.0%} of what the node reads of it between passes)"
        )
    return lines
