"""The foundation every vitforge package imports downward: object stores, retries, all-or-nothing
files, checksums, progress, logging set-up, errors and exit codes, the version."""

__version__ = "0.2.0"

from .errors import (CheckpointError, DivergedError, PreconditionFailed, StorageError, UsageError,  # noqa: E402
                     VitforgeError)
from .files import PARTIAL_MARK, atomic_path, atomic_write, create_file, sha256_file  # noqa: E402
from .logs import process_rank, setup_logging  # noqa: E402
from .net import free_port  # noqa: E402
from .process import die_with_parent, record_exit_code  # noqa: E402
from .progress import Progress  # noqa: E402
from .retry import TransientError, with_retries  # noqa: E402
from .scheduler import SCHEDULERS, Scheduler, SchedulerEnv, first_host, scheduler_env  # noqa: E402
from .store import (ENTRY_POINT_GROUP, LocalWriteError, ObjectInfo, Store, is_remote, local_write_error,  # noqa: E402
                    object_store, open_store, process_alive, read_only, read_only_error, register_store,
                    store_schemes)
from .urls import check_no_userinfo, check_store_url, masked, without_userinfo  # noqa: E402

__all__ = [
    "CheckpointError", "DivergedError", "ENTRY_POINT_GROUP", "LocalWriteError", "ObjectInfo", "PARTIAL_MARK",
    "PreconditionFailed", "Progress", "StorageError", "Store", "TransientError", "UsageError", "VitforgeError",
    "__version__", "atomic_path", "atomic_write", "check_no_userinfo", "check_store_url", "create_file",
    "die_with_parent", "free_port", "is_remote",
    "local_write_error", "masked", "object_store", "open_store", "process_alive", "process_rank", "record_exit_code",
    "without_userinfo",
    "read_only", "read_only_error", "register_store",
    "setup_logging", "sha256_file", "store_schemes", "with_retries",
    # where this process sits in its job
    "SCHEDULERS", "Scheduler", "SchedulerEnv", "first_host", "scheduler_env",
]
