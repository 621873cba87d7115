"""Training on a mixture: several datasets at chosen weights, each read by a loader of its own.

Each source is the single-dataset loader (loader.py) over its own index, order, partitions and
node cache, so what a rank holds and reads per source is what one loader holds and reads; the
source cycles its own epochs (reshuffled each, independently) and the run's length is in steps.
Every batch of every rank takes `batch_counts` samples from each source: the counts that bring
each source's total (all ranks) nearest its weight's share after the batch (largest remainders),
decided from counts alone, so the same on every rank, at any number of loader workers and on
any backend. Within a batch the sources' samples are interleaved evenly (`interleave`). After
a reweight (data.reweight) the counts go by what was taken since, not since the run began.

The bound: on every rank, in every run of k consecutive samples, each source's count differs
from weight x k by less than 4 (tests/integration/test_mixture.py checks every window). A source
is read a sub-batch at a time: it decodes whole batches of the spec's size and the mixture takes
what each batch needs, holding the rest for the next (at most one batch per source per rank).

Resume is exact per source: the state holds every source's loader state at the last sample
taken (its epoch and position), the totals taken and the weights, so a resume at any world size
takes each source's positions on from where all ranks together left them (only the few repeats
that even out a source epoch's last row of ranks depend on the world size). Changing the
weights of a run is refused unless `reweight` (then it goes on from the saved positions).

Keys are "SOURCE/SHARD.tar:KEY" and positions (source << 40) + position, so no two sources'
samples share either (labels: mixture_labels.py). Per rank: at most one held batch per source,
O(sources) counts. The loaders are built by mixture_build.py.
"""

from __future__ import annotations

import math
import time
from collections.abc import Generator, Iterator, Sequence
from typing import Any, Literal

import numpy as np
import torch

from vitforge.core import CheckpointError

from .backend import Batch, make_batch
from .loader import Loader
from .mixture_labels import MixtureIndex
from .spec import MixtureSource

SOURCE_SHIFT = 40  # a sample's position in the mixture: (source << SOURCE_SHIFT) + its own position
MIXTURE_STATE_VERSION = 1


def batch_counts(weights: Sequence[float], taken: Sequence[int], world_size: int, batch: int) -> list[int]:
    """Samples of each source in every rank's next batch (summing to `batch`): each source's
    deficit against its share of the total after the batch (all ranks: `taken`), per rank, rounded
    by largest remainders, ties to the first source; a source ahead of its share takes none."""
    norm = sum(weights)
    after = sum(taken) + world_size * batch
    want = [max(0.0, (w / norm * after - t) / world_size) for w, t in zip(weights, taken)]
    scale = batch / sum(want) if sum(want) > 0 else 0.0
    return largest_remainders([x * scale for x in want] if scale else [batch * w / norm for w in weights], batch)


def largest_remainders(exact: Sequence[float], total: int) -> list[int]:
    """`exact` (summing to `total`) rounded to integers that sum to `total`: floors, then one more
    for the largest remainders, ties to the first."""
    counts = [int(x) for x in exact]
    for i in sorted(range(len(exact)), key=lambda i: (counts[i] - exact[i], i))[: total - sum(counts)]:
        counts[i] += 1
    return counts


def interleave(counts: Sequence[int]) -> np.ndarray:
    """A batch's order from its sources' sub-batches laid end to end: sample t of source s goes to
    the place (t + 1/2) / counts[s] of the batch, ties to the first source."""
    places = [((t + 0.5) / n, s, t) for s, n in enumerate(counts) for t in range(n)]
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    return np.asarray([starts[s] + t for _, s, t in sorted(places)], dtype=np.int64)


class _SourceStream:
    """One source's samples for this rank, in its loader's order, a sub-batch at a time. The
    loader's (epoch, consumed) always stand at the next sample not yet taken. From position c an
    epoch gives each rank ceil((N - c) / W) samples (positions rank, rank + W, ...): every position
    below N once, and fewer than W past it, which repeat the epoch's first samples as the loader's
    "pad" does. So every rank takes the same number, and a resume at another world size takes
    the same positions below N; only the count of repeats at the epoch's end differs."""

    def __init__(self, loader: Loader):
        self.loader = loader
        self._batches: Generator[Batch, None, None] | None = None
        self._held: Batch | None = None
        self._at = 0  # samples of the held batch taken
        self._left = 0  # samples of this epoch this rank has still to take
        self.wait_seconds = 0.0

    def take(self, n: int) -> list[Batch]:
        pieces = []
        while n:
            if self._batches is None or self._left == 0:
                self._start_epoch()
            if self._held is None or self._at == len(self._held["label"]):
                self._held, self._at = self._next(), 0
            size = min(n, len(self._held["label"]) - self._at, self._left)
            pieces.append(_piece(self._held, self._at, self._at + size))
            self._at += size
            self._left -= size
            n -= size
            self.loader.consumed += self.loader.world_size * size
        return pieces

    def _start_epoch(self) -> None:
        """The iterator from the loader's position, after moving to the next epoch if this one is done."""
        loader = self.loader
        if self._batches is not None:
            self._batches.close()  # what it decoded ahead is past this epoch's end
        if self._batches is not None or loader.consumed >= loader.num_samples:
            loader.epoch, loader.consumed = loader.epoch + 1, 0
        self._held, self._at = None, 0
        self._left = -(-(loader.num_samples - loader.consumed) // loader.world_size)
        self._batches = loader.backend.batches(loader.epoch, loader._slice())

    def _next(self) -> Batch:
        loader = self.loader
        asked = time.perf_counter()
        batch = next(self._batches)  # never ends first: "pad" reaches past the epoch's end
        self.wait_seconds += time.perf_counter() - asked
        # the source's own totals, as its Loader keeps them when iterated itself
        loader.images += len(batch["label"])
        loader.bad_keys += batch["bad"]
        for name, value in batch["reads"].items():
            loader.reads[name] += value
        return batch


def _piece(batch: Batch, start: int, stop: int) -> Batch:
    return Batch(
        image=batch["image"][start:stop],
        label=batch["label"][start:stop],
        real=batch["real"][start:stop],
        key=batch["key"][start:stop],
        position=batch["position"][start:stop],
        bad=batch["bad"] if start == 0 else [],
        reads=batch["reads"] if start == 0 else {},
    )


class MixtureLoader:
    """A Loader's interface (iteration, epoch, state, stats) over several sources at weights."""

    def __init__(
        self,
        sources: list[MixtureSource],
        loaders: list[Loader],
        label_space: Literal["offset", "by_name"],
        accumulation: int = 1,
        reweight: bool = False,
    ):
        self.sources, self.loaders, self.accumulation, self.reweight = sources, loaders, accumulation, reweight
        self.spec = loaders[0].spec
        self.rank, self.world_size = loaders[0].rank, loaders[0].world_size
        self.index = MixtureIndex([ld.index for ld in loaders], [s.url for s in sources], label_space)
        self._tables: dict[tuple[int, torch.device], torch.Tensor] = {}  # each source's label map, per device
        self.label_space = label_space
        self.num_samples = sum(ld.num_samples for ld in loaders)
        self.streams = [_SourceStream(ld) for ld in loaders]
        self._normalise = _normalise_once(loaders)
        self.weights = [s.weight for s in sources]
        self.taken = [0] * len(sources)  # samples taken from each source by all ranks since the run began
        self.since = [0] * len(sources)  # the same since the weights were set: what the counts go by
        self.epoch = 0  # passes over the sum of the sources' samples (what per-step randomness hashes)
        self.epoch_taken = 0  # samples all ranks took in this pass
        self.images = 0
        self.started: float | None = None
        self._window: tuple[float | None, int, list[float], list[int]] = (
            None,
            0,
            [0.0] * len(sources),
            [0] * len(sources),
        )

    @property
    def wait_seconds(self) -> float:
        return sum(s.wait_seconds for s in self.streams)

    def epoch_length(self) -> int:
        per_step = self.world_size * self.spec.batch_size * self.accumulation
        return self.num_samples // per_step * per_step

    def __len__(self) -> int:
        return (self.epoch_length() - self.epoch_taken) // (self.world_size * self.spec.batch_size)

    def __iter__(self) -> Iterator[Batch]:
        step = self.world_size * self.spec.batch_size
        while self.epoch_taken + step <= self.epoch_length():
            if self.started is None:
                self.started = time.perf_counter()
            counts = batch_counts(self.weights, self.since, self.world_size, self.spec.batch_size)
            batch = self._assemble(counts)
            for s, n in enumerate(counts):
                self.taken[s] += n * self.world_size
                self.since[s] += n * self.world_size
            self.epoch_taken += step
            self.images += len(batch["label"])
            yield batch
        self.epoch, self.epoch_taken = self.epoch + 1, 0

    def _assemble(self, counts: list[int]) -> Batch:
        """The sources' pieces written once each into the batch at their interleaved rows: one copy
        of the images (a float batch of 224 px images is 38 MB a rank on a CPU device)."""
        order = interleave(counts)
        rows = np.empty_like(order)
        rows[order] = np.arange(len(order))  # the row of the batch each source sample goes to
        pieces, sources = [], []
        for s, n in enumerate(counts):
            for piece in self.streams[s].take(n):
                pieces.append(piece)
                sources.append(s)
        first = pieces[0]["image"]
        shape = (len(order), *first.shape[1:])
        # numpy asks for transparent huge pages for a large array (torch.empty does not): a 38 MB
        # batch then faults in 19 pages instead of 9,400, a third of the time normalising takes.
        image = (
            torch.empty(shape, dtype=first.dtype, device=first.device)
            if self._normalise is None
            else torch.from_numpy(np.empty(shape, np.float32))
        )
        label = torch.empty(len(order), dtype=pieces[0]["label"].dtype, device=pieces[0]["label"].device)
        position = np.empty(len(order), np.int64)
        real = np.empty(len(order), bool)
        keys: list[str] = [""] * len(order)
        bad: list[str] = []
        reads: dict[str, int] = {}
        at = 0
        for s, piece in zip(sources, pieces):
            n = len(piece["label"])
            where = rows[at : at + n]
            on_device = torch.from_numpy(where).to(label.device)  # the images' device too (Batch)
            if self._normalise is None:
                image.index_copy_(0, on_device, piece["image"])
            else:
                _normalise_into(self._normalise, piece["image"].numpy(), image.numpy(), where)
            label[on_device] = self._labels(s, piece["label"])
            position[where] = np.asarray(piece["position"]) + (s << SOURCE_SHIFT)
            real[where] = np.asarray(piece["real"])
            for row, key in zip(where.tolist(), piece["key"]):
                keys[row] = f"{s}/{key}"
            bad += [f"{s}/{b}" for b in piece["bad"]]
            for name, value in piece["reads"].items():
                reads[name] = reads.get(name, 0) + value
            at += n
        return make_batch(image, label, position, real, keys, bad, reads)

    def _labels(self, source: int, label: torch.Tensor) -> torch.Tensor:
        """A source's labels in the mixture's label space (an ignored label stays ignored)."""
        table = self._tables.get((source, label.device))
        if table is None:
            table = self._tables[source, label.device] = self.index.maps[source].to(label.device)
        return torch.where(label >= 0, table[label.clamp(min=0)], label) if len(table) else label

    def state_dict(self) -> dict:
        return {
            "mixture": MIXTURE_STATE_VERSION,
            "urls": [s.url for s in self.sources],
            "weights": self.weights,
            "label_space": self.label_space,
            "taken": list(self.taken),
            "since": list(self.since),
            "epoch": self.epoch,
            "epoch_taken": self.epoch_taken,
            "sources": [ld.state_dict() for ld in self.loaders],
        }

    def load_state_dict(self, state: dict) -> None:
        if "mixture" not in state:
            raise CheckpointError(
                "this run was saved training on one dataset, not a mixture: data.train must "
                "name that one dataset to resume it"
            )
        if state["urls"] != [s.url for s in self.sources]:
            raise CheckpointError(
                f"this run's mixture is {state['urls']}; data.train names {[s.url for s in self.sources]}"
            )
        if state["label_space"] != self.label_space:
            raise CheckpointError(
                f"this run's labels are data.label_space={state['label_space']}, not {self.label_space}"
            )
        reweighted = not all(
            math.isclose(a, b) for a, b in zip(_normalised(state["weights"]), _normalised(self.weights))
        )
        if reweighted and not self.reweight:
            raise CheckpointError(
                f"this run's weights are {state['weights']}, data.train asks {self.weights}: set "
                "data.reweight=true to go on with the new weights from the saved positions"
            )
        for loader, saved in zip(self.loaders, state["sources"]):
            loader.load_state_dict(saved)
        self.taken, self.epoch, self.epoch_taken = list(state["taken"]), state["epoch"], state["epoch_taken"]
        # new weights count from here: measured against what was taken under the old ones, a source
        # that had been behind would take every sample for as long as it took to catch up
        self.since = [0] * len(self.sources) if reweighted else list(state["since"])
        self._window = (None, self.images, [s.wait_seconds for s in self.streams], list(self.taken))

    def prepare(self) -> None:
        for loader in self.loaders:
            loader.prepare()

    def window(self) -> dict:
        """Images/s and data-wait fraction since the previous call, and each source's share of both."""
        now = time.perf_counter()
        start, images, waits, taken = self._window
        start = start or self.started or now
        elapsed = now - start
        self._window = (now, self.images, [s.wait_seconds for s in self.streams], list(self.taken))
        wait = sum(s.wait_seconds for s in self.streams) - sum(waits)
        return {
            "images_per_s": (self.images - images) / elapsed if elapsed else 0.0,
            "data_wait_fraction": wait / elapsed if elapsed else 0.0,
            "sources": [
                {"samples": t - t0, "data_wait_fraction": (s.wait_seconds - w) / elapsed if elapsed else 0.0}
                for s, w, t, t0 in zip(self.streams, waits, self.taken, taken)
            ],
        }

    def stats(self) -> dict:
        elapsed = time.perf_counter() - self.started if self.started else 0.0
        per_source = [ld.stats() for ld in self.loaders]
        totals = {
            name: sum(s[name] for s in per_source)
            for name in ("bad_samples", "store_requests", "bytes_read", "shard_opens", "shard_fetches")
        }
        return {
            "backend": per_source[0]["backend"],
            "images": self.images,
            "images_per_s": self.images / elapsed if elapsed else 0.0,
            "data_wait_fraction": self.wait_seconds / elapsed if elapsed else 0.0,
            **totals,
            "cache_hit_rate": 1 - totals["shard_fetches"] / totals["shard_opens"] if totals["shard_opens"] else None,
            "sources": [
                {"url": src.url, "weight": src.weight, "samples_taken": t, "data_wait_s": stream.wait_seconds}
                for src, t, stream in zip(self.sources, self.taken, self.streams)
            ],
        }


def _normalise_once(loaders: list[Loader]):
    """On a CPU device, the torch backend's sources hand over uint8 pixels and the mixture
    normalises each into its row of the batch: one float batch made per batch, as one source
    makes, instead of each source's float batch copied once more (38 MB at 224 px; page faults
    and the copy were a quarter of the loader's CPU: benchmarks/loader_bench.py's mixture row).
    Elsewhere (a GPU, DALI, bfloat16) the sources normalise and the batch is a device copy."""
    backends: list[Any] = [ld.backend for ld in loaders]  # the torch backend's own attributes, if it is one
    if not all(
        getattr(b, "normalises", False) and b.device.type == "cpu" and b.spec.dtype == "float32" for b in backends
    ):
        return None
    for backend in backends:
        backend.normalises = False
    return backends[0].normalise


def _normalise_into(normalise, pixels: np.ndarray, out: np.ndarray, rows: np.ndarray) -> None:
    """uint8 `pixels` normalised into `out`'s `rows`, a run of consecutive rows at a time."""
    if not len(rows):
        return
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    for start, stop in zip([0, *breaks.tolist()], [*breaks.tolist(), len(rows)]):
        row = int(rows[start])
        normalise.into(pixels[start:stop], out[row : row + stop - start])


def _normalised(weights: Sequence[float]) -> list[float]:
    return [w / sum(weights) for w in weights]
