"""`build_loader`: the one entry point the trainer uses, whatever the backend.

A Loader yields one epoch per `iter()`, as Batches (backend.py documents each key). Its state is
(epoch, consumed): how many positions of the epoch's global order all ranks together have taken.
That is the same number on every rank, so any rank's state restores all of them, at the same or
another world size or batch size.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator

import torch

from vitforge.core import CheckpointError

from .backend import Backend, Batch, find_backend
from .index import DatasetError, DatasetIndex, load_index
from .order import RankSlice, partition_shards_of
from .reader import NodeFuture
from .spec import LoaderSpec

log = logging.getLogger("vitforge.pipeline")
# 2 added the partitions (a version 1 state is an order of one partition); 3 draws subsets per
# shard (a version 1 or 2 state with a subset resumes with its own, ranked subset).
STATE_VERSION = 3


def choose_backend(spec: LoaderSpec, device: torch.device) -> tuple[str, str]:
    """(backend, why): a registered backend's name; auto prefers DALI mixed decode, then DALI on the
    CPU, then torch."""
    if spec.backend != "auto":
        return spec.backend, "asked for"
    try:
        import nvidia.dali  # noqa: F401
    except ImportError as e:
        return "torch", f"DALI is not installed ({e})"
    if device.type == "cuda":
        return "dali", "DALI is installed and the device is a GPU: mixed (nvJPEG) decoding"
    return "dali-cpu", "DALI is installed but the device is not a GPU: DALI CPU decoding"


class Loader:
    def __init__(
        self,
        spec: LoaderSpec,
        index: DatasetIndex | None,
        backend: Backend,
        rank: int,
        world_size: int,
        num_samples: int,
        accumulation: int = 1,
        ranks_per_node: int = 1,
    ):
        self.spec, self.index, self.backend = spec, index, backend
        self.rank, self.world_size, self.num_samples = rank, world_size, num_samples
        self.accumulation, self.ranks_per_node = accumulation, ranks_per_node
        self.partitions = spec.partitions or world_size
        self._warn_if_spread()
        self.epoch = 0
        self.consumed = 0
        self.images = 0
        self.wait_seconds = 0.0
        self.started: float | None = None
        self.bad_keys: list[str] = []
        self.reads = {"requests": 0, "bytes": 0, "opens": 0, "fetches": 0}  # totals of the batches' "reads"
        # (start, images, wait seconds) when the current window began
        self._window: tuple[float | None, int, float] = (None, 0, 0.0)

    def __len__(self) -> int:
        """Batches left in the current epoch (the same on every rank)."""
        return self._slice().num_batches

    def _slice(self) -> RankSlice:
        return RankSlice(
            self.num_samples,
            self.consumed,
            self.rank,
            self.world_size,
            self.spec.batch_size,
            self.spec.epoch_end,
            self.accumulation,
            self.partitions,
            self.ranks_per_node,
        )

    def __iter__(self) -> Iterator[Batch]:
        rank_slice = self._slice()
        step = self.world_size * self.spec.batch_size
        batches = self.backend.batches(self.epoch, rank_slice)
        while True:
            asked = time.perf_counter()
            if self.started is None:
                self.started = asked
            try:
                batch = next(batches)
            except StopIteration:
                break
            self.wait_seconds += time.perf_counter() - asked
            self.consumed += step
            self.images += len(batch["label"])
            self.bad_keys += batch["bad"]
            for name, value in batch["reads"].items():
                self.reads[name] += value
            yield batch
        self.epoch += 1
        self.consumed = 0

    def state_dict(self) -> dict:
        # A run resumed from version 2 with a subset keeps drawing its subset that way, for good.
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "consumed": self.consumed,
            "seed": self.spec.seed,
            "num_samples": self.num_samples,
            "world_size": self.world_size,
            "dataset_version": self._version(),
            "batch_size": self.spec.batch_size,
            "partitions": self.partitions,
            "ranked_subset": bool(self.index is not None and self.index.ranked),
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") not in (1, 2, STATE_VERSION):
            raise CheckpointError(f"loader state version {state.get('version')} is not 1 to {STATE_VERSION}")
        partitions = state.get("partitions", 1)
        if partitions != self.partitions:
            if self.spec.partitions is not None:
                raise CheckpointError(
                    f"the run's order has {partitions} partitions, fixed when it started; "
                    f"data.partitions={self.spec.partitions} would change the order mid-run"
                )
            self.partitions = partitions
            self._warn_if_spread()
        self._same(state, "seed", self.spec.seed)
        if self._extended_since(state):
            return
        self._same(state, "num_samples", self.num_samples)
        if (state["world_size"], state["batch_size"]) != (self.world_size, self.spec.batch_size):
            log.info(
                "resuming at %d ranks x %d per batch a position saved at %d x %d: exact, from position %d",
                self.world_size,
                self.spec.batch_size,
                state["world_size"],
                state["batch_size"],
                state["consumed"],
            )
        ranked = state["version"] < 3 or state.get("ranked_subset", False)
        if ranked and self.index is not None and self.index.subset is not None and not self.index.ranked:
            log.info(
                "resuming a run whose subset was drawn as loader state version 2 drew them: its samples, "
                "ranked over the whole dataset once (O(samples), at this start only)"
            )
            self.index = self.backend.index = self.index.with_subset(self.spec.subset, self.spec.seed, ranked=True)
        self.epoch, self.consumed = state["epoch"], state["consumed"]

    @staticmethod
    def _same(state: dict, name: str, mine: int) -> None:
        if state[name] != mine:
            raise CheckpointError(
                f"loader state has {name}={state[name]}, this loader has {mine}: "
                "a different dataset or seed cannot resume this position"
            )

    def _version(self) -> int | None:
        return None if self.index is None else self.index.version

    def _extended_since(self, state: dict) -> bool:
        """Refuse a position saved on another version of this dataset, or with data.resume_extended
        take the next epoch over this version (True: the state is loaded). A state from before
        versions were recorded counts as another version when the dataset is extended and its
        sample count differs."""
        saved, mine = state.get("dataset_version"), self._version()
        if mine is None or saved == mine:
            return False
        if saved is None and not (mine > 1 and state["num_samples"] != self.num_samples):
            return False
        if not self.spec.resume_extended:
            pin = f"dataset.v{saved}.json" if saved else "dataset.vN.json of the version it read"
            raise CheckpointError(
                f"{self.spec.dataset} is version {mine} of its dataset, and this run's position was saved on "
                f"version {saved or 'unknown (before versions were recorded)'}: resuming would change the sample "
                f"order. Name the version the run read (data.train=FOLDER/{pin}), or set "
                f"data.resume_extended=true to go on over version {mine} from the next epoch"
            )
        self.epoch, self.consumed = state["epoch"] + (1 if state["consumed"] else 0), 0
        log.warning(
            "resuming on version %d of %s (the position was saved on version %s): from the start of "
            "epoch %d, as data.resume_extended asks",
            mine,
            self.spec.dataset,
            saved,
            self.epoch,
        )
        return True

    def prepare(self) -> None:
        """Read the index files of the shards the current epoch reads now, rather than at the
        first batch: a bad one then fails here, where the caller can make every rank fail alike."""
        if self.index is not None:
            rank_slice = self._slice()
            self.index.load(
                partition_shards_of(
                    self.index.shard_samples, self.spec.seed, self.partitions, rank_slice.partitions_read()
                )
            )

    def _warn_if_spread(self) -> None:
        spread = self.partitions // math.gcd(self.world_size, self.partitions)
        if self.index is not None and spread > 1:
            log.warning(
                "%d ranks read an order of %d partitions: each rank reads %d of them (%d samples, the "
                "index of their shards) instead of 1; a world size that divides %d, or a multiple of it, "
                "keeps that to one",
                self.world_size,
                self.partitions,
                spread,
                spread * self.num_samples // self.partitions,
                self.partitions,
            )

    def window(self) -> dict:
        """This rank's images/s and data-wait fraction since the previous call (the first: since the
        first batch was asked for), so a stall shows in the window where it happens."""
        now = time.perf_counter()
        start, images, wait = self._window
        start = start or self.started or now
        elapsed = now - start
        self._window = (now, self.images, self.wait_seconds)
        return {
            "images_per_s": (self.images - images) / elapsed if elapsed else 0.0,
            "data_wait_fraction": (self.wait_seconds - wait) / elapsed if elapsed else 0.0,
        }

    def stats(self) -> dict:
        """Running totals since the first batch was asked for."""
        elapsed = time.perf_counter() - self.started if self.started else 0.0
        return {
            "backend": self.backend.name,
            "images": self.images,
            "images_per_s": self.images / elapsed if elapsed else 0.0,
            "data_wait_fraction": self.wait_seconds / elapsed if elapsed else 0.0,
            "bad_samples": len(self.bad_keys),
            "store_requests": self.reads["requests"],
            "bytes_read": self.reads["bytes"],
            "shard_opens": self.reads["opens"],
            "shard_fetches": self.reads["fetches"],
            # shard opens the node's cache served without this loader fetching the shard
            "cache_hit_rate": 1 - self.reads["fetches"] / self.reads["opens"] if self.reads["opens"] else None,
        }


def build_loader(
    spec: LoaderSpec,
    rank: int = 0,
    world_size: int = 1,
    device: torch.device | str = "cpu",
    synthetic_samples: int = 1_281_167,
    synthetic_classes: int = 1000,
    accumulation: int = 1,
    ranks_per_node: int = 1,
    index: DatasetIndex | None = None,
) -> Loader:
    """A loader for one rank. `accumulation`: micro-batches per optimizer step, so that epochs end
    on whole steps. `ranks_per_node`: ranks rank // ranks_per_node share a node and its shard cache.
    A backend that reads no dataset (synthetic) ignores `spec.dataset` and makes `synthetic_samples`
    samples of `synthetic_classes` classes. `index`: spec.dataset's, when the caller has read it
    (dataset_index)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
    device = torch.device(device)
    name, why = choose_backend(spec, device)
    log.info("loader backend: %s (%s)", name, why)
    registered = find_backend(name)
    if not registered.reads_dataset:
        backend = registered.factory(spec, None, device, synthetic_classes)
        return Loader(spec, None, backend, rank, world_size, synthetic_samples, accumulation, ranks_per_node)
    index = index or dataset_index(spec)
    backend = registered.factory(spec, index, device, synthetic_classes)
    return Loader(spec, index, backend, rank, world_size, len(index), accumulation, ranks_per_node)


def dataset_index(spec: LoaderSpec) -> DatasetIndex:
    """The index of the samples the spec reads: its dataset's, or its subset's."""
    index = load_index(spec.dataset)
    if spec.subset is not None:
        try:
            index = index.with_subset(spec.subset, spec.seed)
        except ValueError as e:
            raise DatasetError(f"{spec.dataset}: {e}") from None
        log.info("subset %r of %s: %d samples", spec.subset, spec.dataset, len(index))
    return index


def node_shards(
    index: DatasetIndex, spec: LoaderSpec, rank: int, world_size: int, ranks_per_node: int, epoch: int = 0
) -> list[int]:
    """The shards the node of `rank` reads in `epoch` from its start, as its cache's eviction counts
    them (reader.NodeFuture): those of its ranks' partitions, and those the last batch's padding
    may open (every shard whose samples' shuffle window reaches the order's first positions: exact
    with data.shuffle_window 1, a few more otherwise). O(shards of those partitions)."""
    rank_slice = RankSlice(
        len(index),
        0,
        rank,
        world_size,
        spec.batch_size,
        spec.epoch_end,
        1,
        spec.partitions or world_size,
        ranks_per_node,
    )
    return NodeFuture(index, spec, epoch, rank_slice).shards
