"""The capacity planner's closed formulas (`vitforge plan`): throughput, checkpoint sizes and
intervals, communication per ZeRO stage, restart time and host memory.

Every figure is a closed formula of its arguments, written in the docstring of the function that
computes it, so a reader can redo any line by hand (tests/unit/test_cluster_planner.py does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# DeepSpeed's ZeRO defaults: gradients are reduced and weights gathered in buckets of
# reduce_bucket_size = allgather_bucket_size = 5e8 elements; ZeRO-3 gathers the parameters ahead
# of use in coalesced all-gathers of stage3_prefetch_bucket_size = 5e7 elements.
BUCKET_ELEMENTS = 500_000_000
PREFETCH_ELEMENTS = 50_000_000
# NCCL's own tuning model for its ring algorithm, Simple protocol (an older NCCL release's
# constants; newer ones differ somewhat): a base per collective plus one hop latency per ring
# step, by the link the step crosses.
RING_BASE_S, NVLINK_HOP_S, NETWORK_HOP_S = 8.4e-6, 3.4e-6, 9.6e-6
BF16, FP32 = 2, 4  # bytes per element


@dataclass(frozen=True)
class ModelFacts:
    flops_per_image: float  # training FLOPs per image
    parameters: int
    largest_tensor: int  # elements of the largest parameter tensor


def throughput(flops_per_image: float, peak: float, mfu: float) -> float:
    """Images/s per GPU = mfu x peak FLOP/s / training FLOPs per image."""
    return mfu * peak / flops_per_image


def checkpoint_bytes_per_rank(parameters: int, stage: int, ranks: int) -> tuple[float, float]:
    """(bytes the busiest rank writes, bytes the whole job writes) for bf16 training with an fp32
    master copy and Adam: weights 2 bytes per parameter, optimizer state 12 (master 4 + m 4 + v 4).
    ZeRO-0 (plain data parallel): rank 0 writes all 14P. ZeRO-1/2: each rank writes 12P/N of
    optimizer state, and rank 0 also the 2P weights. ZeRO-3: each rank writes (2P + 12P)/N."""
    weights, optimizer = 2.0 * parameters, 12.0 * parameters
    if stage == 0:
        return weights + optimizer, weights + optimizer
    if stage in (1, 2):
        return weights + optimizer / ranks, weights + optimizer
    return (weights + optimizer) / ranks, weights + optimizer


def write_seconds(
    busiest_rank_bytes: float, total_bytes: float, rank_bandwidth: float, store_bandwidth: float
) -> float:
    """The slower of the busiest rank's own write and the store taking the whole checkpoint:
    max(busiest / rank bandwidth, total / store bandwidth)."""
    return max(busiest_rank_bytes / rank_bandwidth, total_bytes / store_bandwidth)


def young_daly_interval(checkpoint_s: float, job_mtbf_s: float) -> float:
    """Young's optimal interval between checkpoints: tau = sqrt(2 C M), C the checkpoint cost and
    M the job's mean time between failures (first order; Daly's refinement differs when C ~ M).
    The restart time R costs R / M of the run whatever the interval, so it leaves tau unchanged
    (in Daly's model too) and enters lost_fraction and intervals_within instead."""
    return math.sqrt(2 * checkpoint_s * job_mtbf_s)


def lost_fraction(interval_s: float, checkpoint_s: float, job_mtbf_s: float, restart_s: float = 0.0) -> float:
    """Expected share of the run lost, to first order: C / tau for writing checkpoints plus
    (tau / 2 + R) / M per failure: the work redone (on average half an interval) and the restart R."""
    return checkpoint_s / interval_s + (interval_s / 2 + restart_s) / job_mtbf_s


def intervals_within(
    target: float, checkpoint_s: float, job_mtbf_s: float, restart_s: float = 0.0
) -> tuple[float, float] | None:
    """The range of intervals tau with lost_fraction(tau) <= target: the roots of
    tau^2 / (2M) - t tau + C = 0 with t = target - R / M (the restarts' share, which no interval
    changes), i.e. M (t -+ sqrt(t^2 - 2C/M)); None when even Young's interval loses more than the
    target (t^2 < 2C/M, or t <= 0)."""
    share = target - restart_s / job_mtbf_s
    discriminant = share**2 - 2 * checkpoint_s / job_mtbf_s
    if share <= 0 or discriminant < 0:
        return None
    root = math.sqrt(discriminant)
    return job_mtbf_s * (share - root), job_mtbf_s * (share + root)


def accumulation(global_batch: int, micro_batch: int, ranks: int) -> int:
    """Micro-steps per optimizer step: a = max(1, ceil(global batch / (micro batch x N)))."""
    return max(1, math.ceil(global_batch / (micro_batch * ranks)))


def ring_passes(stage: int, micro_steps: int) -> int:
    """Ring passes per optimizer step, a pass being one all-gather or one reduce-scatter of the bf16
    model (an all-reduce is two), with a micro-steps per step:
    ZeRO-0: all-reduce of the gradients at the accumulation boundary: 2.
    ZeRO-1: reduce-scatter of the gradients at the boundary, all-gather of the updated weights: 2.
    ZeRO-2: gradients are partitioned, so reduce-scattered at every micro-step, then the all-gather: a + 1.
    ZeRO-3: at every micro-step an all-gather for the forward, one for the backward and a
    reduce-scatter of the gradients: 3a.
    At a = 1 these are the ZeRO paper's volumes (Rajbhandari et al. 2020, sec. 7.2): 2 Psi for data
    parallelism and P_os+g, 3 Psi (1.5x) for P_os+g+p. DeepSpeed's stage 1 reduce-scatters rather than
    all-reduces, the "1.5x -> 1x of data parallelism" of its 2020 release."""
    return {0: 2, 1: 2, 2: micro_steps + 1, 3: 3 * micro_steps}[stage]


def comm_bytes_per_rank(parameters: int, stage: int, ranks: int, micro_steps: int) -> float:
    """Bytes one rank sends per optimizer step: in a ring each rank sends (N-1)/N of the buffer per
    pass, and the buffer is the bf16 model, 2P bytes: passes x (N-1)/N x 2P."""
    return ring_passes(stage, micro_steps) * (ranks - 1) / ranks * BF16 * parameters


def ring_collectives(stage: int, parameters: int, micro_steps: int) -> int:
    """Ring traversals per optimizer step (each pays the ring's latency), in DeepSpeed's buckets:
    b = ceil(P / 5e8) for reductions and the stage 1-2 all-gather, g = ceil(P / 5e7) for ZeRO-3's
    prefetched all-gathers: ZeRO-0: 2b (an all-reduce is two traversals), ZeRO-1: 2b,
    ZeRO-2: (a + 1) b, ZeRO-3: a (2g + b)."""
    buckets, gathers = math.ceil(parameters / BUCKET_ELEMENTS), math.ceil(parameters / PREFETCH_ELEMENTS)
    return {0: 2 * buckets, 1: 2 * buckets, 2: (micro_steps + 1) * buckets, 3: micro_steps * (2 * gathers + buckets)}[
        stage
    ]


def ring_latency(ranks: int, nodes: int) -> float:
    """Seconds one ring traversal of N ranks on M nodes costs before any byte counts, NCCL's model
    (Simple protocol): 8.4 us + (N - M) x 3.4 us for the steps over NVLink + (M - 1) x 9.6 us for
    those between nodes (N - 1 steps in all, M - 1 of them leave a node); 0 for one rank."""
    if ranks == 1:
        return 0.0
    return RING_BASE_S + (ranks - nodes) * NVLINK_HOP_S + (nodes - 1) * NETWORK_HOP_S


def comm_bandwidth(nodes: int, nvlink: float, network: float) -> float:
    """Bytes/s at which a rank's ring traffic moves: NVLink on one node; on several, the slower of
    NVLink and the node's network. NCCL runs one ring per NIC and 1/G of each ring's steps leave the
    node, so a node's NICs together carry as many bytes as one rank sends: min(nvlink, network per
    node), the bus bandwidth nccl-tests reports (about 400 GB/s on DGX H100 with 8 NDR NICs)."""
    return nvlink if nodes == 1 else min(nvlink, network)


def exposed_seconds(comm_s: float, compute_s: float, overlap: float) -> float:
    """Communication left on the step's critical path when a share of it runs behind compute, and
    compute can hide no more than itself: max(comm x (1 - overlap), comm - compute)."""
    return max(comm_s * (1 - overlap), comm_s - compute_s)


def restore_bytes_per_node(parameters: int, stage: int, ranks: int, ranks_per_node: int) -> float:
    """Checkpoint bytes one node downloads to resume, once for all of its G ranks (bf16 weights 2P,
    fp32 master + Adam 12P, as checkpoint_bytes_per_rank): ZeRO-0: 14P, every rank needs all of it;
    ZeRO-1/2: 2P + G x 12P / N, the weights once and each rank's optimizer shard; ZeRO-3: G x 14P / N."""
    weights, optimizer = 2.0 * parameters, 12.0 * parameters
    if stage == 0:
        return weights + optimizer
    if stage in (1, 2):
        return weights + ranks_per_node * optimizer / ranks
    return ranks_per_node * (weights + optimizer) / ranks


def node_read_bandwidth(node_link: float, store: float, nodes: int) -> float:
    """Bytes/s one node reads from the store while every node restarts at once: min(the node's
    link, the store's bandwidth / M)."""
    return min(node_link, store / nodes)


def shards_per_rank(shards: int, ranks: int) -> int:
    """Shards a rank reads (and indexes) per epoch: ceil(shards / N)."""
    return math.ceil(shards / ranks)


def shards_per_node(shards: int, nodes: int) -> int:
    """Shards one node fetches per epoch through its cache: its ranks read adjacent partitions, one
    contiguous 1/nodes of the layout, which a cut at an arbitrary sample spreads over at most one
    shard more than its share: min(shards, ceil(shards / nodes) + 1); the shards at its two ends
    are fetched by both neighbouring nodes."""
    return min(shards, math.ceil(shards / nodes) + 1)


def restart_seconds(index_bytes_per_node: float, restore_bytes: float, read_bandwidth: float, warmup_s: float) -> dict:
    """Time from a failure's requeue to the first step again: the node's ranks' shard indexes
    (G x shards per rank x images per shard x index bytes per sample) and its checkpoint share,
    each at the node's read bandwidth, plus the warm-up: index / bw + restore / bw + warm-up."""
    index_s, checkpoint_s = index_bytes_per_node / read_bandwidth, restore_bytes / read_bandwidth
    return {
        "index_s": index_s,
        "checkpoint_s": checkpoint_s,
        "warmup_s": warmup_s,
        "total_s": index_s + checkpoint_s + warmup_s,
    }


def host_bytes_per_rank(
    stage: int,
    facts: ModelFacts,
    ranks: int,
    samples_per_rank: int,
    index_bytes_per_sample: int,
    cache_share: float,
    offload: bool,
) -> dict:
    """Host memory of the busiest rank:
    index: index bytes per sample x samples per rank (the rank's shards only);
    cache: the node cache's peak / G (cache_footprint; pages of node-local files, RAM on a tmpfs);
    offload: DeepSpeed's CPU optimizer (stages 1-3) holds fp32 master, Adam m and v and the fp32
    gradient partition, 16P / N; none without offload (or at stage 0, which cannot offload);
    staging: pinned buffers for the rank's checkpoint bytes (checkpoint_bytes_per_rank's busiest);
    eval: the consolidated weights for eval, the largest fp32 master shard (4P / N; 4P at stage 0)
    plus one fp32 tensor (4 x the largest tensor)."""
    shard = FP32 * facts.parameters / (1 if stage == 0 else ranks)
    parts = {
        "index": index_bytes_per_sample * samples_per_rank,
        "cache": cache_share,
        "offload": 16.0 * facts.parameters / ranks if offload and stage > 0 else 0.0,
        "staging": checkpoint_bytes_per_rank(facts.parameters, stage, ranks)[0],
        "eval": shard + FP32 * facts.largest_tensor,
    }
    return {**parts, "total": sum(parts.values())}
