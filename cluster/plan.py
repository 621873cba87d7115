"""`vitforge plan`: a capacity planner on paper, for scales this project cannot run here.

Every figure is a closed formula of the inputs, written in the docstring of the function that
computes it, so a reader can redo any line by hand (the tests do).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from vitforge.core import UsageError
from vitforge.pipeline import LoaderSpec
from vitforge.trainer import PEAK_FLOPS, build_model, forward_flops

ZERO_STAGES = (0, 1, 2, 3)


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
    # CPU milliseconds per image, measured on this project's loaders (docs/ARCHITECTURE.md): DALI
    # CPU decode + crop + normalise about 2.1-2.5 ms; with GPU (nvJPEG) decoding the CPU only reads
    # and feeds bytes.
    cpu_decode_ms: float = 2.3
    gpu_decode_cpu_ms: float = 0.2
    mean_image_bytes: int = 110_000  # an ImageNet-like JPEG
    shard_bytes: int = 1 << 30
    # The loader's reads from the object store: whole shards in ranged GETs of data.read_block_mb
    # (the loader's default here); 0: one GET per sample (a per-sample reader's count)
    read_block_bytes: int = int(LoaderSpec.read_block_mb * 2**20)
    checkpoint_bandwidth: float = 1e9  # bytes/s one rank writes to the store
    store_bandwidth: float = 50e9  # bytes/s the store accepts from the whole job
    node_mtbf_hours: float = 5_000.0  # mean time between failures of one node
    target_lost_fraction: float = 0.02  # largest acceptable share of the run lost to failures

    def __post_init__(self):
        if self.device not in PEAK_FLOPS:
            raise UsageError(f"device {self.device!r}: known devices are {', '.join(PEAK_FLOPS)}")
        if not 0 < self.mfu <= 1:
            raise UsageError(f"mfu must be in (0, 1], not {self.mfu}")
        for name in ("dataset_images", "nodes", "gpus_per_node", "image_size", "mean_image_bytes", "shard_bytes"):
            if getattr(self, name) < 1:
                raise UsageError(f"{name} must be >= 1, not {getattr(self, name)}")
        for name in ("epochs", "checkpoint_bandwidth", "store_bandwidth", "node_mtbf_hours"):
            if not 0 < getattr(self, name) < math.inf:
                raise UsageError(f"{name} must be a number > 0, not {getattr(self, name)}")
        if not 0 < self.target_lost_fraction < 1:
            raise UsageError(f"target_lost_fraction must be in (0, 1), not {self.target_lost_fraction}")
        for name in ("cpu_decode_ms", "gpu_decode_cpu_ms", "read_block_bytes"):
            if not 0 <= getattr(self, name) < math.inf:
                raise UsageError(f"{name} must be a number >= 0, not {getattr(self, name)}")


def model_size(model: str, image_size: int) -> tuple[float, int]:
    """(training FLOPs per image, parameter count), from the architecture on the meta device:
    training = 3 x forward (the backward pass costs twice the forward)."""
    with torch.device("meta"):
        net = build_model(model, 1000, image_size)
    return 3 * forward_flops(model, image_size), sum(p.numel() for p in net.parameters())


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
    M the job's mean time between failures (first order; Daly's refinement differs when C ~ M)."""
    return math.sqrt(2 * checkpoint_s * job_mtbf_s)


def lost_fraction(interval_s: float, checkpoint_s: float, job_mtbf_s: float) -> float:
    """Expected share of the run lost, to first order: C / tau for writing checkpoints plus
    tau / (2 M) for the work redone after a failure (on average half an interval)."""
    return checkpoint_s / interval_s + interval_s / (2 * job_mtbf_s)


def intervals_within(target: float, checkpoint_s: float, job_mtbf_s: float) -> tuple[float, float] | None:
    """The range of intervals tau with lost_fraction(tau) <= target: the roots of
    tau^2 / (2M) - target tau + C = 0, i.e. M (target -+ sqrt(target^2 - 2C/M)); None when even
    Young's interval loses more than the target (target^2 < 2C/M)."""
    discriminant = target ** 2 - 2 * checkpoint_s / job_mtbf_s
    if discriminant < 0:
        return None
    root = math.sqrt(discriminant)
    return job_mtbf_s * (target - root), job_mtbf_s * (target + root)


def plan(inputs: PlanInput) -> dict:
    flops, parameters = model_size(inputs.model, inputs.image_size)
    gpus = inputs.nodes * inputs.gpus_per_node
    per_gpu = throughput(flops, PEAK_FLOPS[inputs.device], inputs.mfu)
    per_node = per_gpu * inputs.gpus_per_node
    total = per_node * inputs.nodes
    epoch_s = inputs.dataset_images / total
    run_s = epoch_s * inputs.epochs
    dataset_bytes = inputs.dataset_images * inputs.mean_image_bytes
    bytes_per_s = total * inputs.mean_image_bytes
    gets = total if inputs.read_block_bytes == 0 else bytes_per_s / inputs.read_block_bytes
    job_mtbf_s = inputs.node_mtbf_hours * 3600 / inputs.nodes
    checkpoints = {}
    for stage in ZERO_STAGES:
        busiest, whole = checkpoint_bytes_per_rank(parameters, stage, gpus)
        seconds = write_seconds(busiest, whole, inputs.checkpoint_bandwidth, inputs.store_bandwidth)
        young = young_daly_interval(seconds, job_mtbf_s)
        checkpoints[stage] = {"busiest_rank_bytes": busiest, "total_bytes": whole, "write_s": seconds,
                              "young_interval_s": young, "lost_fraction_at_young": lost_fraction(young, seconds,
                                                                                                   job_mtbf_s),
                              "intervals_within_target_s": intervals_within(inputs.target_lost_fraction, seconds,
                                                                            job_mtbf_s)}
    return {
        "flops_per_image": flops, "parameters": parameters, "gpus": gpus,
        "images_per_s_per_gpu": per_gpu, "images_per_s_per_node": per_node, "images_per_s": total,
        "epoch_hours": epoch_s / 3600, "run_hours": run_s / 3600, "gpu_hours": run_s / 3600 * gpus,
        "decode_cores_per_node_cpu": per_node * inputs.cpu_decode_ms / 1000,
        "decode_cores_per_node_gpu_decode": per_node * inputs.gpu_decode_cpu_ms / 1000,
        "dataset_bytes": dataset_bytes, "shards": math.ceil(dataset_bytes / inputs.shard_bytes),
        "shard_images": math.ceil(inputs.shard_bytes / inputs.mean_image_bytes),
        "store_gets_per_s": gets, "store_read_bytes_per_s": bytes_per_s, "egress_bytes_per_epoch": dataset_bytes,
        "job_mtbf_hours": job_mtbf_s / 3600, "checkpoint": checkpoints,
    }


def report(inputs: PlanInput, result: dict) -> str:
    def clock(hours: float) -> str:
        return f"{hours * 60:,.1f} min" if hours < 1 else f"{hours:,.1f} h ({hours / 24:,.1f} days)"

    lines = [
        f"{inputs.model} at {inputs.image_size} px: {result['parameters'] / 1e6:,.1f}M parameters, "
        f"{result['flops_per_image'] / 1e12:.2f} TFLOP per training image",
        f"{inputs.nodes} nodes x {inputs.gpus_per_node} {inputs.device} at {inputs.mfu:.0%} MFU "
        f"(peak {PEAK_FLOPS[inputs.device] / 1e12:,.0f} TFLOP/s each)",
        f"  images/s: {result['images_per_s_per_gpu']:,.0f} per GPU, {result['images_per_s_per_node']:,.0f} per node, "
        f"{result['images_per_s']:,.0f} in all",
        f"  epoch of {inputs.dataset_images:,} images: {clock(result['epoch_hours'])}; "
        f"{inputs.epochs:g} epochs: {clock(result['run_hours'])}; {result['gpu_hours']:,.0f} GPU-hours",
        f"  CPU cores per node to decode: {result['decode_cores_per_node_cpu']:,.1f} on the CPU "
        f"({inputs.cpu_decode_ms} ms/image), {result['decode_cores_per_node_gpu_decode']:,.1f} with GPU decoding "
        f"({inputs.gpu_decode_cpu_ms} ms/image)",
        f"  shards: {result['shards']:,} of {inputs.shard_bytes / 2**30:.2f} GiB (~{result['shard_images']:,} images), "
        f"{result['dataset_bytes'] / 1e12:,.2f} TB in all",
        f"  object store: {result['store_gets_per_s']:,.0f} GET/s "
        f"({'one per sample' if not inputs.read_block_bytes else f'{inputs.read_block_bytes / 2**20:.0f} MiB reads'}), "
        f"{result['store_read_bytes_per_s'] / 1e9:,.2f} GB/s, {result['egress_bytes_per_epoch'] / 1e12:,.2f} TB "
        "egress per epoch",
        f"  failures: job MTBF {result['job_mtbf_hours']:,.1f} h (node MTBF {inputs.node_mtbf_hours:,.0f} h); "
        f"checkpoints at {inputs.checkpoint_bandwidth / 1e9:g} GB/s per rank, {inputs.store_bandwidth / 1e9:g} GB/s "
        "into the store:",
    ]
    for stage, c in result["checkpoint"].items():
        window = c["intervals_within_target_s"]
        within = (f"{window[0] / 60:,.1f}-{window[1] / 60:,.1f} min keeps lost work <= "
                  f"{inputs.target_lost_fraction:.1%}" if window else
                  f"no interval keeps lost work under {inputs.target_lost_fraction:.1%}")
        lines.append(f"    ZeRO-{stage}: {c['busiest_rank_bytes'] / 1e9:,.2f} GB on the busiest rank, "
                     f"{c['total_bytes'] / 1e9:,.1f} GB in all, written in {c['write_s']:,.1f} s; Young interval "
                     f"{c['young_interval_s'] / 60:,.1f} min (loses {c['lost_fraction_at_young']:.2%}); {within}")
    return "\n".join(lines)
