"""DeepSpeed's CPU collectives op (deepspeed_shm_comm), built once and found by every later start.

DeepSpeed JIT-builds it with torch's cpp_extension on a CPU rank's first start (about 35 s of 2
cores) into TORCH_EXTENSIONS_DIR (torch's default: ~/.cache/torch_extensions), and ninja decides
what to rebuild from the log the last build's ninja wrote. Debian's ninja 1.11 and pip's 1.13 (the
venv's) hash that log differently, so a start whose PATH finds the other one rebuilt the op: any
start from a shell where the venv is not activated (`.venv/bin/torchrun -m vitforge train`), after
a build from one where it is. Every train and eval therefore builds with the interpreter's own
ninja (its bin folder first on PATH) and, unless TORCH_EXTENSIONS_DIR is set, into a cache inside
the installation, `{sys.prefix}/torch_extensions`, which `vitforge build-ops` fills once at
install time (`make setup` runs it). A read-only installation keeps torch's default cache.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def use_op_cache(environ=os.environ) -> None:
    """Point this process (and the children it starts) at the installation's ninja and op cache."""
    bin_dir = os.path.dirname(sys.executable)
    if os.path.exists(os.path.join(bin_dir, "ninja")):
        rest = [p for p in environ.get("PATH", "").split(os.pathsep) if p and p != bin_dir]
        environ["PATH"] = os.pathsep.join([bin_dir, *rest])
    cache = os.path.join(sys.prefix, "torch_extensions")
    if not environ.get("TORCH_EXTENSIONS_DIR") and _writable(cache):
        environ["TORCH_EXTENSIONS_DIR"] = cache


def _writable(folder: str) -> bool:
    if os.path.isdir(folder):
        return os.access(folder, os.W_OK)
    return os.access(os.path.dirname(folder), os.W_OK)


def main(argv: list[str]) -> int:
    argparse.ArgumentParser(
        prog="vitforge build-ops",
        description="Build DeepSpeed's CPU collectives op into the installation's cache now, once, so that no "
        "train or eval start pays for it (about 35 s of 2 cores); `make setup` runs it.",
    ).parse_args(argv)
    use_op_cache()
    start = time.monotonic()
    from deepspeed.comm.torch import build_shm_op

    build_shm_op()
    where = os.environ.get("TORCH_EXTENSIONS_DIR") or "torch's default cache (the installation is read-only)"
    print(f"DeepSpeed's shm op is built in {where} ({time.monotonic() - start:.1f} s)")
    return 0
