"""What the benchmarks share: running a child process so that, when it fails, the run says why;
for smoke runs, that child forked from the benchmark's own process, its imports paid once."""

from __future__ import annotations

import gc
import importlib
import multiprocessing
import os
import resource
import runpy
import subprocess
import sys
import tempfile
import threading

STDERR_TAIL = 3000  # characters: a traceback's end, without pages of warnings before it
FORK_HELP = ("run each child process as a fork of this one, which imports what they import once (smoke runs: "
             "a fork's start-up is not a fresh interpreter's, and what one reads only at its start is this one's)")


def run_child(cmd: list, stdout=subprocess.PIPE, fork: bool = False, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run of `cmd` with its stderr captured (text); with `fork`, `cmd` (a `python`
    command line) runs in a fork of this process instead (forked), both outputs captured. A
    non-zero exit ends the benchmark (SystemExit, exit code 1) with the command and the tail of the
    child's stderr: a captured stderr is otherwise lost, and CalledProcessError alone says only the
    exit code."""
    result = (forked(cmd, **kwargs) if fork else
              subprocess.run(cmd, stdout=stdout, stderr=subprocess.PIPE, text=True, **kwargs))
    if result.returncode != 0:
        raise SystemExit(f"{describe(cmd)} exited {result.returncode}; the end of its stderr:\n"
                         f"{result.stderr[-STDERR_TAIL:]}")
    return result


def preload(*modules: str) -> None:
    """Import `modules` here, so that every child forked later has them (torch, DeepSpeed and timm
    cost seconds of CPU apiece on 2 cores, a fork of a process that holds them nothing)."""
    for name in modules:
        importlib.import_module(name)
    # Out of the collector's sight: a fork's every collection would otherwise walk the 600,000
    # objects it inherited (0.8 s of CPU each here), copying every page that holds one.
    gc.freeze()


def forked(cmd: list, env: dict | None = None, cwd=None) -> subprocess.CompletedProcess:
    """`cmd`, a `python` command line (`-c CODE`, `-m MODULE` or `SCRIPT`, then its arguments), run
    as the interpreter would run it, in a fork of this process with `env` (else this one's) and in
    `cwd`. Started and reaped by multiprocessing, as its own child: its exit code as a fresh
    process's (SystemExit's code; 1 and a traceback on stderr for an exception), its CPU in this
    process's RUSAGE_CHILDREN."""
    if threading.active_count() > 1:  # a lock another thread held would stay held in the fork forever
        raise RuntimeError(f"{threading.active_count()} threads run in this process: a fork copies only one")
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        for stream in (sys.stdout, sys.stderr):  # else the child would write this process's buffer again
            stream.flush()
        child = multiprocessing.get_context("fork").Process(
            target=_become, args=(cmd[1:], env, cwd, out.fileno(), err.fileno()))
        child.start()
        child.join()
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(cmd, child.exitcode, out.read().decode(errors="replace"),
                                           err.read().decode(errors="replace"))


def _become(argv: list[str], env: dict | None, cwd, out: int, err: int) -> None:
    os.dup2(out, 1)
    os.dup2(err, 2)
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    if argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
    elif argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        runpy.run_path(argv[0], run_name="__main__")


def rss_mb() -> float:
    """The peak resident memory of this process so far (ru_maxrss), MB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def describe(cmd: list) -> str:
    """The command as one line, each inline script (`python -c`) reduced to its first line."""
    return " ".join(str(arg).strip().splitlines()[0] + " ..." if "\n" in str(arg).strip() else str(arg)
                    for arg in cmd)
