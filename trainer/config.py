"""One validated configuration schema: YAML recipes plus `--set a.b=c` overrides.

An unknown key or a value of the wrong type is an error that names the key; batch arithmetic is
checked once, here, with a message that shows the numbers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from vitforge.core import UsageError
from vitforge.core.settings import load_validated

RECIPES = Path(__file__).resolve().parent / "recipes"


class ConfigError(UsageError):
    kind = "config error"


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(Strict):
    name: str = "vit_base_patch16_224"  # a timm name, or one of trainer.model.TINY_MODELS
    image_size: int = Field(224, ge=8)
    num_classes: int | None = Field(None, ge=1)  # None: from the training set's dataset.json
    drop_path: float = Field(0.0, ge=0, lt=1)  # stochastic depth, the deepest block's rate (linear in depth)
    # Dropout after the position embeddings and after every dense layer but the qkv projection (ViT
    # paper, appendix B.1: 0.1 for ViT-B/L on ImageNet-1k from scratch, 0 on JFT)
    dropout: float = Field(0.0, ge=0, lt=1)
    # The paper's pre-training head: one hidden tanh layer before the classifier (section 3.1);
    # fine-tuning (checkpoint.init_from) replaces it with a zero-initialised linear classifier.
    pre_logits: bool = False
    grad_checkpointing: bool = False


class DataConfig(Strict):
    train: str  # dataset folder or s3:// prefix (dataset.json), or "synthetic"
    val: str | None = None
    backend: Literal["auto", "dali", "dali-cpu", "torch", "synthetic"] = "auto"
    workers: int = Field(4, ge=0)  # decode processes (torch) or threads (DALI) per rank
    prefetch: int = Field(2, ge=1)  # batches decoded ahead of the step (DALI's queue, torch's per worker)
    # DALI decodes ahead in its own threads: auto = on a GPU (on a CPU the step needs the same cores)
    overlap: Literal["auto", "on", "off"] = "auto"
    # Train on a deterministic subset: a fraction (0.1, with a decimal point) or a sample count (5000);
    # for one seed the smaller subsets are inside the larger ones. Eval always sees all of data.val.
    subset: float | int | None = Field(None, gt=0)
    seed: int = 0
    # Partitions of the sample order, fixed when the run starts (null: the number of ranks then).
    # A resume at any world size is exact; store egress stays one copy of the dataset per epoch
    # when the number of ranks divides it, so pick a multiple of the sizes you will run at.
    partitions: int | None = Field(None, ge=1)
    # s3:// datasets: shards are fetched whole (GETs of read_block_mb) into a node-local cache
    # shared by the node's ranks; null cache_dir: $VITFORGE_CACHE_DIR, else the temp folder.
    cache_dir: str | None = None
    cache_gb: float = Field(32.0, gt=0)  # per node and dataset; what the order needs last goes first
    read_block_mb: float = Field(16.0, gt=0)
    shards_ahead: int = Field(2, ge=0)  # shards fetched ahead of need, per reader


class AugmentConfig(Strict):
    """Training-time augmentation and regularisation. Crops and flips are decided per (seed, epoch,
    position) by the loader; Mixup/CutMix per (seed, step, micro-batch, rank) on the device batch:
    a resumed run augments exactly as an uninterrupted one."""

    crop_scale: tuple[float, float] = (0.08, 1.0)  # random-resized-crop area fraction (Inception crop)
    crop_ratio: tuple[float, float] = (3 / 4, 4 / 3)  # its aspect-ratio range
    flip: bool = True  # horizontal flip with probability 1/2
    # RandAugment: [operations per image, magnitude bin 0-30], e.g. [2, 9] (DeiT's rand-m9-n2); null: off
    randaugment: tuple[int, int] | None = None
    label_smoothing: float = Field(0.0, ge=0, lt=1)
    mixup: float = Field(0.0, ge=0)  # Mixup's Beta(alpha, alpha); 0 = off
    cutmix: float = Field(0.0, ge=0)  # CutMix's Beta(alpha, alpha); 0 = off
    mix_prob: float = Field(1.0, ge=0, le=1)  # share of micro-batches mixed
    switch_prob: float = Field(0.5, ge=0, le=1)  # with both on: the share that use CutMix

    @model_validator(mode="after")
    def _ranges(self):
        if not 0 < self.crop_scale[0] <= self.crop_scale[1] <= 1:
            raise ValueError(f"crop_scale must satisfy 0 < min <= max <= 1, not {list(self.crop_scale)}")
        if not 0 < self.crop_ratio[0] <= self.crop_ratio[1]:
            raise ValueError(f"crop_ratio must satisfy 0 < min <= max, not {list(self.crop_ratio)}")
        if self.randaugment is not None and not (self.randaugment[0] >= 1 and 0 <= self.randaugment[1] <= 30):
            raise ValueError(f"randaugment must be [operations >= 1, magnitude 0-30], not {list(self.randaugment)}")
        return self


class OptimizerConfig(Strict):
    name: Literal["adamw", "sgd"] = "adamw"
    lr: float = Field(3e-4, gt=0)  # peak learning rate
    betas: tuple[float, float] = (0.9, 0.999)
    momentum: float = 0.9
    weight_decay: float = Field(0.1, ge=0)  # never on norms, biases, position embeddings or the class token
    warmup_steps: int = Field(10_000, ge=0)
    schedule: Literal["linear", "cosine", "constant"] = "linear"
    min_lr: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, ge=0)


class TrainConfig(Strict):
    # classification, or masked_patch_prediction (the paper's self-supervised pre-training: predict
    # corrupted patches' mean colours; fine-tune from it with checkpoint.init_from)
    objective: Literal["classification", "masked_patch_prediction"] = "classification"
    steps: int = Field(ge=1)
    global_batch: int = Field(ge=1)
    micro_batch: int = Field(ge=1)  # per rank, per forward pass; accumulation = global / (micro * world size)
    precision: Literal["fp32", "bf16"] = "bf16"
    zero_stage: Literal[0, 1, 2, 3] = 2
    offload_optimizer: bool = False
    offload_params: bool = False
    ema_decay: float | None = Field(None, gt=0, lt=1)  # Polyak averaging, e.g. 0.9999 for fine-tuning
    eval_every: int = Field(1000, ge=1)
    log_every: int = Field(10, ge=1)
    checkpoint_every: int | None = Field(1000, ge=1)  # steps between checkpoints (None: only by minutes / at the end)
    checkpoint_every_minutes: float | None = Field(None, gt=0)  # wall-clock interval, agreed by all ranks
    # End this invocation (after a checkpoint) at this step; the schedule still spans `steps`.
    stop_at: int | None = Field(None, ge=1)
    # End this invocation cleanly (checkpoint, then the requeue exit code) after this many minutes,
    # e.g. a little under the scheduler's time limit.
    max_minutes: float | None = Field(None, gt=0)
    max_nonfinite: int = Field(1, ge=1)  # consecutive steps with a non-finite loss or gradient norm before stopping
    seed: int = 0


class CheckpointConfig(Strict):
    dir: str = "runs"  # a local folder, file:// or s3://BUCKET/PREFIX; the run lives in DIR/RUN
    run: str = "run"
    # Fine-tuning: a run or checkpoint (folder or URL) of ours, or a timm-format state-dict file.
    init_from: str | None = None
    save: bool = True  # false: never write checkpoints (benchmarks)
    # "auto": the newest complete checkpoint (falling back past broken ones), "never", a step
    # number, or a checkpoint URL (DIR/RUN/step_NNNNNNNN).
    resume: str | int = "auto"
    staging: str | None = None  # node-local folder for writes before upload (default: the temp dir)
    log_dir: str | None = None  # metrics.jsonl and TensorBoard (default: the run folder if local, else ./logs/RUN)
    keep_last: int | None = Field(3, ge=1)  # newest complete checkpoints kept (None: all)
    keep_every: int | None = Field(None, ge=1)  # also keep every checkpoint whose step is a multiple of this
    # A run is owned by one job at a time; a lease not refreshed for this long may be taken over.
    lease_minutes: float = Field(10.0, gt=0)
    upload_timeout_minutes: float = Field(60.0, gt=0)  # rank 0 waits this long for every rank's upload

    @field_validator("dir")
    @classmethod
    def _known_scheme(cls, value: str) -> str:
        if "://" in value and not value.startswith(("file://", "s3://")):
            raise ValueError(f"{value!r}: only a local folder, file:// or s3:// is supported")
        if value.startswith("s3://") and not value[len("s3://"):].split("/", 1)[0]:
            raise ValueError(f"{value!r}: no bucket in the s3:// URL")
        return value

    @field_validator("run")
    @classmethod
    def _plain_name(cls, value: str) -> str:
        if not value or "/" in value or value in (".", ".."):
            raise ValueError(f"{value!r}: a run is a plain name (no '/')")
        return value

    @field_validator("resume")
    @classmethod
    def _resume_form(cls, value):
        if isinstance(value, int) and value < 0:
            raise ValueError("a step number must be >= 0")
        if isinstance(value, str) and value not in ("auto", "never") and not value.isdigit() and "/" not in value:
            raise ValueError(f"{value!r}: expected auto, never, a step number or a checkpoint URL")
        return int(value) if isinstance(value, str) and value.isdigit() else value

    @property
    def run_url(self) -> str:
        return f"{self.dir.rstrip('/')}/{self.run}"


class Config(Strict):
    model: ModelConfig = ModelConfig()
    data: DataConfig
    augment: AugmentConfig = AugmentConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    train: TrainConfig
    checkpoint: CheckpointConfig = CheckpointConfig()
    deepspeed: dict = {}  # any DeepSpeed config key, applied last over the generated config

    @model_validator(mode="after")
    def _objective_fits(self):
        if self.train.objective == "masked_patch_prediction":
            mixing = [f"augment.{k}" for k in ("mixup", "cutmix", "label_smoothing") if getattr(self.augment, k)]
            if mixing or self.model.pre_logits:
                raise ValueError(f"train.objective masked_patch_prediction predicts patch colours: "
                                 f"{', '.join(mixing + ['model.pre_logits'] * self.model.pre_logits)} "
                                 "only apply to classification")
        return self

    def accumulation(self, world_size: int) -> int:
        per_step = self.train.micro_batch * world_size
        if self.train.global_batch % per_step:
            raise ConfigError(
                f"train.global_batch {self.train.global_batch} is not divisible by train.micro_batch "
                f"{self.train.micro_batch} x {world_size} ranks = {per_step}")
        return self.train.global_batch // per_step


def load_config(path: str | Path, overrides: list[str] = ()) -> Config:
    """Read a YAML recipe (a path, or the name of a shipped recipe) and apply `a.b=c` overrides."""
    return load_validated(path, list(overrides), Config, RECIPES, "config", ConfigError)
