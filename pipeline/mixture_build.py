"""A mixture's loaders, built for one rank: one single-dataset loader per source, the node cache's
bound shared out among the sources by what each saves the node.

Per rank: one loader per source, with its share of the spec's decode workers (at least one each
when the spec has any).
"""

from __future__ import annotations

import logging
import math

import torch

from vitforge.core import is_remote

from .cache_shares import CacheDemand, node_cache_shares
from .index import DatasetError, DatasetIndex
from .loader import build_loader, dataset_index, node_shards
from .mixture import MixtureLoader, largest_remainders
from .spec import LoaderSpec, MixtureSource

log = logging.getLogger("vitforge.pipeline")


def build_mixture_loader(
    spec: LoaderSpec,
    sources: list[MixtureSource],
    rank: int = 0,
    world_size: int = 1,
    device: torch.device | str = "cpu",
    accumulation: int = 1,
    ranks_per_node: int = 1,
) -> MixtureLoader:
    """A loader of `sources` at their weights for one rank: `spec` with each source's dataset. The
    node cache's one bound (data.cache_gb) is shared out by `node_cache_shares` (most to the sources
    whose bytes are read most often); the decode workers by `_workers_of`; each source's epochs end
    by "pad" (see mixture.py's `_SourceStream`)."""
    total = sum(s.weight for s in sources)
    workers = _workers_of(spec.workers, [s.weight / total for s in sources])
    parts, indexes = [], []
    for source, source_workers in zip(sources, workers):
        parts.append(spec.model_copy(update={"dataset": source.url, "workers": source_workers, "epoch_end": "pad"}))
        try:
            indexes.append(dataset_index(parts[-1]))
        except DatasetError as e:
            raise DatasetError(f"mixture source {source.url}: {e}") from None
    demands = [
        _cache_demand(s, index, part, rank, world_size, ranks_per_node)
        for s, index, part in zip(sources, indexes, parts)
    ]
    caches = node_cache_shares(int(spec.cache_gb * 1e9), demands)
    loaders = []
    for source, part, index, cache in zip(sources, parts, indexes, caches):
        log.info("mixture source %s: node cache %.2f GB of data.cache_gb %.2f", source.url, cache / 1e9, spec.cache_gb)
        try:
            loaders.append(
                build_loader(
                    part.model_copy(update={"cache_gb": cache / 1e9}),
                    rank,
                    world_size,
                    device,
                    ranks_per_node=ranks_per_node,
                    index=index,
                )
            )
        except DatasetError as e:
            raise DatasetError(f"mixture source {source.url}: {e}") from None
    mixture = MixtureLoader(sources, loaders, spec.label_space, accumulation, spec.reweight)
    if mixture.epoch_length() == 0:
        raise DatasetError(
            f"the mixture's {mixture.num_samples} samples are fewer than one optimizer step of "
            f"{world_size} ranks x {spec.batch_size} x {accumulation}"
        )
    return mixture


def _cache_demand(
    source: MixtureSource, index: DatasetIndex, spec: LoaderSpec, rank: int, world_size: int, ranks_per_node: int
) -> CacheDemand:
    """What this rank's node asks of the cache for one source: the bytes of the shards it reads in a
    pass, and its ranks' open and read-ahead shards (at the largest of those sizes)."""
    if not any(is_remote(url) for url in index.shard_urls):
        return CacheDemand(source.weight, len(index), 0, 0)  # read in place, never through the cache
    if index.shard_bytes is None:  # tars made elsewhere: sizes unknown
        return CacheDemand(source.weight, len(index), math.inf, 0)
    sizes = [index.shard_bytes[s] for s in node_shards(index, spec, rank, world_size, ranks_per_node)]
    readers = min(ranks_per_node, world_size - rank // ranks_per_node * ranks_per_node)
    return CacheDemand(source.weight, len(index), sum(sizes), readers * (1 + spec.shards_ahead) * max(sizes))


def _workers_of(total: int, shares: list[float]) -> list[int]:
    """The spec's decode workers shared out: none when it has none (every source decodes in the
    rank's process), else one per source and the rest by `shares` (largest remainders, ties to the
    first). So a mixture of more sources than data.workers runs one worker per source: a source
    decoding in the training process would take the step's thread, and there, with torch's intra-op
    threads, about twice the CPU per image a worker takes (measured by loader_bench's mixture row)."""
    if total == 0:
        return [0] * len(shares)
    spare = max(0, total - len(shares))
    return [1 + n for n in largest_remainders([spare * share for share in shares], spare)]
