"""Weight consolidation's last leg across CPU ranks (issue 18): consolidated weights on rank 0 (or,
before, on every rank) reaching every rank, as fine-tune init and eval move them.

    python benchmarks/weights_bench.py [--mb 256] [--ranks 2,4]

Paths: "all_gather_object" is how fine-tune init moved them (every rank loaded the whole state,
then all_ok gathered every rank's copy to every rank), "broadcast_object" how eval did (agree:
one pickled object), "tensor_by_tensor" how both do now (distributed.broadcast_state into each
rank's own model; rank 0 alone holds the state). Per rank: the peak RSS above what the rank held
before the move (its model, or the state), and the seconds the move took.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import resource
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.common import FORK_HELP, preload  # noqa: E402

PATHS = ("all_gather_object", "broadcast_object", "tensor_by_tensor")
# How the ranks start: a fresh interpreter each, as a job's ranks do; "fork" where the process that
# starts them holds torch already (a smoke run's: its imports are then not paid once per rank).
START_METHOD = "spawn"


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _rank(rank: int, ranks: int, port: int, state_mb: float, tensor_mb: float, path: str, results) -> None:
    import torch
    import torch.distributed as dist

    from vitforge.trainer.distributed import agree, all_ok, broadcast_state

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=ranks)
    count = max(1, round(state_mb / tensor_mb))
    numel = int(state_mb * 2**20 / 4 / count)
    holds = rank == 0 or path == "all_gather_object"  # every rank downloaded the checkpoint before
    # the state (rank 0's checkpoint) or this rank's model: written, so its pages are resident
    state = {f"blocks.{i}.weight": torch.full((numel,), float(i if holds else -1)) for i in range(count)}
    dist.barrier()
    before, started = _rss_mb(), time.perf_counter()
    if path == "all_gather_object":
        received = all_ok(lambda: state)[rank]
    elif path == "broadcast_object":
        received = agree(lambda: state)
    else:
        with torch.no_grad():
            broadcast_state(state if rank == 0 else None, torch.device("cpu"),
                            lambda name, tensor: state[name].copy_(tensor))
        received = state
    dist.barrier()
    seconds = time.perf_counter() - started
    assert received[f"blocks.{count - 1}.weight"][0].item() == count - 1  # rank 0's values arrived
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    results.put((rank, seconds, max(peak - before, 0.0), peak))
    dist.destroy_process_group()


def measure_weight_move(state_mb: float, ranks: int, path: str = "tensor_by_tensor",
                        tensor_mb: float = 16.0) -> dict:
    """Move a synthetic fp32 state of `state_mb` MB (tensors of `tensor_mb`, ViT-H/14's largest is 26)
    from rank 0 to `ranks` gloo CPU processes along `path` (one of PATHS). Returns {"path", "ranks",
    "state_mb", "seconds" (the slowest rank), "peak_extra_mb" and "peak_rss_mb" (lists, per rank)}."""
    if path not in PATHS:
        raise ValueError(f"path {path!r}: one of {', '.join(PATHS)}")
    from vitforge.core import free_port

    context = multiprocessing.get_context(START_METHOD)
    results = context.Queue()
    port = free_port()
    processes = [context.Process(target=_rank, args=(r, ranks, port, state_mb, tensor_mb, path, results))
                 for r in range(ranks)]
    for p in processes:
        p.start()
    rows = sorted(results.get(timeout=600) for _ in processes)
    for p in processes:
        p.join()
    return {"path": path, "ranks": ranks, "state_mb": state_mb, "seconds": max(r[1] for r in rows),
            "peak_extra_mb": [round(r[2]) for r in rows], "peak_rss_mb": [round(r[3]) for r in rows]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=float, default=256)
    p.add_argument("--ranks", default="2,4")
    p.add_argument("--fork", action="store_true", help=FORK_HELP)
    args = p.parse_args()
    if args.fork:
        global START_METHOD
        preload("torch", "vitforge.trainer.distributed")
        START_METHOD = "fork"
    for ranks in (int(r) for r in args.ranks.split(",")):
        for path in PATHS:
            row = measure_weight_move(args.mb, ranks, path)
            print(f"{args.mb:.0f} MB, {ranks} ranks, {path:18s}: {row['seconds']:.2f} s, peak above what a rank held "
                  f"(rank 0, others) {row['peak_extra_mb'][0]} / {max(row['peak_extra_mb'][1:])} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
