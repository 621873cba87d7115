"""One error taxonomy and one exit-code convention for every `vitforge` subcommand.

A `VitforgeError` is a failure we expected and can explain in one line: the CLI prints
`vitforge: <kind>: <message>` and exits with the class's code, never a traceback. Anything else
is a bug and exits with INTERNAL and its traceback. The codes are listed in the README.
"""

from __future__ import annotations

OK = 0
CHECK_FAILED = 1  # a verification ran and found problems (`shard verify`, `ckpt verify`)
USAGE = 2  # bad arguments, config, input data or model name
STORAGE = 3  # a store is unreachable, denies access, or is owned by another job
CHECKPOINT = 4  # a checkpoint is missing, incomplete, corrupt or does not fit the model
DIVERGED = 5  # the loss or gradient norm became non-finite
INTERNAL = 70  # a bug: the traceback is printed (sysexits EX_SOFTWARE)
REQUEUE = 75  # stopped early on a signal or time limit, checkpoint saved: run again to resume (EX_TEMPFAIL)
HUNG = 76  # a step or checkpoint/evaluation phase hung: stacks in RUN/debug/; rerun resumes (bounded requeues)
INTERRUPTED = 130  # Ctrl-C (128 + SIGINT, as a shell reports it)


class VitforgeError(Exception):
    exit_code = INTERNAL
    kind = "error"


class UsageError(VitforgeError, ValueError):
    exit_code = USAGE
    kind = "usage error"


class StorageError(VitforgeError, OSError):
    exit_code = STORAGE
    kind = "storage error"


class PreconditionFailed(StorageError):
    """A conditional write lost: the object changed (or appeared) since it was read."""


class CheckpointError(VitforgeError):
    exit_code = CHECKPOINT
    kind = "checkpoint error"


class DivergedError(VitforgeError):
    exit_code = DIVERGED
    kind = "diverged"
