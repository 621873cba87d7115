"""Save and restore everything a run needs to continue exactly, through an object store.

Save (collective): every rank writes its DeepSpeed files and its own state (loader position, RNG)
to node-local staging, and training continues at once; a background uploader per rank sends them
to DIR/RUN/step_N/ and writes a receipt. Rank 0's uploader waits for every receipt, writes
manifest.json, renews the run's lease and moves `latest`, then applies retention. At most one
upload is in flight per rank: the next save waits for it (and says how long).

Restore (collective): rank 0 picks candidates (newest complete first); each node fetches the files
its ranks need and checks their sha256 BEFORE anything unpickles them; if any rank finds a
problem, all ranks fall back to the previous checkpoint together, saying why. A checkpoint saved
at another world size is converted with DeepSpeed's universal checkpoint tool in node-local staging.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from vitforge.core import CheckpointError, StorageError, VitforgeError, __version__, sha256_file

from .distributed import agree, all_ok
from .run_store import LATEST, MANIFEST, MANIFEST_VERSION, METRICS, RECEIPTS, Lease, RunStore, tag_for

log = logging.getLogger("vitforge.checkpoint")
RANK_FILE = re.compile(r"(?:zero_pp_rank_|^rank)(\d+)_")


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


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


@dataclass
class Restored:
    step: int
    tag: str
    mine: dict  # this rank's state: loader position
    shared: dict  # rank 0's: EMA weights
    manifest: dict


class Uploader:
    """One background thread per rank; its failure is raised on the main thread at the next wait."""

    def __init__(self):
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self, work) -> None:
        def run():
            try:
                work()
            except BaseException as e:  # re-raised on the training thread
                self._error = e

        self._thread = threading.Thread(target=run, name="vitforge-upload", daemon=True)
        self._thread.start()

    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> float:
        """Block until the upload in flight is done; return the seconds waited."""
        start = time.perf_counter()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            if isinstance(error, VitforgeError):
                raise error
            raise StorageError(f"checkpoint upload failed: {type(error).__name__}: {error}") from error
        return time.perf_counter() - start


class Checkpointer:
    def __init__(self, run_url: str, staging: str | None, keep_last: int | None, keep_every: int | None,
                 lease_minutes: float, upload_timeout_minutes: float, metrics_path: str | None):
        self.run = RunStore(run_url)
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
        same = in_run is not None and metrics_path is not None and \
            os.path.realpath(in_run) == os.path.realpath(metrics_path)
        self.metrics_path = None if same else metrics_path
        self.uploader = Uploader()
        self.lease = Lease(self.run, lease_minutes) if self.rank == 0 else None
        self.last_stall: dict = {}
        self.known_tags: set[str] = set()  # rank 0: step folders in the store, so a save needs no listing

    # -- ownership ---------------------------------------------------------------------------
    def claim(self) -> None:
        """Rank 0 takes the run's lease and cleans what dead attempts left; all ranks get its verdict."""
        def take():
            note = self.lease.acquire()
            if note:
                log.warning("%s", note)
            incomplete, aborted = self.run.clean_incomplete()
            self.known_tags.update(self.run.step_folders())
            if incomplete or aborted:
                log.info("removed what earlier attempts left unfinished: %s%s", ", ".join(incomplete) or "",
                         f" ({aborted} unfinished uploads aborted)" if aborted else "")
            self.lease.start_heartbeat()

        agree(take)

    def release(self) -> None:
        if self.lease is not None:
            self.lease.release()

    # -- saving ------------------------------------------------------------------------------
    def save(self, engine, step: int, mine: dict, shared: dict, manifest_extra: dict) -> None:
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
            self.run.delete_tags([tag])
        self.known_tags.add(tag)
        folder = os.path.join(self.staging, f"rank{self.rank}")
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder, exist_ok=True)
        write_start = time.perf_counter()
        engine.save_checkpoint(folder, tag=tag, client_state={"step": step}, save_latest=False)
        deepspeed_s = time.perf_counter() - write_start
        torch.save({**mine, "rng": rng_state()}, os.path.join(folder, tag, f"rank{self.rank}_state.pt"))
        if self.rank == 0 and shared:
            torch.save(shared, os.path.join(folder, tag, "shared_state.pt"))
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
        root = os.path.join(folder, tag)
        names = sorted(os.path.relpath(os.path.join(d, n), root) for d, _, ns in os.walk(root) for n in ns)

        def one(name: str) -> tuple[str, dict]:
            path = os.path.join(root, name)
            with ThreadPoolExecutor(1) as hasher:  # hashing overlaps the upload: two reads of the page cache
                digest = hasher.submit(sha256_file, path)
                self.run.upload(path, f"{tag}/{name}")
                return name, {"bytes": os.path.getsize(path), "sha256": digest.result()}

        with ThreadPoolExecutor(4) as pool:
            files = dict(pool.map(one, names))
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
                raise StorageError(f"{self.run.object_url(tag)}: ranks {missing} did not finish uploading within "
                                   f"{self.upload_timeout / 60:.0f} minutes")
            time.sleep(0.2)
        files = {name: meta for r in sorted(receipts) for name, meta in receipts[r]["files"].items()}
        manifest = {"manifest_version": MANIFEST_VERSION, "created_by": f"vitforge {__version__}",
                    "versions": _versions(), "files": dict(sorted(files.items())), **manifest}
        self.run.put_bytes(f"{tag}/{MANIFEST}", json.dumps(manifest, indent=1, sort_keys=True).encode())
        if metrics:
            self.run.upload(metrics, METRICS)
        self.lease.refresh()  # ownership checked right before `latest` moves
        self.run.put_bytes(LATEST, tag.encode())
        deleted = self.run.retention(self.keep_last, self.keep_every, tag)
        log.info("checkpoint %s complete%s", self.run.object_url(tag),
                 f"; retention removed {', '.join(deleted)}" if deleted else "")

    # -- restoring ---------------------------------------------------------------------------
    def restore(self, engine_for, resume) -> tuple[object, Restored | None]:
        """Collective. `engine_for(universal: bool)` builds the engine (DeepSpeed must know at
        construction whether it will load a universal checkpoint). Returns (engine, restored or None)."""
        candidates = agree(lambda: self.run.candidates(resume))
        if not candidates:
            return engine_for(False), None
        engine, universal = None, None

        def attempt(tag: str) -> tuple[object, Restored]:
            nonlocal engine, universal
            manifest = agree(lambda: self.run.manifest(tag))
            resharded = manifest["world_size"] != self.world_size
            load_dir = self._fetch(tag, manifest, resharded)
            if resharded != universal:
                engine, universal = engine_for(resharded), resharded
            return engine, self._load(engine, load_dir, tag, manifest, resharded)

        return self.run.first_usable(candidates, attempt, explicit=resume not in ("auto", "never"),
                                     advice="; set checkpoint.resume=never to start afresh")

    def _fetch(self, tag: str, manifest: dict, everything: bool) -> str:
        """Every node's first rank fetches (and checks) the files its ranks need; all agree on the result."""
        hosts = [None] * self.world_size
        dist.all_gather_object(hosts, socket.gethostname())
        mine = socket.gethostname()
        node_ranks = {r for r, h in enumerate(hosts) if h == mine}
        leader = min(node_ranks) == self.rank

        def fetch() -> str:
            if not leader:
                return ""
            shutil.rmtree(self.download_dir, ignore_errors=True)
            names = needed_files(sorted(manifest["files"]), node_ranks, everything)
            return self.run.fetch(tag, names, manifest, self.download_dir)

        where = all_ok(fetch)
        load_dir = where[min(node_ranks)]
        if everything:
            load_dir = self._to_universal(load_dir, tag, leader)
        return load_dir

    def _to_universal(self, load_dir: str, tag: str, leader: bool) -> str:
        """DeepSpeed's ds_to_universal, once per node, into staging (never into the store)."""
        target = os.path.join(self.staging, "universal")

        def convert() -> str:
            if leader:
                shutil.rmtree(target, ignore_errors=True)
                command = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                           os.path.join(load_dir, tag), "--output_folder", os.path.join(target, f"{tag}_universal"),
                           "--inject_missing_state"]
                result = subprocess.run(command, capture_output=True, text=True)
                if result.returncode != 0:
                    raise CheckpointError(f"ds_to_universal failed on {self.run.object_url(tag)}: "
                                          f"{result.stderr.strip()[-1000:]}")
            return target

        all_ok(convert)
        log.info("converted %s (saved at another world size) to a universal checkpoint", self.run.object_url(tag))
        return target

    def _load(self, engine, load_dir: str, tag: str, manifest: dict, resharded: bool) -> Restored:
        def load():
            path, _ = engine.load_checkpoint(load_dir, tag=f"{tag}_universal" if resharded else tag,
                                             load_module_strict=True)
            if path is None:
                raise CheckpointError(f"{self.run.object_url(tag)}: DeepSpeed could not load the checkpoint")
            state_rank = 0 if resharded else self.rank
            base = os.path.join(self.restored_files, tag)
            mine = torch.load(os.path.join(base, f"rank{state_rank}_state.pt"), weights_only=False)
            shared_path = os.path.join(base, "shared_state.pt")
            shared = torch.load(shared_path, weights_only=False) if os.path.exists(shared_path) else {}
            return mine, shared

        try:
            mine, shared = load()
        except RuntimeError as e:  # a size mismatch: the checkpoint is of another model
            raise CheckpointError(f"{self.run.object_url(tag)}: does not fit this model: {_first_line(e)}") from None
        saved_rng = mine.pop("rng")
        if resharded:
            seed = manifest["config"]["train"]["seed"] + 1000003 * manifest["step"] + self.rank
            random.seed(seed)
            np.random.seed(seed % 2**32)
            torch.manual_seed(seed)
        else:
            set_rng_state(saved_rng)
        return Restored(manifest["step"], tag, mine, shared, manifest)


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _versions() -> dict:
    import deepspeed
    import timm

    return {"vitforge": __version__, "torch": torch.__version__, "deepspeed": deepspeed.__version__,
            "timm": timm.__version__, "python": sys.version.split()[0]}
