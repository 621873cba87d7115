"""A checkpoint's files: which each rank writes, which each rank reads back to resume (at the
same world size, or from a universal checkpoint at another), and the software versions its
manifests record."""

from __future__ import annotations

import os
import re
import sys

import torch

from vitforge.core import __version__

from .run_store import RECEIPTS

RANK_FILE = re.compile(r"(?:zero_pp_rank_|^rank)(\d+)_")
SHARED_STATE = "shared_state.pt"  # the shared parts, written by rank 0


def rank_state(rank: int) -> str:
    """The file of a rank's own parts."""
    return f"rank{rank}_state.pt"


def universal_reads(optimizer) -> set[str] | None:
    """The parameters whose universal-checkpoint files (zero/NAME/*.pt) this rank's DeepSpeed
    optimizer opens: under ZeRO-1/2 (and bf16 without ZeRO) only those with a fragment in the rank's
    partition (`_hp_mapping`), about 1/R of them; None, meaning all, under ZeRO-3 (each rank reads
    every full tensor and keeps its slice) or any optimizer that does not say. Needs the engine built."""
    groups = getattr(optimizer, "bit16_groups", None) or getattr(optimizer, "bf16_groups", None)
    names = getattr(optimizer, "param_names", None)
    if groups is None or names is None:
        return None
    return {names[p] for group in groups for p in group if getattr(p, "_hp_mapping", None) is not None}


def universal_files(files: dict, params: set[str] | None) -> list[str]:
    """Of a published universal checkpoint's files (universal/...), those that ranks reading the
    parameters `params` (None: all) open: the model-states file DeepSpeed loads (rank 0's under
    ZeRO-3; the other ranks' copies are never read), zero/optimizer_state.pt, and zero/NAME/* of each
    parameter read."""
    keep = []
    for name in sorted(files):
        parts = name.split("/")
        if len(parts) == 2:
            match = RANK_FILE.search(parts[1])
            if match is None or int(match.group(1)) == 0:
                keep.append(name)
        elif len(parts) == 3 or params is None or parts[2] in params:
            keep.append(name)
    return keep


def needed_files(names: list[str], ranks: set[int], everything: bool) -> list[str]:
    """The files the given ranks read to resume: shared ones plus their own (all for a conversion)."""
    if everything:
        return [n for n in names if not n.startswith(f"{RECEIPTS}/")]
    keep = []
    for name in names:
        match = RANK_FILE.search(os.path.basename(name))
        if match is None or int(match.group(1)) in ranks:
            keep.append(name)
    return keep


def versions() -> dict:
    """The software a checkpoint was written (or converted) with, as its manifest records it."""
    import deepspeed
    import timm

    return {
        "vitforge": __version__,
        "torch": torch.__version__,
        "deepspeed": deepspeed.__version__,
        "timm": timm.__version__,
        "python": sys.version.split()[0],
    }
