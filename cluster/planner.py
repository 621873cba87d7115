"""`vitforge plan`: a capacity planner on paper, for scales this project cannot run here.

Every figure is a closed formula of the inputs, written in the docstring of the function that
computes it, so a reader can redo any line by hand (the tests do).
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass

import torch

from vitforge.core import UsageError
from vitforge.pipeline import LoaderSettings, cache_footprint
from vitforge.trainer import PEAK_FLOPS, build_model, forward_flops

ZERO_STAGES = (0, 1, 2, 3)


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
class PlanInput:
    model: str = "vit_huge_patch14_224"
    image_size: int = 224
    dataset_images: int = 1_281_167
    epochs: float = 90.0
    nodes: int = 1
    gpus_per_node: int = 8
    device: str = "H100"
    mfu: float = 0.4  # model FLOPs utilisation reached (0-1)
    # CPU milliseconds per image: 1000 / the images per CPU-second of the best CPU backend (torch:
    # decode, random-resized crop to 224 px, flip, normalise) in benchmarks/loader_bench.py, on the
    # 2-vCPU development VM, 2026-12-01: 299 per CPU-second (the decode-only floor in the same run:
    # 510, so a faster core scales both). With GPU (nvJPEG) decoding the CPU only reads and feeds bytes.
    cpu_decode_ms: float = 3.3
    gpu_decode_cpu_ms: float = 0.2
    mean_image_bytes: int = 110_000  # an ImageNet-like JPEG
    shard_bytes: int = 1 << 30
    # The loader's reads from the object store: whole shards in ranged GETs of data.read_block_mb
    # (the loader's default here); 0: one GET per sample (a per-sample reader's count)
    read_block_bytes: int = int(LoaderSettings().read_block_mb * 2**20)
    checkpoint_bandwidth: float = 1e9  # bytes/s one rank writes to the store
    store_bandwidth: float = 50e9  # bytes/s the store accepts from (and serves to) the whole job
    node_mtbf_hours: float = 5_000.0  # mean time between failures of one node
    target_lost_fraction: float = 0.02  # largest acceptable share of the run lost to failures
    # The batch: the ViT paper's 4096 images per optimizer step; micro_batch as in the paper recipe
    # (trainer/recipes/vit_h14_pretrain.yaml): accumulation fills the rest.
    global_batch: int = 4096
    micro_batch: int = 64
    # Links, bytes/s: NVLink 4 on H100/H200 SXM is 450 GB/s per GPU each way; a DGX H100/H200 has
    # 8 x 400 Gb/s InfiniBand NDR for the compute fabric, 400 GB/s per node.
    nvlink_bandwidth: float = 450e9
    network_bandwidth: float = 400e9  # per node
    # Share of the communication that runs behind compute (0-1). 0: none, an upper bound on the step;
    # DeepSpeed's overlap_comm is off by default for stages 0-2 and the trainer does not set it.
    comm_overlap: float = 0.0
    # Restart: what one node reads from the store (a storage NIC of 2 x 100 Gb/s), and the seconds
    # from process start to the first step (launch, imports, NCCL init, compile).
    node_read_bandwidth: float = 25e9
    warmup_s: float = 60.0
    # Host memory: the loader's index as compact columns (offset, size, label, shard, name hash: 64
    # bytes a sample), the node cache (the paper recipe's data.cache_gb: 64) with the loader's
    # lookahead, DeepSpeed's CPU optimizer offload, and the node's RAM (2 TB on a DGX H100/H200).
    index_bytes_per_sample: int = 64
    cache_limit_bytes: float = 64e9
    shards_ahead: int = LoaderSettings().shards_ahead
    offload_optimizer: bool = False
    node_ram_bytes: float = 2e12

    def __post_init__(self):
        if self.device not in PEAK_FLOPS:
            raise UsageError(f"device {self.device!r}: known devices are {', '.join(PEAK_FLOPS)}")
        if not 0 < self.mfu <= 1:
            raise UsageError(f"mfu must be in (0, 1], not {self.mfu}")
        for name in ("dataset_images", "nodes", "gpus_per_node", "image_size", "mean_image_bytes", "shard_bytes",
                     "global_batch", "micro_batch"):
            if getattr(self, name) < 1:
                raise UsageError(f"{name} must be >= 1, not {getattr(self, name)}")
        for name in ("epochs", "checkpoint_bandwidth", "store_bandwidth", "node_mtbf_hours", "nvlink_bandwidth",
                     "network_bandwidth", "node_read_bandwidth", "cache_limit_bytes", "node_ram_bytes"):
            if not 0 < getattr(self, name) < math.inf:
                raise UsageError(f"{name} must be a number > 0, not {getattr(self, name)}")
        if not 0 < self.target_lost_fraction < 1:
            raise UsageError(f"target_lost_fraction must be in (0, 1), not {self.target_lost_fraction}")
        if not 0 <= self.comm_overlap <= 1:
            raise UsageError(f"comm_overlap must be in [0, 1], not {self.comm_overlap}")
        for name in ("cpu_decode_ms", "gpu_decode_cpu_ms", "read_block_bytes", "warmup_s", "index_bytes_per_sample",
                     "shards_ahead"):
            if not 0 <= getattr(self, name) < math.inf:
                raise UsageError(f"{name} must be a number >= 0, not {getattr(self, name)}")
        if self.global_batch < self.nodes * self.gpus_per_node:
            raise UsageError(f"global_batch {self.global_batch} gives no image to some of the "
                             f"{self.nodes * self.gpus_per_node} GPUs")


@dataclass(frozen=True)
class ModelFacts:
    flops_per_image: float  # training FLOPs per image
    parameters: int
    largest_tensor: int  # elements of the largest parameter tensor


@functools.lru_cache(maxsize=8)
def model_facts(model: str, image_size: int) -> ModelFacts:
    """From the architecture on the meta device: training FLOPs = 3 x forward (the backward pass
    costs twice the forward), the parameter count and the largest tensor. Cached: counting ViT-H's
    FLOPs takes seconds, and one process may plan many clusters for one model."""
    with torch.device("meta"):
        net = build_model(model, 1000, image_size)
    sizes = [p.numel() for p in net.parameters()]
    return ModelFacts(3 * forward_flops(model, image_size), sum(sizes), max(sizes))


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


def write_seconds(busiest_rank_bytes: float, total_bytes: float, rank_bandwidth: float,
                  store_bandwidth: float) -> float:
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


def intervals_within(target: float, checkpoint_s: float, job_mtbf_s: float,
                     restart_s: float = 0.0) -> tuple[float, float] | None:
    """The range of intervals tau with lost_fraction(tau) <= target: the roots of
    tau^2 / (2M) - t tau + C = 0 with t = target - R / M (the restarts' share, which no interval
    changes), i.e. M (t -+ sqrt(t^2 - 2C/M)); None when even Young's interval loses more than the
    target (t^2 < 2C/M, or t <= 0)."""
    share = target - restart_s / job_mtbf_s
    discriminant = share ** 2 - 2 * checkpoint_s / job_mtbf_s
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
    return {0: 2 * buckets, 1: 2 * buckets, 2: (micro_steps + 1) * buckets,
            3: micro_steps * (2 * gathers + buckets)}[stage]


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


def restart_seconds(index_bytes_per_node: float, restore_bytes: float, read_bandwidth: float,
                    warmup_s: float) -> dict:
    """Time from a failure's requeue to the first step again: the node's ranks' shard indexes
    (G x shards per rank x images per shard x index bytes per sample) and its checkpoint share,
    each at the node's read bandwidth, plus the warm-up: index / bw + restore / bw + warm-up."""
    index_s, checkpoint_s = index_bytes_per_node / read_bandwidth, restore_bytes / read_bandwidth
    return {"index_s": index_s, "checkpoint_s": checkpoint_s, "warmup_s": warmup_s,
            "total_s": index_s + checkpoint_s + warmup_s}


def host_bytes_per_rank(stage: int, facts: ModelFacts, ranks: int, samples_per_rank: int,
                        index_bytes_per_sample: int, cache_share: float, offload: bool) -> dict:
    """Host memory of the busiest rank:
    index: index bytes per sample x samples per rank (the rank's shards only);
    cache: the node cache's peak / G (cache_footprint; pages of node-local files, RAM on a tmpfs);
    offload: DeepSpeed's CPU optimizer (stages 1-3) holds fp32 master, Adam m and v and the fp32
    gradient partition, 16P / N; none without offload (or at stage 0, which cannot offload);
    staging: pinned buffers for the rank's checkpoint bytes (checkpoint_bytes_per_rank's busiest);
    eval: the consolidated weights for eval, the largest fp32 master shard (4P / N; 4P at stage 0)
    plus one fp32 tensor (4 x the largest tensor)."""
    shard = FP32 * facts.parameters / (1 if stage == 0 else ranks)
    parts = {"index": index_bytes_per_sample * samples_per_rank, "cache": cache_share,
             "offload": 16.0 * facts.parameters / ranks if offload and stage > 0 else 0.0,
             "staging": checkpoint_bytes_per_rank(facts.parameters, stage, ranks)[0],
             "eval": shard + FP32 * facts.largest_tensor}
    return {**parts, "total": sum(parts.values())}


def plan(inputs: PlanInput) -> dict:
    facts = model_facts(inputs.model, inputs.image_size)
    flops, parameters = facts.flops_per_image, facts.parameters
    gpus, per_node_ranks = inputs.nodes * inputs.gpus_per_node, inputs.gpus_per_node
    per_gpu = throughput(flops, PEAK_FLOPS[inputs.device], inputs.mfu)
    per_node = per_gpu * inputs.gpus_per_node
    total = per_node * inputs.nodes
    epoch_s = inputs.dataset_images / total
    run_s = epoch_s * inputs.epochs
    dataset_bytes = inputs.dataset_images * inputs.mean_image_bytes
    shards = math.ceil(dataset_bytes / inputs.shard_bytes)
    shard_images = math.ceil(inputs.shard_bytes / inputs.mean_image_bytes)
    bytes_per_s = total * inputs.mean_image_bytes
    gets = total if inputs.read_block_bytes == 0 else bytes_per_s / inputs.read_block_bytes
    job_mtbf_s = inputs.node_mtbf_hours * 3600 / inputs.nodes

    steps = inputs.dataset_images * inputs.epochs / inputs.global_batch
    compute_s = inputs.global_batch / gpus / per_gpu
    micro_steps = accumulation(inputs.global_batch, inputs.micro_batch, gpus)
    bandwidth = comm_bandwidth(inputs.nodes, inputs.nvlink_bandwidth, inputs.network_bandwidth)
    read_bandwidth = node_read_bandwidth(inputs.node_read_bandwidth, inputs.store_bandwidth, inputs.nodes)
    rank_shards = shards_per_rank(shards, gpus)
    index_bytes_per_node = per_node_ranks * rank_shards * shard_images * inputs.index_bytes_per_sample
    cache = cache_footprint(inputs.shard_bytes, per_node_ranks, inputs.shards_ahead, int(inputs.cache_limit_bytes))

    communication, checkpoints, host = {}, {}, {}
    for stage in ZERO_STAGES:
        sent = comm_bytes_per_rank(parameters, stage, gpus, micro_steps)
        bandwidth_s = sent / bandwidth
        latency_s = ring_collectives(stage, parameters, micro_steps) * ring_latency(gpus, inputs.nodes)
        comm_s = bandwidth_s + latency_s
        step_s = compute_s + exposed_seconds(comm_s, compute_s, inputs.comm_overlap)
        communication[stage] = {
            "bytes_per_rank": sent, "bandwidth_s": bandwidth_s, "latency_s": latency_s,
            "comm_s": comm_s, "step_s": step_s, "step_all_hidden_s": max(compute_s, comm_s),
            "effective_mfu": inputs.mfu * compute_s / step_s, "run_hours": steps * step_s / 3600,
            "gpu_hours": steps * step_s / 3600 * gpus}

        busiest, whole = checkpoint_bytes_per_rank(parameters, stage, gpus)
        seconds = write_seconds(busiest, whole, inputs.checkpoint_bandwidth, inputs.store_bandwidth)
        restart = restart_seconds(index_bytes_per_node, restore_bytes_per_node(parameters, stage, gpus,
                                                                               per_node_ranks),
                                  read_bandwidth, inputs.warmup_s)
        young = young_daly_interval(seconds, job_mtbf_s)
        checkpoints[stage] = {"busiest_rank_bytes": busiest, "total_bytes": whole, "write_s": seconds,
                              "restart": restart, "young_interval_s": young,
                              "lost_fraction_at_young": lost_fraction(young, seconds, job_mtbf_s,
                                                                      restart["total_s"]),
                              "intervals_within_target_s": intervals_within(inputs.target_lost_fraction, seconds,
                                                                            job_mtbf_s, restart["total_s"])}
        rank = host_bytes_per_rank(stage, facts, gpus, rank_shards * shard_images, inputs.index_bytes_per_sample,
                                   cache.peak_bytes / per_node_ranks, inputs.offload_optimizer)
        host[stage] = {"per_rank": rank, "per_node": rank["total"] * per_node_ranks,
                       "fits": rank["total"] * per_node_ranks <= inputs.node_ram_bytes}
    return {
        "flops_per_image": flops, "parameters": parameters, "largest_tensor": facts.largest_tensor, "gpus": gpus,
        "images_per_s_per_gpu": per_gpu, "images_per_s_per_node": per_node, "images_per_s": total,
        "epoch_hours": epoch_s / 3600, "run_hours": run_s / 3600, "gpu_hours": run_s / 3600 * gpus,
        "decode_cores_per_node_cpu": per_node * inputs.cpu_decode_ms / 1000,
        "decode_cores_per_node_gpu_decode": per_node * inputs.gpu_decode_cpu_ms / 1000,
        "dataset_bytes": dataset_bytes, "shards": shards, "shard_images": shard_images,
        "shards_per_rank": rank_shards,
        "store_gets_per_s": gets, "store_read_bytes_per_s": bytes_per_s, "egress_bytes_per_epoch": dataset_bytes,
        "egress_bytes_per_node_per_epoch": shards_per_node(shards, inputs.nodes) * inputs.shard_bytes,
        "steps": steps, "compute_s_per_step": compute_s, "micro_steps": micro_steps, "comm_bandwidth": bandwidth,
        "ring_latency_s": ring_latency(gpus, inputs.nodes), "node_read_bandwidth": read_bandwidth,
        "index_bytes_per_node": index_bytes_per_node,
        "cache": asdict(cache),
        "job_mtbf_hours": job_mtbf_s / 3600, "communication": communication, "checkpoint": checkpoints,
        "host_memory": host,
    }


def report(inputs: PlanInput, result: dict) -> str:
    def clock(hours: float) -> str:
        return f"{hours * 60:,.1f} min" if hours < 1 else f"{hours:,.1f} h ({hours / 24:,.1f} days)"

    def gb(n: float) -> str:
        return f"{n / 1e9:,.2f} GB"

    lines = [
        f"{inputs.model} at {inputs.image_size} px: {result['parameters'] / 1e6:,.1f}M parameters, "
        f"{result['flops_per_image'] / 1e12:.2f} TFLOP per training image",
        f"{inputs.nodes} nodes x {inputs.gpus_per_node} {inputs.device} at {inputs.mfu:.0%} MFU "
        f"(peak {PEAK_FLOPS[inputs.device] / 1e12:,.0f} TFLOP/s each)",
        f"  images/s: {result['images_per_s_per_gpu']:,.0f} per GPU, {result['images_per_s_per_node']:,.0f} per node, "
        f"{result['images_per_s']:,.0f} in all",
        f"  compute only: epoch of {inputs.dataset_images:,} images: {clock(result['epoch_hours'])}; "
        f"{inputs.epochs:g} epochs: {clock(result['run_hours'])}; {result['gpu_hours']:,.0f} GPU-hours",
        f"  CPU cores per node to decode: {result['decode_cores_per_node_cpu']:,.1f} on the CPU "
        f"({inputs.cpu_decode_ms} ms/image), {result['decode_cores_per_node_gpu_decode']:,.1f} with GPU decoding "
        f"({inputs.gpu_decode_cpu_ms} ms/image)",
        f"  shards: {result['shards']:,} of {inputs.shard_bytes / 2**30:.2f} GiB (~{result['shard_images']:,} images), "
        f"{result['dataset_bytes'] / 1e12:,.2f} TB in all, {result['shards_per_rank']:,} per rank",
        f"  object store: {result['store_gets_per_s']:,.0f} GET/s "
        f"({'one per sample' if not inputs.read_block_bytes else f'{inputs.read_block_bytes / 2**20:.0f} MiB reads'}), "
        f"{result['store_read_bytes_per_s'] / 1e9:,.2f} GB/s, {result['egress_bytes_per_epoch'] / 1e12:,.2f} TB "
        f"egress per epoch, at most {result['egress_bytes_per_node_per_epoch'] / 1e9:,.2f} GB per node",
        f"  step: {inputs.global_batch:,} images ({result['micro_steps']} micro-step(s) of <= {inputs.micro_batch} "
        f"per GPU), {result['compute_s_per_step'] * 1e3:,.1f} ms of compute; {result['steps']:,.0f} steps",
        f"  communication at {result['comm_bandwidth'] / 1e9:g} GB/s per rank "
        f"({'NVLink' if inputs.nodes == 1 else 'min of NVLink and the node network'}), "
        f"{result['ring_latency_s'] * 1e6:,.0f} us per ring traversal, "
        f"{inputs.comm_overlap:.0%} hidden behind compute:",
    ]
    for stage, c in result["communication"].items():
        lines.append(f"    ZeRO-{stage}: {gb(c['bytes_per_rank'])} per rank per step, {c['bandwidth_s'] * 1e3:,.1f} ms "
                     f"+ {c['latency_s'] * 1e3:,.1f} ms latency; step {c['step_s'] * 1e3:,.1f} ms "
                     f"({c['step_all_hidden_s'] * 1e3:,.1f} ms if all hidden): effective MFU "
                     f"{c['effective_mfu']:.1%}, run {clock(c['run_hours'])}, {c['gpu_hours']:,.0f} GPU-hours")
    lines.append(f"  failures: job MTBF {result['job_mtbf_hours']:,.1f} h (node MTBF {inputs.node_mtbf_hours:,.0f} h); "
                 f"checkpoints at {inputs.checkpoint_bandwidth / 1e9:g} GB/s per rank, "
                 f"{inputs.store_bandwidth / 1e9:g} GB/s into the store; a restart reads at "
                 f"{result['node_read_bandwidth'] / 1e9:,.2f} GB/s per node (index "
                 f"{gb(result['index_bytes_per_node'])} per node, warm-up {inputs.warmup_s:g} s):")
    for stage, c in result["checkpoint"].items():
        window, restart = c["intervals_within_target_s"], c["restart"]
        within = (f"{window[0] / 60:,.1f}-{window[1] / 60:,.1f} min keeps lost work <= "
                  f"{inputs.target_lost_fraction:.1%}" if window else
                  f"no interval keeps lost work under {inputs.target_lost_fraction:.1%}")
        lines.append(f"    ZeRO-{stage}: {gb(c['busiest_rank_bytes'])} on the busiest rank, "
                     f"{c['total_bytes'] / 1e9:,.1f} GB in all, written in {c['write_s']:,.1f} s; restart "
                     f"{restart['total_s']:,.0f} s (index {restart['index_s']:,.1f} s, checkpoint "
                     f"{restart['checkpoint_s']:,.1f} s, warm-up {restart['warmup_s']:g} s); Young interval "
                     f"{c['young_interval_s'] / 60:,.1f} min (loses {c['lost_fraction_at_young']:.2%}); {within}")
    cache = result["cache"]
    lines.append(f"  host memory per rank (busiest; node cache {gb(cache['peak_bytes'])} at peak, {cache['ahead']} "
                 f"shard(s) ahead{', too small: some shards stream from the store' if cache['streams'] else ''}; "
                 f"{inputs.index_bytes_per_sample} index bytes per "
                 f"sample), vs {inputs.node_ram_bytes / 1e12:g} TB per node:")
    for stage, h in result["host_memory"].items():
        r = h["per_rank"]
        lines.append(f"    ZeRO-{stage}: {gb(r['total'])} per rank (index {gb(r['index'])}, cache {gb(r['cache'])}, "
                     f"offload {gb(r['offload'])}, checkpoint staging {gb(r['staging'])}, eval weights "
                     f"{gb(r['eval'])}); {gb(h['per_node'])} per node, "
                     f"{'fits' if h['fits'] else 'OVER the node RAM'}")
    return "\n".join(lines)
