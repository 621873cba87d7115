"""A fork server for the tests' CLI and rank launches: `python -m vitforge ...` with its imports paid once.

A `vitforge train` rank on this machine costs about 6 s of CPU before its first step, 4.5 s of it
importing torch, DeepSpeed and timm; a tiny model's 25 steps cost 0.3 s more. The suite starts
hundreds of them on 2 cores, so the imports were most of its CPU. The zygote (one per pytest
process, started at its first launch) imports them once and forks a child per launch; the child
takes the launch's argv, environment, working folder and stdio, and runs the same `vitforge.cli.main`
as `python -m vitforge` does, as a real process of its own: its own pid to signal, its own exit
code, its own ranks' collectives. It reads os.environ at run time as a fresh process would; what a
fresh interpreter reads only at start (PYTHON*, a preloaded library, faketime) cannot be given to a
fork, so such launches start a fresh process (`usable`). Under `make coverage` every launch starts a
fresh process too: coverage measures a fork's main thread but no thread the fork starts (the
loader's read-ahead, the cache's fetches, the lease's heartbeat), which a run with forks lost
(`make coverage` at af80be7: pipeline/ahead.py 14 of 32 lines against 25 fresh). What a fork shares with the zygote and a fresh process does not:
the modules already imported (a test of what a command imports starts a fresh process itself) and
the string-hash seed (ranks forked from one zygote iterate a set of strings in one order; the ranks
SLURM, srun and torchrun start in the cluster, kill -9 and world-size tests are fresh processes,
each with its own).

Protocol, over a Unix socket: the client sends one JSON request (argv, env, cwd) with its stdin,
stdout and stderr file descriptors (SCM_RIGHTS); the zygote answers {"pid": N} once forked and
{"returncode": R} (Popen's convention: -signal when killed) when it has reaped the child.
"""

from __future__ import annotations

import gc
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

# What a fork cannot take from a launch's environment: read once, when an interpreter starts or
# when the preloaded modules import (OpenMP's and MKL's thread counts, torch's and DeepSpeed's
# import-time settings, Hugging Face's and fsspec's configuration, CUDA's device list).
START_ONLY = ("PYTHON", "LD_PRELOAD", "FAKETIME", "COVERAGE_", "OMP_", "MKL_", "TORCH", "DS_", "HF_",
              "CUDA_", "FSSPEC_")


def usable(env: dict, zygote_env: dict) -> bool:
    """Whether a launch with `env` may be a fork of a zygote started with `zygote_env`."""
    if "COVERAGE_PROCESS_CONFIG" in env or "COVERAGE_PROCESS_START" in env:
        return False  # coverage traces no thread a fork starts: measured launches start afresh
    names = {name for name in {*env, *zygote_env} if name.startswith(START_ONLY)}
    return all(env.get(n) == zygote_env.get(n) for n in names)


def _preload() -> None:
    """The modules every training, eval and export command imports. Importing them starts no
    thread, so each fork is a whole copy (checked by serve)."""
    import deepspeed  # noqa: F401
    import timm  # noqa: F401
    import torch  # noqa: F401

    # deepspeed.initialize imports its muon optimizer, whose import wraps functions in torch.compile
    # and so loads inductor: 2.5 s of CPU in every rank unless done here once.
    import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401

    import vitforge.cli  # noqa: F401
    import vitforge.trainer.cli  # noqa: F401
    import vitforge.trainer.entry  # noqa: F401
    import vitforge.pipeline.torch_backend  # noqa: F401

    # What is loaded now is kept out of the collector's reach: a child's collections would otherwise
    # walk the ~500k inherited objects (0.6-0.8 s of CPU each) and copy the pages they sit on.
    gc.collect()
    gc.freeze()


def serve(path: str) -> dict:
    """Accept launches while the process that started this one lives; returns only in a forked
    child, with its request."""
    if threading.active_count() != 1:
        raise RuntimeError(f"the zygote runs {threading.active_count()} threads: a fork would copy only one")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # the client waits for this name: bound and listening
    wakeup_read, wakeup_write = os.pipe()
    os.set_blocking(wakeup_write, False)
    signal.set_wakeup_fd(wakeup_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(wakeup_read, selectors.EVENT_READ)
    waiting: dict[int, socket.socket] = {}
    parent = os.getppid()
    while os.getppid() == parent:  # the zygote ends with its pytest process; its children run on
        for key, _ in selector.select(timeout=1):
            if key.fileobj is listener:
                connection, _ = listener.accept()
                message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 3)
                pid = os.fork()
                if pid == 0:
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    # Closed through their objects: a socket closed by its number alone would close
                    # that number again when collected, by then another file of the child's.
                    selector.close()
                    for sock in (listener, connection, *waiting.values()):
                        sock.close()
                    os.close(wakeup_read)
                    os.close(wakeup_write)
                    for target, fd in enumerate(fds):
                        os.dup2(fd, target)
                        os.close(fd)
                    return json.loads(message)
                for fd in fds:
                    os.close(fd)
                connection.sendall(json.dumps({"pid": pid}).encode() + b"\n")
                waiting[pid] = connection
            else:
                os.read(wakeup_read, 4096)
        while waiting:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            connection = waiting.pop(pid)
            try:
                connection.sendall(json.dumps({"returncode": _returncode(status)}).encode() + b"\n")
            except OSError:  # the client went away: nobody to tell
                pass
            connection.close()
    sys.exit(0)


def _returncode(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def run_child(request: dict) -> None:
    """Become `python -m vitforge *argv` in `cwd` with `env`: the child's whole remaining life."""
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    tempfile.tempdir = None  # cached by the zygote's first gettempdir(); a fresh process reads TMPDIR
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", closefd=False)
    sys.argv = [sys.argv[0], *request["argv"]]
    gc.collect()  # what the zygote left for the collector is finalised now, before the command opens a file
    import numpy

    numpy.random.seed()  # a fresh interpreter's numpy is seeded from the OS, not from its zygote
    from vitforge.cli import main

    sys.exit(main(request["argv"]))


class Forked:
    """A zygote's child as the tests use a Popen: pid, poll, wait, communicate, signals, pipes.
    `stdout`/`stderr`: subprocess.PIPE (read as text), DEVNULL, None (this process's own), an open
    file, or for stderr subprocess.STDOUT."""

    def __init__(self, path: str, args: list[str], argv: list[str], env: dict, cwd, stdout=None, stderr=None):
        self.args, self.returncode, self.stdout, self.stderr = args, None, None, None
        self._buffer, self._readers = b"", []
        sent, owned = [os.open(os.devnull, os.O_RDONLY)], []
        owned.append(sent[0])
        for name, stream in (("stdout", stdout), ("stderr", stderr)):
            if stream is subprocess.PIPE:
                read, write = os.pipe()
                setattr(self, name, open(read, errors="backslashreplace"))
                sent.append(write)
                owned.append(write)
            elif stream is subprocess.DEVNULL:
                sent.append(os.open(os.devnull, os.O_WRONLY))
                owned.append(sent[-1])
            elif stream is subprocess.STDOUT:
                sent.append(sent[1])
            else:
                sent.append(len(sent) if stream is None else stream.fileno())
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._socket.connect(path)
            request = {"argv": argv, "env": env, "cwd": str(cwd)}
            socket.send_fds(self._socket, [json.dumps(request).encode()], sent)
        finally:
            for fd in owned:
                os.close(fd)
        self.pid = self._message(None)["pid"]

    def _message(self, timeout: float | None) -> dict | None:
        self._socket.settimeout(timeout)
        while b"\n" not in self._buffer:
            try:
                chunk = self._socket.recv(4096)
            except (TimeoutError, BlockingIOError):
                return None
            if not chunk:
                raise RuntimeError(f"the zygote ended while {self.args} ran")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def poll(self) -> int | None:
        if self.returncode is None:
            message = self._message(0)
            if message is not None:
                self.returncode = message["returncode"]
                self._socket.close()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            message = self._message(timeout)
            if message is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.returncode = message["returncode"]
            self._socket.close()
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str | None, str | None]:
        """Both pipes read whole and the exit awaited, as Popen.communicate; on TimeoutExpired the
        reads go on, and a later call collects them."""
        if not self._readers:
            for pipe in (self.stdout, self.stderr):
                chunks: list[str] = []
                reader = threading.Thread(target=lambda p=pipe, c=chunks: c.append(p.read()) if p else None,
                                          daemon=True)
                reader.start()
                self._readers.append((reader, chunks))
        deadline = None if timeout is None else time.monotonic() + timeout
        for reader, _ in self._readers:
            reader.join(None if deadline is None else max(0, deadline - time.monotonic()))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return tuple("".join(chunks) if pipe else None
                     for pipe, (_, chunks) in zip((self.stdout, self.stderr), self._readers))

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class Zygote:
    """A zygote process of this pytest process's own, started at its first launch (about 5 s of
    CPU, once); it ends within a second of this process (serve)."""

    def __init__(self, env: dict):
        self.env = env
        self._folder = tempfile.mkdtemp(prefix="vitforge-zygote-")
        self.path = os.path.join(self._folder, "socket")
        self._process = subprocess.Popen([sys.executable, __file__, self.path], env=env, stdin=subprocess.DEVNULL)
        while not os.path.exists(self.path):
            if self._process.poll() is not None:
                raise RuntimeError(f"the zygote exited {self._process.returncode} before it listened")
            time.sleep(0.02)

    def launch(self, argv: list[str], env: dict, cwd, stdout=None, stderr=None) -> Forked:
        return Forked(self.path, [sys.executable, "-m", "vitforge", *argv], argv, env, cwd, stdout, stderr)


if __name__ == "__main__":
    _preload()
    run_child(serve(sys.argv[1]))
