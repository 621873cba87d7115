"""Weights & Biases as a tracker: one W&B run per vitforge run, started with the stored (or a new) id;
`wandb` (`vitforge[wandb]`) is imported when the feed first uses it."""

from __future__ import annotations

import os
import uuid
from typing import Any

from ..output_config import WandbTracking


class WandbSink:
    """A W&B run, always started with the stored (or a new) id and resume="allow"."""

    name, key = "W&B", "wandb"

    def __init__(self, settings: WandbTracking, run: str, folder: str):
        self.settings, self.run_name, self.folder = settings, settings.run_name or run, folder
        self.project = settings.project or os.environ.get("WANDB_PROJECT") or "vitforge"
        self.place = f"project {self.project}"
        self.run: Any = None  # wandb's Run, once opened
        self.run_id: str | None = None

    def record(self) -> dict:
        return {"run_id": self.run_id}

    def open(self, stored: dict, config: dict) -> bool:
        self.run_id = stored["run_id"]
        self._init(config)
        return True

    def create(self, config: dict, keep) -> None:
        self.run_id = uuid.uuid4().hex[:16]  # W&B's own ids are 8 characters of [a-z0-9]
        keep()  # before the run exists: a job killed during init still comes back to this id
        self._init(config)

    def _init(self, config: dict) -> None:
        import wandb

        s = self.settings
        # console off: W&B would otherwise wrap this process's stdout and stderr; its own system
        # monitor is off too: the feed sends the system figures with the rows.
        self.run = wandb.init(
            id=self.run_id,
            resume="allow",
            project=self.project,
            entity=s.entity,
            mode=s.mode,
            name=self.run_name,
            dir=None if os.environ.get("WANDB_DIR") else self.folder,
            settings=wandb.Settings(console="off", x_disable_stats=True, silent=True),
        )
        self.run.config.update(config, allow_val_change=True)

    def held(self) -> tuple[int, int]:
        return (-1, 0)  # the stored mark only: an offline run has no server to ask

    def send(self, rows: list[tuple[int, dict]]) -> None:
        for step, values in rows:
            self.run.log(values, step=step)

    @staticmethod
    def permanent(error: Exception) -> bool:
        """Values W&B cannot log, or a misuse; its network errors are retried by its own service."""
        from wandb.errors import UsageError

        return isinstance(error, (TypeError, ValueError, UsageError))

    def upload(self, paths: list[str]) -> None:
        import wandb

        artifact = wandb.Artifact(f"{self.run_id}-report", type="run-report")
        for path in paths:
            artifact.add_file(path)
        self.run.log_artifact(artifact)

    def finish(self, finished: bool) -> None:
        if not finished:
            self.run.mark_preempting()
        self.run.finish(exit_code=0 if finished else 1)
