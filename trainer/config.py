"""One validated configuration schema: YAML recipes plus `--set a.b=c` overrides.

An unknown key or a value of the wrong type is an error that names the key; batch arithmetic is
checked once, here, with a message that shows the numbers. The sections of what a run leaves and
reports (checkpoint, eval, tracking) are declared in output_config.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Literal

from pydantic import ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from vitforge.core import check_store_url
from vitforge.core.settings import Strict, Switch, load_validated
from vitforge.pipeline import LoaderSettings
from vitforge.pipeline.spec import CROP_RATIO, CROP_SCALE, CropRatio, CropScale, MixtureSource, RandAugment

from .errors import ConfigError
from .objectives import check_config
from .output_config import CheckpointConfig, EvalConfig, TrackingConfig

RECIPES = Path(__file__).resolve().parent / "recipes"


class ModelConfig(Strict):
    name: str = "vit_base_patch16_224"
    """A timm model name (vit_huge_patch14_224, vit_base_r50_s16_224, ...) or a CPU-sized one:
    vit_tiny_cpu, vit_small_cpu, vit_hybrid_tiny_cpu."""
    image_size: int = Field(224, ge=8)
    """Input resolution in pixels; position embeddings are resampled in 2D when it differs from a
    checkpoint's."""
    num_classes: int | None = Field(None, ge=1)
    """Classifier outputs; null: the training set's dataset.json says."""
    drop_path: float = Field(0.0, ge=0, lt=1)
    """Stochastic depth: the deepest block's drop rate (linear in depth)."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout after the position embeddings and after every dense layer but the qkv projection
    (ViT paper, appendix B.1: 0.1 for ViT-B/L on ImageNet-1k from scratch, 0 on JFT)."""
    pre_logits: bool = False
    """The paper's pre-training head: one hidden tanh layer before the classifier (section 3.1);
    fine-tuning (checkpoint.init_from) replaces it with a zero-initialised linear classifier."""
    grad_checkpointing: bool = False
    """Recompute each block's activations in the backward pass: less memory, about a third more compute."""
    compile: bool = False
    """torch.compile each transformer block in place (torchtitan's way: identical blocks share one
    compiled graph, checkpoint keys are unchanged); the first steps pay the compile time. ZeRO <= 2."""


class DataConfig(LoaderSettings):
    """Where the data is, and how each rank's loader reads it (the loader's settings, pipeline/spec.py)."""

    model_config = ConfigDict(frozen=False, validate_assignment=True)

    train: Annotated[
        Annotated[str, Tag("dataset")] | Annotated[list[MixtureSource], Tag("mixture")],
        Discriminator(lambda value: "mixture" if isinstance(value, list) else "dataset"),
    ]
    """Training shards: a folder or s3:// prefix holding dataset.json (from `vitforge shard`), tar
    paths from any WebDataset writer (a glob or {000000..000099} braces), or "synthetic". Or a
    mixture: a list of {url, weight}, each source in any store, each batch drawn from them at the
    weights (docs/ARCHITECTURE.md, "Mixtures"); a plain string is one source of weight 1."""
    val: str | None = None
    """Held-out shards for evaluation (the same forms); null: no evaluation."""

    @field_validator("train", "val")
    @classmethod
    def _sources(cls, value):
        if isinstance(value, str):
            check_store_url(value)  # here, before a store's own errors (a missing account) hide it
        if isinstance(value, list):
            urls = [source.url for source in value]
            if not urls:
                raise ValueError("a mixture needs at least one source")
            if "synthetic" in urls:
                raise ValueError("synthetic data is not a mixture's source")
            repeated = sorted({u for u in urls if urls.count(u) > 1})
            if repeated:
                raise ValueError(f"a source is listed twice: {', '.join(repeated)} (give it one weight)")
        return value


class AugmentConfig(Strict):
    """Training-time augmentation and regularisation. Crops and flips are decided per (seed, epoch,
    position) by the loader; Mixup/CutMix per (seed, step, micro-batch, rank) on the device batch:
    a resumed run augments exactly as an uninterrupted one."""

    crop_scale: CropScale = CROP_SCALE
    """Random-resized-crop area fraction range (the Inception crop's by default)."""
    crop_ratio: CropRatio = CROP_RATIO
    """Random-resized-crop aspect-ratio range."""
    flip: bool = True
    """Horizontal flip with probability 1/2."""
    randaugment: RandAugment = None
    """RandAugment: [operations per image, magnitude bin 0-30], e.g. [2, 9] (DeiT's rand-m9-n2); null: off."""
    label_smoothing: float = Field(0.0, ge=0, lt=1)
    """Target mass spread evenly over all classes."""
    mixup: float = Field(0.0, ge=0)
    """Mixup's Beta(alpha, alpha); 0: off."""
    cutmix: float = Field(0.0, ge=0)
    """CutMix's Beta(alpha, alpha); 0: off."""
    mix_prob: float = Field(1.0, ge=0, le=1)
    """Share of micro-batches mixed."""
    switch_prob: float = Field(0.5, ge=0, le=1)
    """With Mixup and CutMix both on: the share of mixed micro-batches that use CutMix."""


class OptimizerConfig(Strict):
    name: Literal["adamw", "sgd"] = "adamw"
    """AdamW (the paper's Adam with decoupled weight decay) or SGD with momentum (fine-tuning)."""
    lr: float = Field(3e-4, gt=0)
    """Peak learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW's betas."""
    momentum: float = 0.9
    """SGD's momentum."""
    weight_decay: float = Field(0.1, ge=0)
    """Weight decay: decoupled with AdamW, the L2 term added to the gradient with SGD (as BiT's);
    never on norms, biases, position embeddings or the class token."""
    warmup_steps: int = Field(10_000, ge=0)
    """Linear warm-up to lr over this many steps."""
    schedule: Literal["linear", "cosine", "constant", "step"] = "linear"
    """Decay from lr to min_lr at train.steps after the warm-up; step: x0.1 at each of decay_at (BiT's)."""
    decay_at: tuple[float, ...] = (0.3, 0.6, 0.9)
    """The step schedule's decays, as fractions of train.steps, ascending (BiT-HyperRule's 30/60/90%;
    BiT's ImageNet pre-training: epochs 30, 60, 80 of 90). min_lr plays no part in it."""
    min_lr: float = Field(0.0, ge=0)
    """Learning rate at the last step."""
    grad_clip: float = Field(1.0, ge=0)
    """Global gradient-norm clipping; 0: off."""
    fused: Switch = "auto"
    """AdamW's fused kernel (one launch for all parameters): auto = on CUDA; "on" also works on a CPU."""

    @field_validator("decay_at")
    @classmethod
    def _fractions(cls, value: tuple[float, ...]) -> tuple[float, ...]:
        if not all(a < b for a, b in zip((0, *value), (*value, 1))):
            raise ValueError("decay_at must be ascending fractions of train.steps, each in (0, 1)")
        return value


class TrainConfig(Strict):
    objective: str = "classification"
    """A registered objective: classification, or masked_patch_prediction (the paper's
    self-supervised pre-training: predict corrupted patches' mean colours; needs no labels;
    fine-tune from it with checkpoint.init_from)."""
    steps: int = Field(ge=1)
    """Optimizer steps of the whole run (the learning-rate schedule spans them)."""
    global_batch: int = Field(ge=1)
    """Images per optimizer step, over all ranks."""
    micro_batch: int = Field(ge=1)
    """Images per rank per forward pass; gradient accumulation = global / (micro x world size)."""
    precision: Literal["fp32", "bf16"] = "bf16"
    """bf16: DeepSpeed's bf16 mixed precision with fp32 master weights."""
    tf32: bool = True
    """On CUDA, fp32 matmuls and convolutions in TF32 (10-bit mantissa on the tensor cores), in the
    fp32 parts of a bf16 run and in fp32 runs; false keeps full fp32 (e.g. to compare with a CPU)."""
    zero_stage: Literal[0, 1, 2, 3] = 2
    """DeepSpeed ZeRO: 1 partitions optimizer state, 2 also gradients, 3 also parameters; 0: off."""
    offload_optimizer: bool = False
    """ZeRO-Offload: optimizer state and step in CPU memory."""
    offload_params: bool = False
    """ZeRO-3 parameters in CPU memory."""
    ema_decay: float | None = Field(None, gt=0, lt=1)
    """Polyak averaging of the weights, e.g. 0.9999 for fine-tuning; null: off. ZeRO <= 2."""
    eval_every: int = Field(1000, ge=1)
    """Steps between evaluations (and one at the end): data.val's metrics and eval.probes'."""
    log_every: int = Field(10, ge=1)
    """Steps between metrics lines (metrics.jsonl, TensorBoard, the log)."""
    checkpoint_every: int | None = Field(1000, ge=1)
    """Steps between checkpoints; null: only by minutes, on a stop signal and at the end."""
    checkpoint_every_minutes: float | None = Field(None, gt=0)
    """Also checkpoint at this wall-clock interval, agreed by all ranks."""
    stop_at: int | None = Field(None, ge=1)
    """End this invocation (after a checkpoint) at this step; the schedule still spans `steps`."""
    max_minutes: float | None = Field(None, gt=0)
    """End this invocation cleanly (checkpoint, then exit code 75) after this many minutes, e.g. a
    little under the scheduler's time limit (`vitforge submit` sets it from the spec's time)."""
    collective_timeout_s: float = Field(600, gt=0)
    """Seconds each collective waits for a peer. On gloo a node lost mid-run then ends the
    surviving ranks with exit code 75 and its host's name instead of a hang (on NCCL the watchdog
    may abort them first). Longer than the longest legitimate wait inside one, e.g. the barrier
    after a checkpoint while the slowest rank uploads."""
    rendezvous_timeout_s: float = Field(900, gt=0)
    """Seconds the ranks wait at start-up for every other rank to join (a node whose container or
    first import is slow), apart from collective_timeout_s, which may be short to catch lost peers."""
    max_nonfinite: int = Field(1, ge=1)
    """Consecutive steps with a non-finite loss or gradient norm before the run stops (exit code 5)."""
    seed: int = 0
    """Seeds the weights' initialisation and dropout."""
    watchdog: bool = True
    """A hang watchdog thread on every rank (see hang_timeout_s); false: none (benchmarks)."""
    hang_timeout_s: float | None = Field(None, gt=0)
    """Seconds a rank may go without finishing a step (or a checkpoint or evaluation phase) before
    its watchdog writes every thread's stack to RUN/debug/ and ends the job with exit code 76 (a
    SLURM job requeues, a bounded number of times); null: sized from the measured step time, never
    under hang_floor_s, and above it at most 0.9 x collective_timeout_s. Below collective_timeout_s: a
    collective that gives up first ends the ranks with neither stacks nor exit code 76."""
    hang_floor_s: float = Field(300, gt=0)
    """The least timeout the watchdog sizes for itself from the step time (start-up, the first
    steps and the slowest phases need room). When set, below collective_timeout_s; with the default
    and a shorter collective_timeout_s, the collective timeout is the hang detector."""
    straggler_every: int | None = Field(100, ge=1)
    """Steps between exchanges of every rank's step and data-wait times (a rank slower than the
    median by straggler_threshold is logged with its host); null: off."""
    straggler_threshold: float = Field(0.2, gt=0)
    """How much slower than the median step time (a fraction) makes a rank a straggler."""
    profile_steps: tuple[int, int] | None = None
    """[first, last]: torch.profiler traces of these steps on every rank into RUN/profile/ (Chrome
    JSON and TensorBoard; CUDA memory snapshots on GPU); null: off, at no cost."""

    @field_validator("profile_steps")
    @classmethod
    def _window(cls, value):
        if value is not None and not 1 <= value[0] <= value[1]:
            raise ValueError(f"profile_steps {list(value)}: expected [first, last] with 1 <= first <= last")
        return value

    @model_validator(mode="after")
    def _watchdog_before_collectives(self):
        # Only a floor that was set: with the default one, a short collective_timeout_s detects hangs.
        limits = {
            "hang_timeout_s": self.hang_timeout_s,
            "hang_floor_s": self.hang_floor_s if "hang_floor_s" in self.model_fields_set else None,
        }
        for key, value in limits.items():
            if self.watchdog and value is not None and value >= self.collective_timeout_s:
                raise ValueError(
                    f"train.{key} ({value:g}) must be below train.collective_timeout_s "
                    f"({self.collective_timeout_s:g}): a collective that gives up first ends the "
                    "ranks with no stacks and no exit code 76 (or set train.watchdog=false)"
                )
        return self


class Config(Strict):
    model: ModelConfig = ModelConfig()
    data: DataConfig
    augment: AugmentConfig = AugmentConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    train: TrainConfig
    checkpoint: CheckpointConfig = CheckpointConfig()
    eval: EvalConfig = EvalConfig()
    tracking: TrackingConfig = TrackingConfig()
    deepspeed: dict = {}
    """Any DeepSpeed config keys, merged last over the generated config (e.g. {zero_optimization:
    {reduce_bucket_size: 500000000}})."""

    @model_validator(mode="after")
    def _objective_fits(self):
        # The objective table (trainer/objectives.py, torch-free) knows the names and what each refuses.
        check_config(self)
        return self

    @model_validator(mode="after")
    def _compile_fits(self):
        if self.model.compile and self.train.zero_stage == 3:
            raise ValueError(
                "model.compile needs train.zero_stage <= 2: ZeRO-3 gathers each block's parameters in "
                "hooks that would run inside the compiled block"
            )
        return self

    def accumulation(self, world_size: int) -> int:
        per_step = self.train.micro_batch * world_size
        if self.train.global_batch % per_step:
            raise ConfigError(
                f"train.global_batch {self.train.global_batch} is not divisible by train.micro_batch "
                f"{self.train.micro_batch} x {world_size} ranks = {per_step}"
            )
        return self.train.global_batch // per_step


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> Config:
    """Read a YAML recipe (a path, or the name of a shipped recipe) and apply `a.b=c` overrides."""
    return load_validated(path, list(overrides), Config, RECIPES, "config", ConfigError)
