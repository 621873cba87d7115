"""Resuming at another world size: a checkpoint as DeepSpeed's universal checkpoint, converted
once for the whole job and shared through the store (the Checkpointer's restore calls
`fetch_universal`).

If `tag`/universal.json exists, the universal checkpoint beside the checkpoint is used as it is.
Otherwise rank 0 alone fetches the whole checkpoint, runs ds_to_universal and publishes the result
there, its marker last (a job that does not own the run, checkpoint.save=false, may not write it:
then every node fetches the whole checkpoint and converts it for itself). Each node's leader then
fetches only what its ranks read: what DeepSpeed's universal loading opens per rank is the
model-states file (under ZeRO-1/2 the whole module in its training dtype, M bytes; under ZeRO-3
rank 0's, small), zero/optimizer_state.pt (small), and under ZeRO-1/2 the fp32, exp_avg and
exp_avg_sq files of only the parameters with a fragment in the rank's partition (about 1/R of
them, whole tensors), under ZeRO-3 those of every parameter (each rank reads every full tensor and
keeps its slice). Per node, with L ranks of R and U = 12 bytes per parameter: rank 0's node
downloads the checkpoint once and converts it; every other node downloads about M + U*L/R under
ZeRO-1/2, U under ZeRO-3, plus rank 0's state files; none converts. A node's failed fetch makes
rank 0 read the published copy once against its marker: converted and published again only if it
is bad there, else fetched again (other jobs may be reading it). Host memory: the marker (one line
per file) and every rank's parameter names (about P + R names in all) are gathered on every rank.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import subprocess
import sys
from typing import TYPE_CHECKING

from vitforge.core import CheckpointError

from .checkpoint_files import SHARED_STATE, needed_files, rank_state, universal_files, universal_reads, versions
from .distributed import agree, all_ok
from .run_store import UNIVERSAL

if TYPE_CHECKING:
    from .checkpoint import Checkpointer

log = logging.getLogger("vitforge.checkpoint")


def fetch_universal(ckpt: Checkpointer, engine, tag: str, manifest: dict) -> tuple[str, str]:
    """Collective. `tag`, saved at another world size, as a universal checkpoint on every node
    (published beside it in the store, or converted here): returns (load dir, DeepSpeed tag)."""
    node_ranks, leader = ckpt.this_node()
    marker, retried = agree(lambda: ckpt.run.universal(tag)), False
    while True:
        converted = ""
        if marker is None:
            if not agree(lambda: ckpt.lease is not None and ckpt.lease.version is not None):
                return all_ok(lambda: convert(ckpt, tag, manifest) if leader else "")[node_ranks[0]], UNIVERSAL
            converted, marker = _convert_and_publish(ckpt, tag, manifest)
        reads = all_ok(lambda: universal_reads(engine.optimizer))
        node_reads = None if any(reads[r] is None for r in node_ranks) else set().union(*(reads[r] for r in node_ranks))
        fetch = functools.partial(_fetch_for_node, ckpt, tag, manifest, marker, node_reads, converted, leader)
        try:
            return all_ok(fetch)[node_ranks[0]], UNIVERSAL
        except CheckpointError as e:
            if converted or retried:
                raise
            retried = True
            marker = _published_copy_checked(ckpt, tag, e)


def _convert_and_publish(ckpt: Checkpointer, tag: str, manifest: dict) -> tuple[str, dict]:
    """Rank 0 converts `tag` and publishes the result beside it, its marker last: (rank 0's folder
    holding universal/, the marker), on every rank."""
    # Two collectives, so the other ranks' longest wait is one step, not both (DeepSpeed's
    # process-group timeout, 30 minutes by default, bounds each).
    converted = agree(lambda: convert(ckpt, tag, manifest))
    about = {"converted_from_world_size": manifest["world_size"], "versions": versions()}
    marker = agree(lambda: ckpt.run.publish_universal(tag, os.path.join(converted, UNIVERSAL), about))
    log.info("published it as %s", ckpt.run.object_url(f"{tag}/{UNIVERSAL}"))
    return converted, marker


def _fetch_for_node(
    ckpt: Checkpointer,
    tag: str,
    manifest: dict,
    marker: dict,
    node_reads: set[str] | None,
    converted: str,
    leader: bool,
) -> str:
    """On a node's leader: rank 0's state files and the universal files the node's ranks read
    (`node_reads`; None: all), fetched; returns the folder holding `tag`/ (elsewhere "")."""
    if not leader:
        return ""
    if ckpt.rank == 0 and converted:
        return converted  # rank 0's node holds the whole conversion (and the checkpoint) already
    shutil.rmtree(ckpt.download_dir, ignore_errors=True)
    ckpt.fetch_files(tag, [n for n in (rank_state(0), SHARED_STATE) if n in manifest["files"]], manifest)
    return os.path.join(ckpt.fetch_files(tag, universal_files(marker["files"], node_reads), marker), tag)


def _published_copy_checked(ckpt: Checkpointer, tag: str, error: CheckpointError) -> dict | None:
    """After a node's fetch failed: the published copy's marker when rank 0 finds the copy good in
    the store (fetch it again), None when it is bad (convert again)."""
    # A published copy gone bad does not condemn the checkpoint: it is converted again. But
    # other jobs (an eval, a checkpoint.save=false job) may be reading it, and republishing
    # deletes it first: so only if rank 0 finds it bad, not because one node's fetch failed
    # (a byte flipped on its way, or another job published it anew since the marker was read).
    marker, problems = agree(lambda: ckpt.run.universal_problems(tag))
    if problems:
        log.warning(
            "the universal checkpoint beside %s is unusable: %s; converting again",
            ckpt.run.object_url(tag),
            problems[0],
        )
        return None
    log.warning(
        "fetching the universal checkpoint beside %s failed (%s), but it checks out in the store; fetching it again",
        ckpt.run.object_url(tag),
        error,
    )
    return marker


def convert(ckpt: Checkpointer, tag: str, manifest: dict) -> str:
    """Fetch every file of `tag` to this node and run DeepSpeed's ds_to_universal on it in staging
    (never in the store); returns the folder holding universal/."""
    shutil.rmtree(ckpt.download_dir, ignore_errors=True)
    source = ckpt.fetch_files(tag, needed_files(sorted(manifest["files"]), set(), True), manifest)
    target = os.path.join(ckpt.staging, "converted", tag)
    shutil.rmtree(target, ignore_errors=True)
    command = [
        sys.executable,
        "-m",
        "deepspeed.checkpoint.ds_to_universal",
        "--input_folder",
        os.path.join(source, tag),
        "--output_folder",
        os.path.join(target, UNIVERSAL),
        "--inject_missing_state",
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise CheckpointError(f"ds_to_universal failed on {ckpt.run.object_url(tag)}: {result.stderr.strip()[-1000:]}")
    log.info(
        "ran ds_to_universal on rank %d: converted %s (saved at %d ranks) to a universal checkpoint",
        ckpt.rank,
        ckpt.run.object_url(tag),
        manifest["world_size"],
    )
    return target
