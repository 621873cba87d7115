"""Experiment trackers (MLflow, W&B): one tracker run per vitforge run across every requeue, fed from
metrics.jsonl by a thread on rank 0, never in the step's way.

metrics.jsonl is the buffer. A background thread tails it and sends each tracker the rows it does
not hold yet; a tracker that does not answer costs one warning, its rows wait on disk and go when it
answers again (one info line says how many). Each tracker's run id and delivered mark (the last
step it holds, and how many of that step's rows: a step has a log row and may have an evaluation
row) live in the run's store as tracking.json, so a requeued or relaunched job continues the same
tracker run. A resumed run replays the steps after its checkpoint with the very same values (resume
is exact): rows at or below the mark are not sent again, so the tracker holds every step once, and
the first new row carries `resumed_from_step`, the rollback. Rows a dead tracker never got are
still in metrics.jsonl (the store keeps it with each checkpoint) and go at the next start.
On opening an existing MLflow run the mark is raised to what the server already holds, so that rows
delivered after the last save (a kill -9, an OOM, a close that overran) are not sent twice.

A tracker that refuses a batch for good (an invalid name or value, a deleted run: a client error that
no retry mends) costs one error per cause: the batch is dropped and the rows after it keep flowing.
A line of metrics.jsonl that is not a row is skipped with one warning.

Rank 0 logs the resolved config as parameters (once: MLflow's are immutable), every metrics row,
system figures with each row that is sent as it is written (CPU, host memory; GPU utilisation and
memory through NVML when pynvml is importable), and at the end of a finished run its report files
as artifacts; in names MLflow refuses, `_` replaces every character but letters, digits and `_-.:/ `.
Settings come from the recipe (tracking.*) or the trackers' own environment variables. No secret is
ever written: tracking.json holds run ids and steps, parameters come from the config (whose validator
refuses credentials in a URI), and error messages are scrubbed.

Cost: rank 0 only, one thread; per tracker a file offset and its mark; a poll reads at most
READ_BYTES of new rows and holds none after it (O(1) memory per row); tracking.json (a few hundred
bytes) is written when a tracker run starts, once the last rows are sent at close, and in between
after rows are delivered, at most every SAVE_EVERY_S: one small PUT per few seconds at most.
Other ranks hold nothing.

Modules: feed.py (the thread and the marks), sink.py (the protocol a tracker implements),
mlflow_sink.py and wandb_sink.py (one each, found by name in start.TRACKERS), system.py (the
system figures), start.py (checking and starting the trackers a config asks for).
"""

from .feed import TRACKING, TrackingFeed
from .mlflow_sink import MLFLOW_BOUNDS, MLFLOW_QUIET, MLflowSink
from .sink import Sink
from .start import TRACKERS, check_trackers, start_tracking, trackers_on
from .system import SystemFigures
from .wandb_sink import WandbSink

__all__ = [
    "MLFLOW_BOUNDS",
    "MLFLOW_QUIET",
    "TRACKERS",
    "TRACKING",
    "MLflowSink",
    "Sink",
    "SystemFigures",
    "TrackingFeed",
    "WandbSink",
    "check_trackers",
    "start_tracking",
    "trackers_on",
]
