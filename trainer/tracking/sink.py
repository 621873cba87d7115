"""What the feed needs of a tracker: the protocol each sink (mlflow_sink.py, wandb_sink.py) implements.
A sink is built as `Sink(settings, run, folder)`: its section of the recipe's tracking settings, the
run's name, and the folder metrics.jsonl is in."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol


class Sink(Protocol):
    name: str
    """How messages name it, e.g. "MLflow"."""
    key: str
    """Its key in tracking.json, e.g. "mlflow"."""
    place: str
    """Where its runs are, for messages: "experiment vitforge"."""
    run_id: str | None

    def record(self) -> dict:
        """What tracking.json keeps of it (its run id), beside the feed's mark."""

    def open(self, stored: dict, config: dict) -> bool:
        """Continue the run tracking.json names; False when the tracker no longer has it."""

    def create(self, config: dict, keep: Callable[[], None]) -> None:
        """A new run with the config as its parameters; `keep()` saves its id once it has one."""

    def held(self) -> tuple[int, int]:
        """The delivered mark the tracker itself proves: (step, rows of it), (-1, 0) for none."""

    def send(self, rows: list[tuple[int, dict]]) -> None:
        """Log (step, values) rows, in order."""

    @staticmethod
    def permanent(error: Exception) -> bool:
        """Whether `error` refuses the batch for good (no retry would mend it)."""

    def upload(self, paths: list[str]) -> None:
        """The run's report files, as artifacts."""

    def finish(self, finished: bool) -> None:
        """End the run: finished, or killed until the next incarnation reopens it."""
