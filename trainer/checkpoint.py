"""Save and restore everything a run needs to continue exactly, through an object store.

The run's state is DeepSpeed's (model, optimiser) plus the named parts the Checkpointer is handed
(state.StateParts: the loader position, RNG, EMA, ...).

Save (collective): every rank writes its DeepSpeed files and its per-rank parts (rank 0 also the
shared ones) to node-local staging, and training continues at once; a background uploader per rank sends them
to DIR/RUN/step_N/ and writes a receipt. Rank 0's uploader waits for every receipt, writes
manifest.json, renews the run's lease and moves `latest`, then applies retention. At most one
upload is in flight per rank: the next save waits for it (and says how long).

Restore (collective): rank 0 picks candidates (newest complete first); each node fetches the files
its ranks need and checks their sha256 BEFORE anything unpickles them; if any rank finds a
problem, all ranks fall back to the previous checkpoint together, saying why. A checkpoint saved
at another world size is converted once for the job (rank 0, DeepSpeed's ds_to_universal, in its
node-local staging) and published beside it in the store, where every later resume at any world
size finds it; each node then fetches only the universal files its ranks read (universal.py).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from vitforge.core import CheckpointError, StorageError, __version__

from .checkpoint_files import SHARED_STATE, needed_files, rank_state, versions
from .distributed import agree, all_ok, together
from .lease import Lease
from .run_store import LATEST, MANIFEST, MANIFEST_VERSION, METRICS, RECEIPTS, RunStore, tag_for
from .state import RankBound, StateParts
from .universal import fetch_universal
from .uploader import Uploader

log = logging.getLogger("vitforge.checkpoint")
CLAIM_SLICE_S = 2.0  # the longest one collective waits while rank 0 watches another job's lease


@dataclass
class Restored:
    step: int
    tag: str
    manifest: dict
    resharded: bool  # saved at another world size
    per_rank: dict  # the saved per-rank parts this rank loads (rank 0's when resharded), by name
    shared: dict  # the saved shared parts, by name


class Checkpointer:
    def __init__(
        self,
        run_url: str,
        staging: str | None,
        keep_last: int | None,
        keep_every: int | None,
        lease_minutes: float,
        upload_timeout_minutes: float,
        metrics_path: str | None,
        parts: StateParts | None = None,
    ):
        self.run = RunStore(run_url)
        self.parts = parts or StateParts()
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        base = staging or tempfile.gettempdir()
        # One staging folder per run on each node, one subfolder per rank: ranks never share files.
        self.staging = os.path.join(base, "vitforge-ckpt", re.sub(r"[^A-Za-z0-9_.-]", "_", self.run.url))
        # Where a restore's files lie on this node: the store itself when local, else downloaded here.
        self.download_dir = os.path.join(self.staging, "restore")
        self.restored_files = self.run.store.local_path("") or self.download_dir
        self.keep_last, self.keep_every = keep_last, keep_every
        self.upload_timeout = upload_timeout_minutes * 60
        # The metrics travel with the checkpoints, unless they are written in the run folder already.
        in_run = self.run.store.local_path(METRICS)
        same = (
            in_run is not None
            and metrics_path is not None
            and os.path.realpath(in_run) == os.path.realpath(metrics_path)
        )
        self.metrics_path = None if same else metrics_path
        self.uploader = Uploader()
        self.lease = Lease(self.run, lease_minutes) if self.rank == 0 else None
        self.last_stall: dict = {}
        self.known_tags: set[str] = set()  # rank 0: step folders in the store, so a save needs no listing

    # -- ownership ---------------------------------------------------------------------------
    def claim(self) -> None:
        """Rank 0 takes the run's lease and cleans what dead attempts left; all ranks get its verdict.
        Judging another job's holder takes up to a lease period of watching: rank 0 watches in
        slices, so no collective waits for it longer than one slice (collective_timeout_s may be short)."""
        while True:
            taken, note = agree(lambda: self.lease.try_acquire(CLAIM_SLICE_S))
            if taken:
                break

        def take():
            if note:
                log.warning("%s", note)
            incomplete, aborted = self.run.clean_incomplete()
            folders = self.run.step_folders()
            self.known_tags.update(folders)
            with_manifest = [tag for tag, files in folders.items() if MANIFEST in files]
            if self.lease.checkpoints is None:  # a run from before the published list: its manifests count
                self.lease.checkpoints = dict.fromkeys(with_manifest)
            unpublished = [tag for tag in with_manifest if tag not in self.lease.checkpoints]
            if unpublished:
                log.warning(
                    "%s: %s have a manifest but were never published by the run's holder (a stale "
                    "copy's, written after the run was taken over): never resumed from",
                    self.run.url,
                    ", ".join(unpublished),
                )
            if incomplete or aborted:
                log.info(
                    "removed what earlier attempts left unfinished: %s%s",
                    ", ".join(incomplete) or "",
                    f" ({aborted} unfinished uploads aborted)" if aborted else "",
                )
            self.lease.start_heartbeat()

        agree(take)

    def release(self) -> None:
        if self.lease is not None:
            self.lease.release()

    # -- saving ------------------------------------------------------------------------------
    def save(self, engine, step: int, manifest_extra: dict) -> None:
        """Collective. Returns once the local write is done; the upload continues in the background."""
        waited = self.uploader.wait()
        if waited > 0.05:
            log.info("checkpoint at step %d waited %.1f s for the previous upload", step, waited)
        start = time.perf_counter()
        tag = tag_for(step)
        if self.rank == 0 and tag in self.known_tags:
            # Saving a step again (after falling back past it): the old folder goes first (its
            # manifest before its files), so stale receipts can never be mixed into the new checkpoint.
            # No rank uploads before DeepSpeed's save below ends in a barrier.
            self.lease.forget([tag])
            self.run.delete_tags([tag])
        self.known_tags.add(tag)
        folder = os.path.join(self.staging, f"rank{self.rank}")
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder, exist_ok=True)
        write_start = time.perf_counter()
        engine.save_checkpoint(folder, tag=tag, client_state={"step": step}, save_latest=False)
        deepspeed_s = time.perf_counter() - write_start
        torch.save(
            {name: part.state_dict() for name, part in self.parts.per_rank.items()},
            os.path.join(folder, tag, rank_state(self.rank)),
        )
        if self.rank == 0 and self.parts.shared:
            torch.save(
                {name: part.state_dict() for name, part in self.parts.shared.items()},
                os.path.join(folder, tag, SHARED_STATE),
            )
        metrics = None
        if self.rank == 0 and self.metrics_path and os.path.exists(self.metrics_path):
            metrics = os.path.join(folder, METRICS)
            shutil.copyfile(self.metrics_path, metrics)
        # write_s: the whole stall of this save; deepspeed_s: DeepSpeed's local write within it.
        self.last_stall = {"wait_s": waited, "write_s": time.perf_counter() - start, "deepspeed_s": deepspeed_s}
        manifest = {"step": step, "world_size": self.world_size, **manifest_extra}
        self.uploader.start(lambda: self._upload(folder, tag, manifest, metrics))

    def wait(self) -> None:
        """Block until every upload of this rank (and, on rank 0, the manifest and `latest`) is done."""
        self.uploader.wait()

    def _upload(self, folder: str, tag: str, manifest: dict, metrics: str | None) -> None:
        files = self.run.upload_folder(os.path.join(folder, tag), tag)
        self.run.put_bytes(f"{tag}/{RECEIPTS}/rank{self.rank}.json", json.dumps({"files": files}).encode())
        if self.rank == 0:
            self._finalize(tag, manifest, metrics)
        shutil.rmtree(folder, ignore_errors=True)

    def _finalize(self, tag: str, manifest: dict, metrics: str | None) -> None:
        deadline = time.monotonic() + self.upload_timeout
        while True:
            receipts = self.run.receipts(tag)
            if len(receipts) >= self.world_size:
                break
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.world_size)) - set(receipts))
                raise StorageError(
                    f"{self.run.object_url(tag)}: ranks {missing} did not finish uploading within "
                    f"{self.upload_timeout / 60:.0f} minutes"
                )
            time.sleep(0.2)
        files = {name: meta for r in sorted(receipts) for name, meta in receipts[r]["files"].items()}
        manifest = {
            "manifest_version": MANIFEST_VERSION,
            "created_by": f"vitforge {__version__}",
            "versions": versions(),
            "files": dict(sorted(files.items())),
            "run_id": self.lease.run_id,
            "epoch": self.lease.epoch,
            **manifest,
        }
        # Ownership checked before the manifest is written, and the checkpoint published (its tag
        # listed in the lease) in a write conditional on this job's lease version: a copy that lost
        # the run, even one whose manifest landed after the takeover, publishes nothing.
        self.lease.refresh()
        self.run.put_bytes(f"{tag}/{MANIFEST}", json.dumps(manifest, indent=1, sort_keys=True).encode())
        if metrics:
            self.run.upload(metrics, METRICS)
        self.lease.publish(tag)
        self.run.put_bytes(LATEST, tag.encode())
        deleted = self.run.retention(self.keep_last, self.keep_every, tag)
        self.lease.forget(deleted)
        log.info(
            "checkpoint %s complete%s",
            self.run.object_url(tag),
            f"; retention removed {', '.join(deleted)}" if deleted else "",
        )

    # -- restoring ---------------------------------------------------------------------------
    def restore(self, engine_for, resume, check=None) -> tuple[Any, Restored | None]:  # (a DeepSpeed engine, ...)
        """Collective. `engine_for(universal: bool)` builds the engine (DeepSpeed must know at
        construction whether it will load a universal checkpoint). Loads the parts from the first
        usable checkpoint; returns (engine, restored or None). `check(manifest, url)`, a function of
        the manifest alone run before a candidate is loaded, may refuse it for good (raising
        anything but a CheckpointError)."""
        candidates = agree(lambda: self.run.candidates(resume))
        if not candidates:
            return engine_for(False), None
        engine, universal = None, None

        def attempt(tag: str) -> tuple[Any, Restored]:
            nonlocal engine, universal
            manifest = agree(lambda: self.run.manifest(tag))
            if check is not None:
                try:
                    check(manifest, self.run.object_url(tag))
                except Exception as e:  # of the agreed manifest alone: every rank raises it here
                    together(e)
                    raise
            resharded = manifest["world_size"] != self.world_size
            if resharded != universal:  # built first: which universal files a rank reads depends on it
                engine, universal = engine_for(resharded), resharded
            load_dir, ds_tag = (
                fetch_universal(self, engine, tag, manifest) if resharded else (self._fetch(tag, manifest), tag)
            )
            return engine, self._load(engine, load_dir, ds_tag, tag, manifest, resharded)

        engine, restored = self.run.first_usable(
            candidates,
            attempt,
            explicit=resume not in ("auto", "never"),
            advice="; set checkpoint.resume=never to start afresh",
        )
        # After the choice: a part that refuses its state (the loader, for another dataset) is an
        # error of this run, not a reason to fall back to an older checkpoint.
        self._load_parts(restored)
        return engine, restored

    def this_node(self) -> tuple[list[int], bool]:
        """This node's ranks (those sharing this host and staging folder, so its files) and whether
        this rank is their leader. Gathers one (host, staging path) per rank: R short strings."""
        mine = (socket.gethostname(), os.path.realpath(self.staging))
        nodes = [None] * self.world_size
        dist.all_gather_object(nodes, mine)
        ranks = [r for r, node in enumerate(nodes) if node == mine]
        return ranks, ranks[0] == self.rank

    def _fetch(self, tag: str, manifest: dict) -> str:
        """Every node's first rank fetches (and checks) the files its ranks need; all agree on the result.
        Returns the folder holding `tag`/."""
        node_ranks, leader = self.this_node()

        def fetch() -> str:
            if not leader:
                return ""
            shutil.rmtree(self.download_dir, ignore_errors=True)
            return self.fetch_files(tag, needed_files(sorted(manifest["files"]), set(node_ranks), False), manifest)

        return all_ok(fetch)[node_ranks[0]]

    def fetch_files(self, tag: str, names: list[str], listing: dict) -> str:
        """RunStore.fetch into this node's download folder, saying how much came over the network."""
        where = self.run.fetch(tag, names, listing, self.download_dir)
        if self.run.store.local_path("") is None:
            log.info(
                "fetched %d files, %d bytes of %s to this node (rank %d)",
                len(names),
                sum(listing["files"][n]["bytes"] for n in names),
                self.run.object_url(tag),
                self.rank,
            )
        return where

    def _load(self, engine, load_dir: str, ds_tag: str, tag: str, manifest: dict, resharded: bool) -> Restored:
        def load():
            path, _ = engine.load_checkpoint(load_dir, tag=ds_tag, load_module_strict=True)
            if path is None:
                raise CheckpointError(f"{self.run.object_url(tag)}: DeepSpeed could not load the checkpoint")
            base = os.path.join(self.restored_files, tag)
            per_rank = torch.load(os.path.join(base, rank_state(0 if resharded else self.rank)), weights_only=False)
            shared_path = os.path.join(base, SHARED_STATE)
            shared = torch.load(shared_path, weights_only=False) if os.path.exists(shared_path) else {}
            return per_rank, shared

        try:
            per_rank, shared = load()
        except RuntimeError as e:  # a size mismatch: the checkpoint is of another model
            raise CheckpointError(f"{self.run.object_url(tag)}: does not fit this model: {_first_line(e)}") from None
        return Restored(manifest["step"], tag, manifest, resharded, per_rank, shared)

    def _load_parts(self, restored: Restored) -> None:
        """Every part from its saved state. At another world size a RankBound part restarts from a
        seed of (the run's seed, step, rank) instead. A part the checkpoint lacks (added since it
        was saved) keeps its fresh state."""
        seed = (
            restored.manifest["config"]["train"]["seed"] + 1000003 * restored.step + self.rank
            if restored.resharded
            else None
        )
        for saved, parts, per_rank in (
            (restored.per_rank, self.parts.per_rank, True),
            (restored.shared, self.parts.shared, False),
        ):
            for name, part in parts.items():
                if seed is not None and per_rank and isinstance(part, RankBound):
                    part.restart(seed)
                elif name in saved:
                    part.load_state_dict(saved[name])
                else:
                    log.info("%s holds no %r state: it starts fresh", self.run.object_url(restored.tag), name)


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
