"""Metrics of a run: one JSON line per log step in metrics.jsonl, and TensorBoard scalars."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("vitforge.train")


@dataclass
class MetricsLog:
    folder: str
    enabled: bool  # rank 0 only
    writer: Any = field(default=None, repr=False)  # a tensorboard SummaryWriter, when installed

    @property
    def path(self) -> str:
        return os.path.join(self.folder, "metrics.jsonl")

    def open(self) -> None:
        if not self.enabled:
            return
        os.makedirs(self.folder, exist_ok=True)
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(os.path.join(self.folder, "tensorboard"))
        except ImportError:
            log.info("tensorboard is not installed: metrics go to metrics.jsonl only")

    def resume_at(self, step: int, saved: bytes | None) -> None:
        """Keep only lines up to the restored step, so a resumed run has no stale or duplicated
        steps. `saved`: the run's metrics from the store, used when this machine has none."""
        if not self.enabled:
            return
        os.makedirs(self.folder, exist_ok=True)
        text = Path(self.path).read_text() if os.path.exists(self.path) else (saved or b"").decode()
        kept = [line for line in text.splitlines() if line.strip() and json.loads(line).get("step", 0) <= step]
        with open(self.path, "w") as f:
            f.write("".join(line + "\n" for line in kept))

    def write(self, step: int, values: dict) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **values}) + "\n")
        if self.writer is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)):
                    self.writer.add_scalar(key, value, step)
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
