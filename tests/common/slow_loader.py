"""A loader slowed on purpose, as a slow disk or decoder would be: for tests that need a rank's or
an allocation's steps to take at least a known time on a machine of any speed."""

from __future__ import annotations

import textwrap
from pathlib import Path


def write_slow_loader(folder: Path, when: str, seconds: float) -> None:
    """Write `folder`/sitecustomize.py, which every Python process with `folder` on PYTHONPATH imports
    at start-up: where `when` (a Python expression over `os.environ`) holds in that process, the torch
    loader backend sleeps `seconds` before handing over each batch (inside the loader, so the trainer
    counts it as data wait)."""
    (folder / "sitecustomize.py").write_text(textwrap.dedent(f"""
        import os
        if {when}:
            import time
            from vitforge.pipeline import torch_backend
            batches = torch_backend.TorchBackend.batches

            def slow(self, *args, **kwargs):
                for batch in batches(self, *args, **kwargs):
                    time.sleep({seconds})
                    yield batch

            torch_backend.TorchBackend.batches = slow
    """))
