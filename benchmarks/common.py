"""What the benchmarks share: running a child process so that, when it fails, the run says why."""

from __future__ import annotations

import subprocess

STDERR_TAIL = 3000  # characters: a traceback's end, without pages of warnings before it


def run_child(cmd: list, stdout=subprocess.PIPE, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run of `cmd` with its stderr captured (text). A non-zero exit ends the benchmark
    (SystemExit, exit code 1) with the command and the tail of the child's stderr: a captured
    stderr is otherwise lost, and CalledProcessError alone says only the exit code."""
    result = subprocess.run(cmd, stdout=stdout, stderr=subprocess.PIPE, text=True, **kwargs)
    if result.returncode != 0:
        raise SystemExit(f"{describe(cmd)} exited {result.returncode}; the end of its stderr:\n"
                         f"{result.stderr[-STDERR_TAIL:]}")
    return result


def describe(cmd: list) -> str:
    """The command as one line, each inline script (`python -c`) reduced to its first line."""
    return " ".join(str(arg).strip().splitlines()[0] + " ..." if "\n" in str(arg).strip() else str(arg)
                    for arg in cmd)
