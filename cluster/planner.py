"""`vitforge plan`: a capacity planner on paper, for scales this project cannot run here.

The inputs (`PlanInput`) and the model's facts go through the closed formulas of
planner_formulas.py, each figure in turn (`plan`); planner_report.py prints them.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass

import torch

from vitforge.core import UsageError
from vitforge.pipeline import LoaderSettings, cache_footprint
from vitforge.trainer import PEAK_FLOPS, build_model, forward_flops

from .planner_formulas import (
    ModelFacts,
    accumulation,
    checkpoint_bytes_per_rank,
    comm_bandwidth,
    comm_bytes_per_rank,
    exposed_seconds,
    host_bytes_per_rank,
    intervals_within,
    lost_fraction,
    node_read_bandwidth,
    restart_seconds,
    restore_bytes_per_node,
    ring_collectives,
    ring_latency,
    shards_per_node,
    shards_per_rank,
    throughput,
    write_seconds,
    young_daly_interval,
)

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
        for name in (
            "dataset_images",
            "nodes",
            "gpus_per_node",
            "image_size",
            "mean_image_bytes",
            "shard_bytes",
            "global_batch",
            "micro_batch",
        ):
            if getattr(self, name) < 1:
                raise UsageError(f"{name} must be >= 1, not {getattr(self, name)}")
        for name in (
            "epochs",
            "checkpoint_bandwidth",
            "store_bandwidth",
            "node_mtbf_hours",
            "nvlink_bandwidth",
            "network_bandwidth",
            "node_read_bandwidth",
            "cache_limit_bytes",
            "node_ram_bytes",
        ):
            if not 0 < getattr(self, name) < math.inf:
                raise UsageError(f"{name} must be a number > 0, not {getattr(self, name)}")
        if not 0 < self.target_lost_fraction < 1:
            raise UsageError(f"target_lost_fraction must be in (0, 1), not {self.target_lost_fraction}")
        if not 0 <= self.comm_overlap <= 1:
            raise UsageError(f"comm_overlap must be in [0, 1], not {self.comm_overlap}")
        for name in (
            "cpu_decode_ms",
            "gpu_decode_cpu_ms",
            "read_block_bytes",
            "warmup_s",
            "index_bytes_per_sample",
            "shards_ahead",
        ):
            if not 0 <= getattr(self, name) < math.inf:
                raise UsageError(f"{name} must be a number >= 0, not {getattr(self, name)}")
        if self.global_batch < self.nodes * self.gpus_per_node:
            raise UsageError(
                f"global_batch {self.global_batch} gives no image to some of the {self.nodes * self.gpus_per_node} GPUs"
            )


@functools.lru_cache(maxsize=8)
def model_facts(model: str, image_size: int) -> ModelFacts:
    """From the architecture on the meta device: training FLOPs = 3 x forward (the backward pass
    costs twice the forward), the parameter count and the largest tensor. Cached: counting ViT-H's
    FLOPs takes seconds, and one process may plan many clusters for one model."""
    with torch.device("meta"):
        net = build_model(model, 1000, image_size)
    sizes = [p.numel() for p in net.parameters()]
    return ModelFacts(3 * forward_flops(model, image_size), sum(sizes), max(sizes))


def plan(inputs: PlanInput) -> dict:
    """Every figure for one model, cluster and run, in the order the report reads them: throughput,
    the data in the store, the optimizer step and a restart's inputs, then per ZeRO stage its
    communication, checkpoints and host memory."""
    facts = model_facts(inputs.model, inputs.image_size)
    figures = _throughput_figures(inputs, facts)
    figures.update(_data_figures(inputs, figures["images_per_s"], figures["gpus"]))
    figures.update(_step_figures(inputs, figures))
    job_mtbf_s = inputs.node_mtbf_hours * 3600 / inputs.nodes
    figures["job_mtbf_hours"] = job_mtbf_s / 3600
    figures["communication"] = {
        stage: _communication(inputs, figures, facts.parameters, stage) for stage in ZERO_STAGES
    }
    figures["checkpoint"] = {
        stage: _checkpoints(inputs, figures, facts.parameters, stage, job_mtbf_s) for stage in ZERO_STAGES
    }
    figures["host_memory"] = {stage: _host_memory(inputs, figures, facts, stage) for stage in ZERO_STAGES}
    return figures


def _throughput_figures(inputs: PlanInput, facts: ModelFacts) -> dict:
    """The model's size and cost, images/s per GPU, node and cluster, the run's compute-only time and
    the CPU cores per node that decoding takes."""
    gpus = inputs.nodes * inputs.gpus_per_node
    per_gpu = throughput(facts.flops_per_image, PEAK_FLOPS[inputs.device], inputs.mfu)
    per_node = per_gpu * inputs.gpus_per_node
    total = per_node * inputs.nodes
    epoch_s = inputs.dataset_images / total
    run_s = epoch_s * inputs.epochs
    return {
        "flops_per_image": facts.flops_per_image,
        "parameters": facts.parameters,
        "largest_tensor": facts.largest_tensor,
        "gpus": gpus,
        "images_per_s_per_gpu": per_gpu,
        "images_per_s_per_node": per_node,
        "images_per_s": total,
        "epoch_hours": epoch_s / 3600,
        "run_hours": run_s / 3600,
        "gpu_hours": run_s / 3600 * gpus,
        "decode_cores_per_node_cpu": per_node * inputs.cpu_decode_ms / 1000,
        "decode_cores_per_node_gpu_decode": per_node * inputs.gpu_decode_cpu_ms / 1000,
    }


def _data_figures(inputs: PlanInput, images_per_s: float, gpus: int) -> dict:
    """The dataset's shards, and what reading it at `images_per_s` asks of the object store."""
    dataset_bytes = inputs.dataset_images * inputs.mean_image_bytes
    shards = math.ceil(dataset_bytes / inputs.shard_bytes)
    bytes_per_s = images_per_s * inputs.mean_image_bytes
    return {
        "dataset_bytes": dataset_bytes,
        "shards": shards,
        "shard_images": math.ceil(inputs.shard_bytes / inputs.mean_image_bytes),
        "shards_per_rank": shards_per_rank(shards, gpus),
        "store_gets_per_s": images_per_s if inputs.read_block_bytes == 0 else bytes_per_s / inputs.read_block_bytes,
        "store_read_bytes_per_s": bytes_per_s,
        "egress_bytes_per_epoch": dataset_bytes,
        "egress_bytes_per_node_per_epoch": shards_per_node(shards, inputs.nodes) * inputs.shard_bytes,
    }


def _step_figures(inputs: PlanInput, figures: dict) -> dict:
    """The optimizer step (its count, compute time, micro-steps, links) and what a restart reads on
    each node (index and cache)."""
    gpus, per_node_ranks = figures["gpus"], inputs.gpus_per_node
    index_bytes_per_node = (
        per_node_ranks * figures["shards_per_rank"] * figures["shard_images"] * inputs.index_bytes_per_sample
    )
    cache = cache_footprint(inputs.shard_bytes, per_node_ranks, inputs.shards_ahead, int(inputs.cache_limit_bytes))
    return {
        "steps": inputs.dataset_images * inputs.epochs / inputs.global_batch,
        "compute_s_per_step": inputs.global_batch / gpus / figures["images_per_s_per_gpu"],
        "micro_steps": accumulation(inputs.global_batch, inputs.micro_batch, gpus),
        "comm_bandwidth": comm_bandwidth(inputs.nodes, inputs.nvlink_bandwidth, inputs.network_bandwidth),
        "ring_latency_s": ring_latency(gpus, inputs.nodes),
        "node_read_bandwidth": node_read_bandwidth(inputs.node_read_bandwidth, inputs.store_bandwidth, inputs.nodes),
        "index_bytes_per_node": index_bytes_per_node,
        "cache": asdict(cache),
    }


def _communication(inputs: PlanInput, figures: dict, parameters: int, stage: int) -> dict:
    """One ZeRO stage's bytes per rank and step, their time, and the step, MFU and run they give."""
    gpus, compute_s, steps, micro_steps = (
        figures["gpus"],
        figures["compute_s_per_step"],
        figures["steps"],
        figures["micro_steps"],
    )
    sent = comm_bytes_per_rank(parameters, stage, gpus, micro_steps)
    bandwidth_s = sent / figures["comm_bandwidth"]
    latency_s = ring_collectives(stage, parameters, micro_steps) * ring_latency(gpus, inputs.nodes)
    comm_s = bandwidth_s + latency_s
    step_s = compute_s + exposed_seconds(comm_s, compute_s, inputs.comm_overlap)
    return {
        "bytes_per_rank": sent,
        "bandwidth_s": bandwidth_s,
        "latency_s": latency_s,
        "comm_s": comm_s,
        "step_s": step_s,
        "step_all_hidden_s": max(compute_s, comm_s),
        "effective_mfu": inputs.mfu * compute_s / step_s,
        "run_hours": steps * step_s / 3600,
        "gpu_hours": steps * step_s / 3600 * gpus,
    }


def _checkpoints(inputs: PlanInput, figures: dict, parameters: int, stage: int, job_mtbf_s: float) -> dict:
    """One ZeRO stage's checkpoint: its bytes and write time, a restart, and the intervals between
    checkpoints that keep the work lost to failures within the target."""
    gpus = figures["gpus"]
    busiest, whole = checkpoint_bytes_per_rank(parameters, stage, gpus)
    seconds = write_seconds(busiest, whole, inputs.checkpoint_bandwidth, inputs.store_bandwidth)
    restart = restart_seconds(
        figures["index_bytes_per_node"],
        restore_bytes_per_node(parameters, stage, gpus, inputs.gpus_per_node),
        figures["node_read_bandwidth"],
        inputs.warmup_s,
    )
    young = young_daly_interval(seconds, job_mtbf_s)
    return {
        "busiest_rank_bytes": busiest,
        "total_bytes": whole,
        "write_s": seconds,
        "restart": restart,
        "young_interval_s": young,
        "lost_fraction_at_young": lost_fraction(young, seconds, job_mtbf_s, restart["total_s"]),
        "intervals_within_target_s": intervals_within(
            inputs.target_lost_fraction, seconds, job_mtbf_s, restart["total_s"]
        ),
    }


def _host_memory(inputs: PlanInput, figures: dict, facts: ModelFacts, stage: int) -> dict:
    """One ZeRO stage's host memory on the busiest rank and on its node, against the node's RAM."""
    per_node_ranks = inputs.gpus_per_node
    rank = host_bytes_per_rank(
        stage,
        facts,
        figures["gpus"],
        figures["shards_per_rank"] * figures["shard_images"],
        inputs.index_bytes_per_sample,
        figures["cache"]["peak_bytes"] / per_node_ranks,
        inputs.offload_optimizer,
    )
    return {
        "per_rank": rank,
        "per_node": rank["total"] * per_node_ranks,
        "fits": rank["total"] * per_node_ranks <= inputs.node_ram_bytes,
    }
