"""The config sections for what a run leaves and reports: its checkpoints (`checkpoint`), the
probes that evaluate it (`eval`) and its experiment trackers (`tracking`). The whole schema and
the training sections: config.py."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from vitforge.core import check_no_userinfo, check_store_url, is_remote, read_only, read_only_error, store_schemes
from vitforge.core.settings import Strict
from vitforge.core.store import scheme_of

MLFLOW_CREDENTIALS = "MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN)"


class MLflowTracking(Strict):
    uri: str | None = None
    """The tracking server; null: MLFLOW_TRACKING_URI. Credentials never go here (the client
    reads MLFLOW_TRACKING_USERNAME/PASSWORD or MLFLOW_TRACKING_TOKEN from the environment)."""
    experiment: str | None = None
    """null: MLFLOW_EXPERIMENT_NAME, else "vitforge"."""
    run_name: str | None = None
    """null: checkpoint.run."""

    @field_validator("uri")
    @classmethod
    def _no_credentials(cls, value):
        if value is not None:
            check_no_userinfo(value, "the URI", MLFLOW_CREDENTIALS)
        return value


class WandbTracking(Strict):
    project: str | None = None
    """null: WANDB_PROJECT, else "vitforge"."""
    entity: str | None = None
    """null: WANDB_ENTITY (the API key only ever comes from WANDB_API_KEY or `wandb login`)."""
    mode: Literal["online", "offline"] | None = None
    """null: WANDB_MODE, else online."""
    run_name: str | None = None
    """null: checkpoint.run."""


class TrackingConfig(Strict):
    """Experiment trackers, logged from rank 0 off the step: each row of metrics.jsonl, the config
    as parameters, system figures, and the run's files at the end; one tracker run per vitforge run
    across every requeue. Both may be on at once; each needs its extra (vitforge[mlflow], [wandb])."""

    mlflow: MLflowTracking | None = None
    """{} turns it on with the environment's settings; null: off."""
    wandb: WandbTracking | None = None
    """{} turns it on with the environment's settings; null: off."""


class CheckpointConfig(Strict):
    dir: str = "runs"
    """A local folder, file:// or a store's URL (s3://, gs://, az://BUCKET/PREFIX); the run lives in DIR/RUN."""
    run: str = "run"
    """The run's name: one folder of checkpoints, owned by one job at a time."""
    init_from: str | None = None
    """Fine-tuning: a run or checkpoint (folder or URL) of ours, or a timm-format state-dict file."""
    save: bool = True
    """false: never write checkpoints (benchmarks)."""
    resume: str | int = "auto"
    """auto: the newest complete checkpoint (falling back past broken ones); never; a step number; or a
    checkpoint URL (DIR/RUN/step_NNNNNNNN)."""
    staging: str | None = None
    """Node-local folder for checkpoint files before upload; null: the temp folder."""
    log_dir: str | None = None
    """Folder for metrics.jsonl and TensorBoard; null: the run folder if local, else ./logs/RUN."""
    keep_last: int | None = Field(3, ge=1)
    """Newest complete checkpoints kept; null: all."""
    keep_every: int | None = Field(None, ge=1)
    """Also keep every checkpoint whose step is a multiple of this."""
    lease_minutes: float = Field(10.0, gt=0)
    """A run is owned by one job at a time; another job takes it over only after watching its lease
    unchanged this long (on its own monotonic clock, never comparing hosts' wall clocks)."""
    upload_timeout_minutes: float = Field(60.0, gt=0)
    """Rank 0 waits this long for every rank's upload."""

    @field_validator("dir")
    @classmethod
    def _known_scheme(cls, value: str) -> str:
        scheme = scheme_of(value)
        if read_only(value):
            raise ValueError(str(read_only_error(value)))
        if scheme not in store_schemes():
            raise ValueError(
                f"{value!r}: no store for {scheme}:// (a local folder, or one of "
                f"{', '.join(s + '://' for s in store_schemes())})"
            )
        if is_remote(value) and not value.split("://", 1)[1].split("/", 1)[0]:
            raise ValueError(f"{value!r}: no bucket in the {scheme}:// URL")
        check_store_url(value)
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


class ProbeData(Strict):
    """One probe dataset: labelled shards (the forms data.train takes) for its two splits."""

    train: str
    """The split the shots (few-shot), the neighbours (kNN) and the all-data probe's rows come from."""
    test: str
    """The split the probes are scored on."""


class EvalConfig(Strict):
    """Evaluators of the frozen representation, run every eval.every steps of a training run (and
    at its end), and by `vitforge eval`: the pre-logits features of every image of each probe
    dataset, then closed-form linear probes and kNN on them."""

    probes: dict[str, ProbeData] = {}
    """Probe datasets by name, e.g. {pets: {train: s3://b/pets-train, test: s3://b/pets-test}}."""
    every: int | None = Field(None, ge=1)
    """Steps between the probes (they also run at the end); null: train.eval_every."""
    fewshot: list[int] = []
    """Linear few-shot top-1 for these shots per class (the ViT paper's: [1, 5, 10, 25]); []: off."""
    knn: int | None = None
    """kNN top-1 with this many neighbours (cosine similarity; 20 is DINO's); null: off."""
    linear: bool = False
    """Linear probe on every row of each probe's train split."""
    seed: int = Field(0, ge=0)
    """Draws the shots: the same images at every evaluation of a run, at any world size."""
    allow_fewer: bool = False
    """A class with fewer images than the shots asked for gives all it has, instead of an error."""

    @field_validator("fewshot")
    @classmethod
    def _shots(cls, value: list[int]) -> list[int]:
        if any(k < 1 for k in value):
            raise ValueError(f"shots per class must be >= 1, not {value}")
        return sorted(set(value))

    @field_validator("knn")
    @classmethod
    def _neighbours(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise ValueError(f"knn must be >= 1 neighbours, or null, not {value}")
        return value

    @field_validator("probes")
    @classmethod
    def _probe_names(cls, value: dict) -> dict:
        bad = [name for name in value if not re.fullmatch(r"[A-Za-z0-9_]+", name)]
        if bad:
            raise ValueError(
                f"probe names become metric names (eval_fewshot_NAME_5shot): letters, digits and _ only, not {bad[0]!r}"
            )
        return value

    @model_validator(mode="after")
    def _probes_for_evaluators(self):
        asked = [name for name, on in (("fewshot", self.fewshot), ("knn", self.knn), ("linear", self.linear)) if on]
        if asked and not self.probes:
            raise ValueError(
                f"eval.{asked[0]} needs eval.probes: datasets to probe, e.g. "
                "{pets: {train: DIR/pets-train, test: DIR/pets-test}}"
            )
        if self.probes and not asked:
            raise ValueError(
                "eval.probes is set but no evaluator is on: set eval.fewshot (e.g. [1, 5, 10, 25]), "
                "eval.knn or eval.linear"
            )
        return self
