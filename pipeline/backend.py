"""The loader's backend contract: what a backend yields (`Batch`, made by `make_batch` alone), the
`Backend` protocol, and the registry that finds a backend by the name in `data.backend`.

A backend is registered once, by name, with a factory (timm's `register_model` pattern); the
loader asks the registry, never compares names itself. "auto" is not a backend: `choose_backend`
(loader.py) resolves it to a registered one. The built-in decoding backends are known by
"module:factory" alone (core/registry.py), so validating a config imports neither torch nor DALI;
an installed package adds one through the entry point group `vitforge.backends` (name: the
backend; value: "module:factory" of a backend that reads a dataset).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Protocol, TypedDict, runtime_checkable

from vitforge.core import UsageError, registry

if TYPE_CHECKING:  # torch is imported where a batch is made: validating a config must not load it
    import numpy as np
    import torch

    from .index import DatasetIndex
    from .order import RankSlice
    from .spec import LoaderSpec


class Batch(TypedDict):
    """One rank's micro-batch of N samples, as every backend yields it. Per rank it holds one batch
    (plus the `prefetch` batches decoded ahead): N x 3 x S x S image elements, a few N-long vectors
    and N keys; nothing grows with the dataset."""

    image: torch.Tensor
    """N x 3 x S x S in the spec's dtype (float32 or bfloat16), normalised, on the loader's device.
    (Between a torch decode worker and the consumer: N x 3 x S x S uint8 on the host.)"""
    label: torch.Tensor
    """N int64 on the device; -1 (IGNORE_LABEL): no label, a replaced sample or eval padding."""
    real: torch.Tensor
    """N bool on the host; False: a replaced sample or eval padding."""
    key: list[str]
    """N "SHARD.tar:KEY" names (empty for synthetic data)."""
    position: torch.Tensor
    """N int64 on the host: each sample's place in the epoch's order (with the epoch, what
    per-sample randomness hashes)."""
    bad: list[str]
    """Keys of samples replaced in this batch (a decode or read failure), with the cause."""
    reads: dict[str, int]
    """What reading the batch cost: object-store "requests" and "bytes" (bytes read locally for
    local shards), shard-cache "opens" and "fetches"; empty for synthetic data."""


def make_batch(
    image: torch.Tensor,
    label: torch.Tensor,
    position: np.ndarray,
    real: np.ndarray | None = None,
    key: list[str] | None = None,
    bad: list[str] | None = None,
    reads: dict[str, int] | None = None,
) -> Batch:
    """The one place a Batch is built. `real` None: every sample is real."""
    import torch

    return Batch(
        image=image,
        label=label,
        real=torch.ones(len(label), dtype=torch.bool) if real is None else torch.from_numpy(real),
        key=[] if key is None else key,
        position=torch.from_numpy(position),
        bad=[] if bad is None else bad,
        reads={} if reads is None else reads,
    )


@runtime_checkable
class Backend(Protocol):
    """Decodes a rank's share of an epoch into Batches. Per rank: one instance, holding its decode
    pipeline (workers or DALI threads) and the dataset index (None for a backend that reads none)."""

    name: str
    """What `Loader.stats()` reports, e.g. "torch", "dali-mixed"."""
    index: DatasetIndex | None
    """The index it reads; the loader may swap in a re-ranked subset when it resumes an old state."""

    def batches(self, epoch: int, rank_slice: RankSlice) -> Generator[Batch, None, None]:
        """This rank's batches of `epoch`, from the slice's position to its end, in order (a generator:
        the loader closes it to drop what it decoded ahead)."""


Factory = Callable[["LoaderSpec", "DatasetIndex | None", "torch.device", int], Backend]


@dataclass(frozen=True)
class Registered:
    factory: Factory
    """factory(spec, index, device, num_classes): `num_classes` bounds the labels of a backend that
    makes its own data; one that reads a dataset takes them from the index."""
    reads_dataset: bool
    """False: the loader loads no index and passes None (synthetic data)."""


ENTRY_POINT_GROUP = "vitforge.backends"
# name -> Registered, or the factory ("module:factory") of a backend that reads a dataset
_backends: dict[str, Registered | Factory | str] = {
    "torch": "vitforge.pipeline.torch_backend:torch_backend",
    "dali": "vitforge.pipeline.dali_backend:dali_backend",
    "dali-cpu": "vitforge.pipeline.dali_backend:dali_cpu_backend",
}


def register_backend(name: str, reads_dataset: bool = True, clobber: bool = False) -> Callable[[Factory], Factory]:
    """Decorator: make `factory` the backend `name` (for data.backend / LoaderSpec.backend)."""

    def add(factory: Factory) -> Factory:
        if name == "auto":
            raise UsageError("'auto' chooses among the registered backends; it cannot be one")
        if name in _backends and not clobber:
            raise UsageError(f"loader backend {name!r} is already registered (pass clobber=True to replace it)")
        _backends[name] = Registered(factory, reads_dataset)
        return factory

    return add


def _installed() -> None:
    registry.add_entry_points(_backends, entry_points(group=ENTRY_POINT_GROUP))


def backend_names() -> list[str]:
    _installed()
    return sorted(_backends)


def find_backend(name: str) -> Registered:
    """The registered backend `name` (its module imported now); an unknown name is an error listing
    the known ones."""
    found = registry.find(_backends, name, _unknown(name), more=_installed)
    return found if isinstance(found, Registered) else Registered(found, reads_dataset=True)


def check_backend_name(name: str) -> None:
    """`find_backend`'s error for an unknown name, without importing the backend's module (config
    validation stays torch-free)."""
    registry.require(_backends, name, _unknown(name), more=_installed)


def _unknown(name: str) -> Callable[[list[str]], UsageError]:
    return lambda known: UsageError(
        f"backend must be auto or a registered loader backend ({', '.join(known)}), not {name!r}"
    )


class SyntheticBackend:
    """Fixed random tensors already on the device: the trainer measured without any I/O. Per rank:
    one batch of images and labels, made once."""

    name = "synthetic"
    index: DatasetIndex | None = None

    def __init__(self, spec: LoaderSpec, num_classes: int, device: torch.device):
        import torch

        generator = torch.Generator().manual_seed(spec.seed)
        shape = (spec.batch_size, 3, spec.image_size, spec.image_size)
        self.images = torch.randn(shape, generator=generator).to(device, getattr(torch, spec.dtype))
        self.labels = torch.randint(0, num_classes, (spec.batch_size,), generator=generator).to(device)

    def batches(self, epoch: int, rank_slice: RankSlice) -> Generator[Batch, None, None]:
        for batch in range(rank_slice.num_batches):
            yield make_batch(self.images, self.labels, rank_slice.positions(batch))


@register_backend("synthetic", reads_dataset=False)
def _synthetic(spec: LoaderSpec, index: DatasetIndex | None, device: torch.device, num_classes: int) -> Backend:
    return SyntheticBackend(spec, num_classes, device)
