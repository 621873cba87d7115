"""One validated configuration schema: YAML recipes plus `--set a.b=c` overrides.

An unknown key or a value of the wrong type is an error that names the key; batch arithmetic is
checked once, here, with a message that shows the numbers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

RECIPES = Path(__file__).resolve().parent / "recipes"


class ConfigError(ValueError):
    pass


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(Strict):
    name: str = "vit_base_patch16_224"  # a timm name, or one of trainer.model.TINY_MODELS
    image_size: int = 224
    num_classes: int | None = None  # None: from the training set's dataset.json
    drop_path: float = 0.0
    grad_checkpointing: bool = False


class DataConfig(Strict):
    train: str  # dataset folder or s3:// prefix (dataset.json), or "synthetic"
    val: str | None = None
    backend: Literal["auto", "dali", "dali-cpu", "torch", "synthetic"] = "auto"
    workers: int = 4
    seed: int = 0


class OptimizerConfig(Strict):
    name: Literal["adamw", "sgd"] = "adamw"
    lr: float = 3e-4  # peak learning rate
    betas: tuple[float, float] = (0.9, 0.999)
    momentum: float = 0.9
    weight_decay: float = 0.1  # never on norms, biases, position embeddings or the class token
    warmup_steps: int = 10_000
    schedule: Literal["linear", "cosine", "constant"] = "linear"
    min_lr: float = 0.0
    grad_clip: float = 1.0


class TrainConfig(Strict):
    steps: int
    global_batch: int
    micro_batch: int  # per rank, per forward pass; accumulation = global / (micro * world size)
    precision: Literal["fp32", "bf16"] = "bf16"
    zero_stage: Literal[0, 1, 2, 3] = 2
    offload_optimizer: bool = False
    offload_params: bool = False
    ema_decay: float | None = None  # Polyak averaging of the weights, e.g. 0.9999 for fine-tuning
    eval_every: int = 1000
    log_every: int = 10
    checkpoint_every: int = 1000
    stop_at: int | None = None  # end this invocation (after a checkpoint) at this step; the schedule still spans `steps`
    seed: int = 0


class CheckpointConfig(Strict):
    dir: str = "runs"
    run: str = "run"
    init_from: str | None = None  # fine-tuning: our checkpoint folder, or a timm-format state-dict file
    save: bool = True  # false: never write checkpoints (benchmarks)


class Config(Strict):
    model: ModelConfig = ModelConfig()
    data: DataConfig
    optimizer: OptimizerConfig = OptimizerConfig()
    train: TrainConfig
    checkpoint: CheckpointConfig = CheckpointConfig()
    deepspeed: dict = {}  # any DeepSpeed config key, applied last over the generated config

    def accumulation(self, world_size: int) -> int:
        per_step = self.train.micro_batch * world_size
        if self.train.global_batch % per_step:
            raise ConfigError(
                f"train.global_batch {self.train.global_batch} is not divisible by train.micro_batch "
                f"{self.train.micro_batch} x {world_size} ranks = {per_step}")
        return self.train.global_batch // per_step


def load_config(path: str | Path, overrides: list[str] = ()) -> Config:
    """Read a YAML recipe (a path, or the name of a shipped recipe) and apply `a.b=c` overrides."""
    path = Path(path)
    if not path.exists() and (RECIPES / f"{path}.yaml").exists():
        path = RECIPES / f"{path}.yaml"
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        shipped = ", ".join(sorted(p.stem for p in RECIPES.glob("*.yaml")))
        raise ConfigError(f"{path}: no such config file (shipped recipes: {shipped})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. train.steps=100")
        _assign(raw, key.split("."), yaml.safe_load(value))
    try:
        return Config.model_validate(raw)
    except ValidationError as e:
        problems = []
        for error in e.errors():
            key = ".".join(str(p) for p in error["loc"]) or "(top level)"
            message = "unknown key" if error["type"] == "extra_forbidden" else error["msg"]
            problems.append(f"{key}: {message}" + (f" (got {error['input']!r})" if error["type"] != "extra_forbidden"
                                                   and not isinstance(error["input"], dict) else ""))
        raise ConfigError(f"{path}: " + "; ".join(problems)) from None


def _assign(tree: dict, keys: list[str], value) -> None:
    for key in keys[:-1]:
        node = tree.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {'.'.join(keys)}: {key} is not a section")
        tree = node
    tree[keys[-1]] = value
