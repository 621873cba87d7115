"""One checkpoint interface: save and resume everything a run needs to continue exactly.

A run saved at one world size resumes at another through DeepSpeed's universal checkpoint
conversion, done on demand (ZeRO 1-3; not between ZeRO-2 and ZeRO-3, which DeepSpeed does not support).

Layout: RUN/step_NNNNNNNN/ holds DeepSpeed's own files, one `rank{r}_state.pt` per rank (loader
position and RNG states: DeepSpeed keeps only rank 0's client state under ZeRO-1/2), the EMA
weights when used, and `manifest.json` (every file with size and sha256, step, world size, ZeRO
stage, config), written after everything else. RUN/latest names the newest tag and is written
after its manifest: a checkpoint without a manifest does not exist.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys

import numpy as np
import torch
import torch.distributed as dist

MANIFEST = "manifest.json"
LATEST = "latest"


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(run_dir: str, engine, step: int, extra_per_rank: dict, shared: dict, config: dict) -> str:
    """Collective: every rank must call it (DeepSpeed's save hangs otherwise)."""
    tag = tag_for(step)
    rank = dist.get_rank()
    engine.save_checkpoint(run_dir, tag=tag, client_state={"step": step}, save_latest=False)
    folder = os.path.join(run_dir, tag)
    _atomic_torch_save({**extra_per_rank, "rng": rng_state()}, os.path.join(folder, f"rank{rank}_state.pt"))
    if rank == 0 and shared:
        _atomic_torch_save(shared, os.path.join(folder, "shared_state.pt"))
    dist.barrier()
    if rank == 0:
        files = {}
        for root, _, names in os.walk(folder):
            for name in sorted(names):
                path = os.path.join(root, name)
                files[os.path.relpath(path, folder)] = {"bytes": os.path.getsize(path), "sha256": _sha256(path)}
        manifest = {"step": step, "world_size": dist.get_world_size(), "zero_stage": engine.zero_optimization_stage(),
                    "config": config, "files": files}
        _atomic_write(os.path.join(folder, MANIFEST), json.dumps(manifest, indent=1, sort_keys=True).encode())
        _atomic_write(os.path.join(run_dir, LATEST), tag.encode())
    dist.barrier()
    return tag


def latest(run_dir: str) -> str | None:
    """The newest complete checkpoint's tag, or None."""
    try:
        with open(os.path.join(run_dir, LATEST)) as f:
            tag = f.read().strip()
    except FileNotFoundError:
        return None
    if not os.path.exists(os.path.join(run_dir, tag, MANIFEST)):
        raise RuntimeError(f"{run_dir}/{LATEST} names {tag}, which has no {MANIFEST}: the checkpoint is incomplete")
    return tag


def read_manifest(run_dir: str, tag: str) -> dict:
    with open(os.path.join(run_dir, tag, MANIFEST)) as f:
        return json.load(f)


def to_universal(run_dir: str, tag: str) -> str:
    """Convert a checkpoint for another world size with DeepSpeed's ds_to_universal (once, on rank 0,
    into a temporary folder renamed when complete); every rank waits for it. Returns the new tag."""
    universal = f"{tag}_universal"
    target = os.path.join(run_dir, universal)
    if dist.get_rank() == 0 and not os.path.isdir(target):
        partial = f"{target}.partial-{os.getpid()}"
        command = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                   os.path.join(run_dir, tag), "--output_folder", partial, "--inject_missing_state"]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"ds_to_universal failed on {run_dir}/{tag}: {result.stderr.strip()[-2000:]}")
        os.replace(partial, target)
        # ds_to_universal points RUN/latest_universal at the folder it wrote: the temporary name.
        _atomic_write(os.path.join(run_dir, "latest_universal"), universal.encode())
    dist.barrier()
    return universal


def load(run_dir: str, tag: str, engine) -> tuple[int, dict, dict]:
    """Restore model, optimizer and DeepSpeed state; return (step, this rank's state, shared state).

    At another world size (the engine built with `load_universal`), the weights and optimizer
    state come from the universal conversion; the loader position is rank-independent, so rank
    0's is used by all; RNG states are reseeded from (seed, step, rank)."""
    manifest = read_manifest(run_dir, tag)
    resharded = manifest["world_size"] != dist.get_world_size()
    path, _ = engine.load_checkpoint(run_dir, tag=to_universal(run_dir, tag) if resharded else tag)
    if path is None:
        raise RuntimeError(f"{run_dir}/{tag}: DeepSpeed could not load the checkpoint")
    folder = os.path.join(run_dir, tag)
    rank = dist.get_rank() if not resharded else 0
    mine = torch.load(os.path.join(folder, f"rank{rank}_state.pt"), weights_only=False)
    shared_path = os.path.join(folder, "shared_state.pt")
    shared = torch.load(shared_path, weights_only=False) if os.path.exists(shared_path) else {}
    saved_rng = mine.pop("rng")
    if resharded:
        seed = manifest["config"]["train"]["seed"] + 1000003 * manifest["step"] + dist.get_rank()
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)
    else:
        set_rng_state(saved_rng)
    return manifest["step"], mine, shared


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _atomic_torch_save(obj, path: str) -> None:
    tmp = f"{path}.partial-{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _atomic_write(path: str, data: bytes) -> None:
    tmp = f"{path}.partial-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
