"""Logging set-up shared by every subcommand: INFO on rank 0, warnings only elsewhere."""

from __future__ import annotations

import logging
import sys

from .errors import UsageError
from .scheduler import scheduler_env


def process_rank() -> int:
    """This process's rank under torchrun, the deepspeed launcher or srun (0 when alone). 0 too when
    the environment cannot be read, so that logging works and the error is reported by what reads it."""
    try:
        return scheduler_env().rank
    except UsageError:
        return 0


def setup_logging() -> None:
    rank = process_rank()
    level = logging.INFO if rank == 0 else logging.WARNING
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s [rank {rank}] %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
        force=True,
    )
    # botocore says at INFO where it found the endpoint, once per client: a line per shard reader.
    for chatty in ("botocore", "boto3", "s3transfer", "aiobotocore"):
        logging.getLogger(chatty).setLevel(max(level, logging.WARNING))
