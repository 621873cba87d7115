"""Checking and starting the trackers a config asks for (tracking.mlflow, tracking.wandb)."""

from __future__ import annotations

import importlib
import importlib.util
import os
import threading

from vitforge.core import check_no_userinfo, registry

from ..config import Config, ConfigError
from ..output_config import MLFLOW_CREDENTIALS, TrackingConfig
from ..run_store import RunStore
from .feed import TrackingFeed

# tracking.<name> -> its sink class (sink.py's protocol), imported when a run starts one; the name is
# also the client's module and the pip extra that installs it.
TRACKERS = {
    "mlflow": "vitforge.trainer.tracking.mlflow_sink:MLflowSink",
    "wandb": "vitforge.trainer.tracking.wandb_sink:WandbSink",
}


def trackers_on(tracking: TrackingConfig) -> list[str]:
    """The trackers asked for; each is the name of its client module and of its pip extra."""
    return [name for name in TRACKERS if getattr(tracking, name) is not None]


def check_trackers(tracking: TrackingConfig, warm: bool = False) -> None:
    """Every rank, before anything is built: the same ConfigError everywhere when a tracker's client
    is missing or MLflow has no server to talk to (found, not imported: `import mlflow` takes seconds).
    `warm` (rank 0): import the clients in a background thread meanwhile, so that the import overlaps
    the model's build instead of delaying the feed's first rows (and a preempted job's exit)."""
    names = trackers_on(tracking)
    for name in names:
        if importlib.util.find_spec(name) is None:
            raise ConfigError(f"tracking.{name} is on but its client is not installed: pip install 'vitforge[{name}]'")
    if tracking.mlflow is not None and not (tracking.mlflow.uri or os.environ.get("MLFLOW_TRACKING_URI")):
        raise ConfigError(
            "tracking.mlflow is on but names no server: set tracking.mlflow.uri or "
            "MLFLOW_TRACKING_URI (e.g. http://mlflow.example:5000)"
        )
    if tracking.mlflow is not None and not tracking.mlflow.uri:
        # the client would take it as it is and send the password with every request
        check_no_userinfo(os.environ["MLFLOW_TRACKING_URI"], "MLFLOW_TRACKING_URI", MLFLOW_CREDENTIALS, ConfigError)
    if warm and names:
        threading.Thread(target=_import, args=(names,), name="vitforge-tracking-import", daemon=True).start()


def _import(names: list[str]) -> None:
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:  # the feed imports it again, and says why it cannot
            return


def start_tracking(
    cfg: Config, run_store: RunStore, metrics_path: str, resumed_from: int | None
) -> TrackingFeed | None:
    """Rank 0: start feeding the trackers the run's config and metrics_path's rows; None when no
    tracker is on. `resumed_from`: the step restored from a checkpoint (None: a fresh run).
    Returns at once: the store and the trackers are only ever touched by the feed's thread."""
    check_trackers(cfg.tracking)
    folder = os.path.dirname(metrics_path)
    sinks = [
        registry.resolve(TRACKERS, name)(getattr(cfg.tracking, name), cfg.checkpoint.run, folder)
        for name in trackers_on(cfg.tracking)
    ]
    if not sinks:
        return None
    # Without checkpoints (checkpoint.save false) nothing resumes: no tracking.json either.
    feed = TrackingFeed(
        sinks, run_store if cfg.checkpoint.save else None, metrics_path, resumed_from, cfg.model_dump(mode="json")
    )
    feed.start()
    return feed
