"""What a loader is asked to produce: one validated description shared by every backend."""

from __future__ import annotations

from dataclasses import dataclass

from vitforge.core import UsageError

BACKENDS = ("auto", "dali", "dali-cpu", "torch", "synthetic")
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class LoaderSpec:
    dataset: str  # folder or s3:// prefix holding dataset.json (made by `vitforge shard`)
    batch_size: int  # per rank
    image_size: int = 224
    train: bool = True  # random-resized-crop + flip; False: resize shorter side, centre crop
    backend: str = "auto"
    seed: int = 0
    # How every rank gets the same number of batches: "pad" repeats samples from the start of the
    # epoch's order (in eval they carry label -1 so metrics skip them); "drop" leaves the remainder out.
    epoch_end: str = "pad"
    scale: tuple[float, float] = (0.08, 1.0)  # random-resized-crop area fraction (Inception / ViT recipe)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    flip: bool = True
    randaugment: tuple[int, int] | None = None  # (operations per image, magnitude bin 0-30), train only
    eval_crop_fraction: float = 0.875  # eval: resize shorter side to image_size / 0.875, centre crop
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    dtype: str = "float32"  # or "bfloat16"
    shuffle_window: int = 16384  # samples mixed across shards beyond the shard-level shuffle
    workers: int = 2  # decode processes (torch) or CPU threads (DALI)
    hw_decoder_load: float = 0.65  # DALI mixed decode: share of JPEGs sent to the A100/H100 hardware decoder
    prefetch: int = 2  # batches decoded ahead of the consumer (DALI's queue; torch: per worker)
    # DALI decodes ahead of the consumer in its own threads: None = when the device is a GPU (on a
    # CPU device the step needs the same cores). The torch backend overlaps through its workers.
    overlap: bool | None = None
    # A deterministic subset of the dataset (train only): a fraction (0.1) or a sample count (5000);
    # smaller subsets are inside larger ones for the same seed. None: every sample.
    subset: float | int | None = None
    # Canonical partitions of the order (see order.py), fixed when the run starts: None = the world
    # size then. Store egress stays one copy of the dataset per epoch at any world size dividing it.
    partitions: int | None = None
    # Object-store shards go through a node-local cache shared by the node's ranks: its folder
    # (None: $VITFORGE_CACHE_DIR, else the system temp folder), size limit, GET size and lookahead.
    cache_dir: str | None = None
    cache_gb: float = 32.0
    read_block_mb: float = 16.0
    shards_ahead: int = 2  # shards fetched ahead of the one being read, per reader

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise UsageError(f"backend must be one of {', '.join(BACKENDS)}, not {self.backend!r}")
        if self.batch_size < 1:
            raise UsageError(f"batch_size must be >= 1, not {self.batch_size}")
        if self.image_size < 8:
            raise UsageError(f"image_size must be >= 8, not {self.image_size}")
        if self.epoch_end not in ("pad", "drop"):
            raise UsageError(f"epoch_end must be 'pad' or 'drop', not {self.epoch_end!r}")
        if self.dtype not in ("float32", "bfloat16"):
            raise UsageError(f"dtype must be 'float32' or 'bfloat16', not {self.dtype!r}")
        if not 0 < self.scale[0] <= self.scale[1] <= 1:
            raise UsageError(f"scale must satisfy 0 < min <= max <= 1, not {self.scale}")
        if not 0 < self.ratio[0] <= self.ratio[1]:
            raise UsageError(f"ratio must satisfy 0 < min <= max, not {self.ratio}")
        if self.prefetch < 1:
            raise UsageError(f"prefetch must be >= 1, not {self.prefetch}")
        if self.subset is not None and not (0 < self.subset <= 1 if isinstance(self.subset, float)
                                            else self.subset >= 1):
            raise UsageError(f"subset must be a fraction in (0, 1] or a sample count >= 1, not {self.subset!r}")
        if self.randaugment is not None and not (self.randaugment[0] >= 1 and 0 <= self.randaugment[1] <= 30):
            raise UsageError(f"randaugment must be (operations >= 1, magnitude 0-30), not {self.randaugment}")
        if self.partitions is not None and self.partitions < 1:
            raise UsageError(f"partitions must be >= 1, not {self.partitions}")
        if self.cache_gb <= 0 or self.read_block_mb <= 0 or self.shards_ahead < 0:
            raise UsageError(f"cache_gb must be > 0, read_block_mb > 0 and shards_ahead >= 0, not "
                             f"{self.cache_gb}, {self.read_block_mb}, {self.shards_ahead}")
        if not 0 < self.eval_crop_fraction <= 1:
            raise UsageError(f"eval_crop_fraction must be in (0, 1], not {self.eval_crop_fraction}")
