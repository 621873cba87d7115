"""Local stand-ins for the services vitforge talks to in production (an S3 server, a SLURM cluster,
the GCS and Azure Blob emulators, an MLflow tracking server, an HTTP file server), used by the tests, `vitforge demo`
and the benchmarks. Each server stand-in runs through managed.py (its own process group, a log file, a
readiness probe, stopped as a group).

No product package (core, shards, pipeline, trainer, cluster) imports this package: production code
never depends on a stand-in (tests/unit/test_architecture.py checks it). Only the `vitforge` front-end's `demo`
command (importing it inside the function that needs it), tests/ and benchmarks/ do.
"""

from .local_azure import LocalAzure, start_local_azure
from .local_gcs import LocalGCS, start_local_gcs
from .local_http import LocalHTTP, QuietHTTPServer, start_local_http
from .local_mlflow import LocalMLflow, start_local_mlflow
from .local_s3 import LocalS3, start_local_s3
from .local_slurm import LOCAL_SLURM_SETTINGS, local_slurm_missing, start_local_slurm, stop_local_slurm

__all__ = [
    "LOCAL_SLURM_SETTINGS",
    "LocalAzure",
    "LocalGCS",
    "LocalHTTP",
    "LocalMLflow",
    "LocalS3",
    "QuietHTTPServer",
    "local_slurm_missing",
    "start_local_azure",
    "start_local_gcs",
    "start_local_http",
    "start_local_mlflow",
    "start_local_s3",
    "start_local_slurm",
    "stop_local_slurm",
]
