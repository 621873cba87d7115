"""The foundation every vitforge package imports downward: object stores, retries, all-or-nothing
files, checksums, progress, logging set-up, errors and exit codes, the version."""

__version__ = "0.2.0"

from .errors import (
    CheckpointError,
    DivergedError,
    PreconditionFailed,
    StorageError,
    UsageError,
    VitforgeError,
)
from .files import PARTIAL_MARK, atomic_path, atomic_write, create_file, sha256_file
from .logs import process_rank, setup_logging
from .net import free_port
from .process import die_with_parent, record_exit_code
from .progress import Progress
from .retry import TransientError, with_retries
from .scheduler import SCHEDULERS, Scheduler, SchedulerEnv, first_host, scheduler_env
from .store import (
    ENTRY_POINT_GROUP,
    LocalWriteError,
    ObjectInfo,
    Store,
    is_remote,
    local_write_error,
    object_store,
    open_store,
    process_alive,
    read_only,
    read_only_error,
    register_store,
    store_schemes,
)
from .urls import check_no_userinfo, check_store_url, masked, without_userinfo

__all__ = [
    "ENTRY_POINT_GROUP",
    "PARTIAL_MARK",
    # where this process sits in its job
    "SCHEDULERS",
    "CheckpointError",
    "DivergedError",
    "LocalWriteError",
    "ObjectInfo",
    "PreconditionFailed",
    "Progress",
    "Scheduler",
    "SchedulerEnv",
    "StorageError",
    "Store",
    "TransientError",
    "UsageError",
    "VitforgeError",
    "__version__",
    "atomic_path",
    "atomic_write",
    "check_no_userinfo",
    "check_store_url",
    "create_file",
    "die_with_parent",
    "first_host",
    "free_port",
    "is_remote",
    "local_write_error",
    "masked",
    "object_store",
    "open_store",
    "process_alive",
    "process_rank",
    "read_only",
    "read_only_error",
    "record_exit_code",
    "register_store",
    "scheduler_env",
    "setup_logging",
    "sha256_file",
    "store_schemes",
    "with_retries",
    "without_userinfo",
]
