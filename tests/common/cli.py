"""The CLI and training launches as a user makes them: real processes, the venv's DeepSpeed op cache.

Each launch is a process of its own, forked from a zygote that has imported torch, DeepSpeed and
timm once (tests/common/zygote.py: 4.5 of a rank's 6 s of CPU before its first step), or a fresh
interpreter where a fork cannot stand in for one (a faketime prefix, a PYTHONPATH of the test's
own, coverage).

EXTENSIONS is the environment every launch adds: the JIT-built DeepSpeed shm op is cached with the
venv (built once, about 30 s, by `make test` before the suite starts), and the venv's ninja comes
first on PATH, as in a SLURM job that activates the venv: ninja 1.11 (Debian) and 1.13 (the venv)
hash .ninja_log differently, and each switch rebuilds the op. TORCHINDUCTOR_COMPILE_THREADS=1:
torch.compile builds its kernels in the process itself, not in a pool of fresh processes that
each import torch (seconds of CPU apiece, on 2 cores, for a tiny model's few kernels). TESTS on
PYTHONPATH lets a test file that is also a worker script (`python tests/integration/test_x.py ...`) import this package.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from vitforge.core import free_port

from .zygote import Zygote, usable

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"

EXTENSIONS = {"TORCH_EXTENSIONS_DIR": str(REPO / ".venv" / "torch_extensions"), "OMP_NUM_THREADS": "1",
              "TORCHINDUCTOR_COMPILE_THREADS": "1",
              "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
              "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))}

# The uninterrupted reference of the exact-resume tests: every run stopped and resumed with these
# settings must end equal to it, losses and weights.
STRAIGHT = ["train.steps=24", "train.log_every=1", "train.checkpoint_every=6", "data.val=null",
            "checkpoint.keep_last=10"]


_zygote: Zygote | None = None


def launch(argv: list[str], env: dict, stdout=subprocess.PIPE, stderr=subprocess.PIPE):
    """`python -m vitforge *argv` in REPO with the whole environment `env`: a fork of this process's
    zygote (tests/common/zygote.py: the imports paid once) where it can be one, else a fresh
    process. Either way a Popen-like process of its own."""
    global _zygote
    if _zygote is None:
        _zygote = Zygote({**os.environ, **EXTENSIONS})
    if usable(env, _zygote.env):
        return _zygote.launch(argv, env, REPO, stdout, stderr)
    return subprocess.Popen([sys.executable, "-m", "vitforge", *argv], cwd=REPO, env=env, text=True,
                            stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr)


def vitforge(*args: str, env: dict | None = None, check: bool = True, timeout: float = 300,
             prefix: list[str] | None = None) -> subprocess.CompletedProcess:
    """Run the real CLI in a process of its own, as a user would, with EXTENSIONS: a command that
    starts a process group (eval, train) would otherwise JIT-build the shm op again in ~/.cache.
    With a `prefix` (faketime, a namespace host) the process is a fresh one, else a launch."""
    env = {**os.environ, **EXTENSIONS, **(env or {})}
    cmd = (prefix or []) + [sys.executable, "-m", "vitforge", *map(str, args)]
    if prefix:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    else:
        process = launch(list(map(str, args)), env)
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise
        result = subprocess.CompletedProcess(cmd, process.returncode, stdout, stderr)
    if check and result.returncode != 0:
        raise AssertionError(f"{cmd} exited {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}")
    return result


def train_args(data, run: str, *overrides: str, store: str | None = None) -> list[str]:
    args = ["tiny_cpu", "--set", f"data.train={data / 'train'}", "--set", f"data.val={data / 'val'}",
            "--set", f"checkpoint.dir={store or data / 'runs'}", "--set", f"checkpoint.run={run}",
            "--set", "data.backend=torch", "--set", "data.workers=0"]
    for item in overrides:
        args += ["--set", item]
    return args


def train(data, run: str, *overrides: str, nproc: int = 2, check: bool = True, store: str | None = None,
          env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """`vitforge train` on `nproc` ranks (gloo on CPU), started as srun starts them (start_ranks).
    A torchrun agent would add a process importing torch to each launch and nothing these tests
    read; torchrun itself is launched where it is what a test is about (kill -9, two nodes, a
    world-size change). As torchrun does, a rank that fails ends the others, after 30 s in which
    they may end on their own. The result holds every rank's output, rank 0's last: its stdout
    ends with the run's summary line."""
    with tempfile.TemporaryDirectory() as folder:
        logs = [(open(f"{folder}/{rank}.out", "w+"), open(f"{folder}/{rank}.err", "w+")) for rank in range(nproc)]
        ranks = start_ranks(data, run, *overrides, nproc=nproc, store=store, env=env, outputs=logs, one_node=True)
        try:
            deadline, failed = time.monotonic() + timeout, None
            while any(rank.poll() is None for rank in ranks):
                now = time.monotonic()
                if failed is None and any(rank.poll() for rank in ranks):
                    failed = now
                if now > deadline:
                    raise AssertionError(f"training {run} did not end in {timeout:.0f} s:\n"
                                         + "".join(_read(err) for _, err in logs)[-4000:])
                if failed is not None and now - failed > 30:
                    break
                time.sleep(0.05)
        finally:
            for rank in ranks:
                if rank.poll() is None:
                    rank.kill()
                rank.wait()
        codes = [rank.returncode for rank in ranks]
        order = [*range(1, nproc), 0]
        result = subprocess.CompletedProcess(ranks[0].args, next((code for code in codes if code), 0),
                                             "".join(_read(logs[r][0]) for r in order),
                                             "".join(_read(logs[r][1]) for r in order))
        for out, err in logs:
            out.close()
            err.close()
    if check and result.returncode != 0:
        raise AssertionError(f"training failed (exit codes {codes}):\n{result.stderr[-4000:]}")
    return result


def _read(file) -> str:
    file.seek(0)
    return file.read()


def start_ranks(data, run: str, *overrides: str, nproc: int = 2, store: str | None = None, env: dict | None = None,
                outputs: list | None = None, one_node: bool = False, only: list[int] | None = None,
                port: int | None = None) -> list:
    """The ranks as srun starts them: one plain process each, RANK/WORLD_SIZE/MASTER_* set, so a
    test can signal one rank and read each rank's own exit code. Without LOCAL_WORLD_SIZE each rank
    counts as a node of its own; `one_node` sets it, as torchrun does, to make them one node.
    `outputs`: (stdout, stderr) files for each rank; pipes without. `only`: start just these ranks
    (the others later, with the same `port`)."""
    port = port or free_port()
    processes = []
    for rank in (range(nproc) if only is None else only):
        rank_env = {**os.environ, **EXTENSIONS, **(env or {}), "RANK": str(rank), "WORLD_SIZE": str(nproc),
                    "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                    **({"LOCAL_WORLD_SIZE": str(nproc)} if one_node else {})}
        processes.append(launch(["train", *train_args(data, run, *overrides, store=store)], rank_env,
                                stdout=outputs[rank][0] if outputs else subprocess.PIPE,
                                stderr=outputs[rank][1] if outputs else subprocess.PIPE))
    return processes
