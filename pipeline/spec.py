"""What a loader is asked to produce: one validated description shared by every backend.

`LoaderSettings` declares the settings a user chooses, once: the trainer's `data:` section is
this model plus the data sets' locations (trainer/config.py DataConfig), and docs/CONFIG.md is
generated from it. `LoaderSpec` is those settings plus what each call decides (the data set, the
batch, train or eval transforms), the one object every backend reads. Per rank: one spec per
loader, a few hundred bytes.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator

from vitforge.core import UsageError, check_store_url, masked
from vitforge.core.settings import Switch, problems

from .backend import check_backend_name

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def _area_range(value: tuple[float, float]) -> tuple[float, float]:
    if not 0 < value[0] <= value[1] <= 1:
        raise ValueError("must satisfy 0 < min <= max <= 1")
    return value


def _ratio_range(value: tuple[float, float]) -> tuple[float, float]:
    if not 0 < value[0] <= value[1]:
        raise ValueError("must satisfy 0 < min <= max")
    return value


def _randaugment(value: tuple[int, int] | None) -> tuple[int, int] | None:
    if value is not None and not (value[0] >= 1 and 0 <= value[1] <= 30):
        raise ValueError("must be [operations >= 1, magnitude 0-30]")
    return value


# The train-time crop and RandAugment settings, defined once: the loader's (scale, ratio, randaugment)
# and the training config's (augment.crop_scale, crop_ratio, randaugment) are the same types.
CropScale = Annotated[tuple[float, float], AfterValidator(_area_range)]
"""Random-resized-crop area fraction range."""
CropRatio = Annotated[tuple[float, float], AfterValidator(_ratio_range)]
"""Random-resized-crop aspect-ratio range."""
RandAugment = Annotated[tuple[int, int] | None, AfterValidator(_randaugment)]
"""(operations per image, magnitude bin 0-30); None: off."""
CROP_SCALE = (0.08, 1.0)  # the Inception crop's (the ViT recipe's)
CROP_RATIO = (3 / 4, 4 / 3)


class LoaderSettings(BaseModel):
    """The loader's user-facing settings (`data.*` in a training config)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    backend: str = "auto"
    """auto: DALI with GPU ("mixed") JPEG decode on a GPU, DALI on the CPU elsewhere, torch when DALI is
    not installed; or a registered backend by name: dali, dali-cpu, synthetic, torch, or one a
    package registers (vitforge.pipeline.register_backend, or the entry point group vitforge.backends)."""
    workers: int = Field(4, ge=0)
    """Decode processes (torch) or threads (DALI) per rank."""
    prefetch: int = Field(2, ge=1)
    """Batches decoded ahead of the step (DALI's queue, torch's per worker)."""
    overlap: Switch = "auto"
    """DALI decodes ahead in its own threads: auto = on a GPU (on a CPU the step needs the same cores)."""
    subset: float | int | None = Field(None, gt=0)
    """Train on a deterministic subset: a fraction (0.1, with a decimal point) or a sample count
    (5000); for one seed the smaller subsets are inside the larger ones. Eval sees all of data.val."""
    seed: int = 0
    """Seeds the sample order, crops, flips, RandAugment, Mixup/CutMix and masks."""
    partitions: int | None = Field(None, ge=1)
    """Partitions of the sample order, fixed when the run starts (null: the number of ranks then).
    A resume at any world size is exact; store egress stays one copy of the dataset per epoch when
    the number of ranks divides it, so pick a multiple of the sizes you will run at."""
    cache_dir: str | None = None
    """s3:// datasets are fetched shard by shard into a node-local cache shared by the node's ranks,
    in this folder; null: $VITFORGE_CACHE_DIR, else the temp folder."""
    cache_gb: float = Field(32.0, gt=0)
    """The cache's size limit, per node and dataset; what the order needs last is removed first."""
    read_block_mb: float = Field(16.0, gt=0)
    """Size of the parallel ranged GETs that fetch a shard."""
    shards_ahead: int = Field(2, ge=0)
    """Shards fetched ahead of need, per reader."""
    resume_extended: bool = False
    """Resuming on a dataset extended since the checkpoint (`vitforge shard --extend`) is refused, as
    the sample order would change; true: go on over the extended dataset from the next epoch (the
    rest of the saved one is not read). To keep the old set instead, name its version's manifest:
    data.train=FOLDER/dataset.vN.json."""
    label_space: Literal["offset", "by_name"] = "offset"
    """A mixture's labels (data.train a list of sources): offset = each source keeps its class ids
    after the previous sources' (the model's head covers the sum); by_name = one class per distinct
    class name across the sources (each source needs the class names of its dataset.json)."""
    reweight: bool = False
    """Resuming a mixture whose weights changed since the checkpoint is refused; true: go on with the
    new weights from every source's saved position."""

    @field_validator("backend")
    @classmethod
    def _registered(cls, value: str) -> str:
        if value != "auto":
            check_backend_name(value)
        return value

    @field_validator("subset")
    @classmethod
    def _subset_form(cls, value):
        if value is not None and not (value <= 1 if isinstance(value, float) else value >= 1):
            raise ValueError("subset must be a fraction in (0, 1] or a sample count >= 1")
        return value


class MixtureSource(BaseModel):
    """One source of a mixture (data.train: [{url: s3://a/shards, weight: 0.7}, ...])."""

    # a refused URL may carry credentials: the error says what is wrong with it, masked, never its input
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    url: str
    """The dataset: what data.train takes for one (a folder or store prefix with dataset.json, tars)."""
    weight: float
    """Its share of every batch, relative to the other sources' weights (they need not sum to 1)."""

    @field_validator("url")
    @classmethod
    def _no_credentials(cls, value: str) -> str:
        check_store_url(value)
        return value

    @field_validator("weight")
    @classmethod
    def _positive(cls, value: float, info) -> float:
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(
                f"source {masked(info.data.get('url', '?'))} has weight {value}: a weight must be a number > 0"
            )
        return value


class LoaderSpec(LoaderSettings):
    """The settings plus what one loader is for. `LoaderSpec(dataset, batch_size=..., ...)`; a bad
    value is a UsageError naming each field. `LoaderSpec.of(settings, dataset, ...)` takes the
    settings from a LoaderSettings (the trainer's `data:` section)."""

    dataset: str
    """Folder or s3:// prefix holding dataset.json (made by `vitforge shard`), or WebDataset tar paths."""
    batch_size: int = Field(ge=1)
    """Per rank."""
    image_size: int = Field(224, ge=8)
    train: bool = True
    """Random-resized-crop + flip; False: resize shorter side, centre crop."""
    epoch_end: Literal["pad", "drop"] = "pad"
    """How every rank gets the same number of batches: "pad" repeats samples from the start of the
    epoch's order (in eval they carry label -1 so metrics skip them); "drop" leaves the remainder out."""
    scale: CropScale = CROP_SCALE
    """Random-resized-crop area fraction (Inception / ViT recipe)."""
    ratio: CropRatio = CROP_RATIO
    flip: bool = True
    randaugment: RandAugment = None
    """(operations per image, magnitude bin 0-30), train only."""
    eval_crop_fraction: float = Field(0.875, gt=0, le=1)
    """Eval: resize shorter side to image_size / 0.875, centre crop."""
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    dtype: Literal["float32", "bfloat16"] = "float32"
    shuffle_window: int = 16384
    """Samples mixed across shards beyond the shard-level shuffle."""
    hw_decoder_load: float = 0.65
    """DALI mixed decode: share of JPEGs sent to the A100/H100 hardware decoder."""

    def __init__(self, dataset: str, /, **values):
        try:
            # (pydantic's __init__ takes this class's fields; mypy's plugin types super()'s as LoaderSettings's)
            super().__init__(dataset=dataset, **values)  # type: ignore[call-arg]
        except ValidationError as e:
            raise UsageError(f"loader spec: {problems(e)}") from None

    @classmethod
    def of(cls, settings: LoaderSettings, dataset: str, **call) -> LoaderSpec:
        """`settings`' values, with `call`'s (the per-call fields, or a setting overridden) over them."""
        return cls(dataset, **{**{name: getattr(settings, name) for name in LoaderSettings.model_fields}, **call})
