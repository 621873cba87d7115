"""`vitforge plan`'s report: the planner's figures (planner.py's `plan`) as text, one section per
concern: throughput and data, then communication, checkpoints and host memory per ZeRO stage."""

from __future__ import annotations

from vitforge.trainer import PEAK_FLOPS

from .planner import PlanInput


def report(inputs: PlanInput, result: dict) -> str:
    return "\n".join(
        [
            *_throughput_lines(inputs, result),
            *_communication_lines(inputs, result),
            *_checkpoint_lines(inputs, result),
            *_host_memory_lines(inputs, result),
        ]
    )


def _clock(hours: float) -> str:
    return f"{hours * 60:,.1f} min" if hours < 1 else f"{hours:,.1f} h ({hours / 24:,.1f} days)"


def _gb(n: float) -> str:
    return f"{n / 1e9:,.2f} GB"


def _throughput_lines(inputs: PlanInput, result: dict) -> list[str]:
    """The model, the cluster, its images/s and compute-only time, decoding, shards, the store and the step."""
    return [
        f"{inputs.model} at {inputs.image_size} px: {result['parameters'] / 1e6:,.1f}M parameters, "
        f"{result['flops_per_image'] / 1e12:.2f} TFLOP per training image",
        f"{inputs.nodes} nodes x {inputs.gpus_per_node} {inputs.device} at {inputs.mfu:.0%} MFU "
        f"(peak {PEAK_FLOPS[inputs.device] / 1e12:,.0f} TFLOP/s each)",
        f"  images/s: {result['images_per_s_per_gpu']:,.0f} per GPU, {result['images_per_s_per_node']:,.0f} per node, "
        f"{result['images_per_s']:,.0f} in all",
        f"  compute only: epoch of {inputs.dataset_images:,} images: {_clock(result['epoch_hours'])}; "
        f"{inputs.epochs:g} epochs: {_clock(result['run_hours'])}; {result['gpu_hours']:,.0f} GPU-hours",
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
    ]


def _communication_lines(inputs: PlanInput, result: dict) -> list[str]:
    lines = [
        f"  communication at {result['comm_bandwidth'] / 1e9:g} GB/s per rank "
        f"({'NVLink' if inputs.nodes == 1 else 'min of NVLink and the node network'}), "
        f"{result['ring_latency_s'] * 1e6:,.0f} us per ring traversal, "
        f"{inputs.comm_overlap:.0%} hidden behind compute:",
    ]
    for stage, c in result["communication"].items():
        lines.append(
            f"    ZeRO-{stage}: {_gb(c['bytes_per_rank'])} per rank per step, {c['bandwidth_s'] * 1e3:,.1f} ms "
            f"+ {c['latency_s'] * 1e3:,.1f} ms latency; step {c['step_s'] * 1e3:,.1f} ms "
            f"({c['step_all_hidden_s'] * 1e3:,.1f} ms if all hidden): effective MFU "
            f"{c['effective_mfu']:.1%}, run {_clock(c['run_hours'])}, {c['gpu_hours']:,.0f} GPU-hours"
        )
    return lines


def _checkpoint_lines(inputs: PlanInput, result: dict) -> list[str]:
    lines = [
        f"  failures: job MTBF {result['job_mtbf_hours']:,.1f} h (node MTBF {inputs.node_mtbf_hours:,.0f} h); "
        f"checkpoints at {inputs.checkpoint_bandwidth / 1e9:g} GB/s per rank, "
        f"{inputs.store_bandwidth / 1e9:g} GB/s into the store; a restart reads at "
        f"{result['node_read_bandwidth'] / 1e9:,.2f} GB/s per node (index "
        f"{_gb(result['index_bytes_per_node'])} per node, warm-up {inputs.warmup_s:g} s):"
    ]
    for stage, c in result["checkpoint"].items():
        window, restart = c["intervals_within_target_s"], c["restart"]
        within = (
            f"{window[0] / 60:,.1f}-{window[1] / 60:,.1f} min keeps lost work <= {inputs.target_lost_fraction:.1%}"
            if window
            else f"no interval keeps lost work under {inputs.target_lost_fraction:.1%}"
        )
        lines.append(
            f"    ZeRO-{stage}: {_gb(c['busiest_rank_bytes'])} on the busiest rank, "
            f"{c['total_bytes'] / 1e9:,.1f} GB in all, written in {c['write_s']:,.1f} s; restart "
            f"{restart['total_s']:,.0f} s (index {restart['index_s']:,.1f} s, checkpoint "
            f"{restart['checkpoint_s']:,.1f} s, warm-up {restart['warmup_s']:g} s); Young interval "
            f"{c['young_interval_s'] / 60:,.1f} min (loses {c['lost_fraction_at_young']:.2%}); {within}"
        )
    return lines


def _host_memory_lines(inputs: PlanInput, result: dict) -> list[str]:
    cache = result["cache"]
    lines = [
        f"  host memory per rank (busiest; node cache {_gb(cache['peak_bytes'])} at peak, {cache['ahead']} "
        f"shard(s) ahead{', too small: some shards stream from the store' if cache['streams'] else ''}; "
        f"{inputs.index_bytes_per_sample} index bytes per "
        f"sample), vs {inputs.node_ram_bytes / 1e12:g} TB per node:"
    ]
    for stage, h in result["host_memory"].items():
        r = h["per_rank"]
        lines.append(
            f"    ZeRO-{stage}: {_gb(r['total'])} per rank (index {_gb(r['index'])}, cache {_gb(r['cache'])}, "
            f"offload {_gb(r['offload'])}, checkpoint staging {_gb(r['staging'])}, eval weights "
            f"{_gb(r['eval'])}); {_gb(h['per_node'])} per node, "
            f"{'fits' if h['fits'] else 'OVER the node RAM'}"
        )
    return lines
