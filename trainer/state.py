"""A run's resumable state as named parts, each with `state_dict()` / `load_state_dict(state)`.

The Checkpointer is handed the parts (StateParts) and saves and restores them; DeepSpeed saves the
model and optimiser itself, and the step is the checkpoint's own name (step_N, manifest.json).
Adding a part is one entry in the dict that `build.build_trainer` hands over: per-rank parts go to
`rank{r}_state.pt` (one file per rank, part name -> state), shared parts to `shared_state.pt`
(written once, by rank 0).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np
import torch


class Stateful(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@runtime_checkable
class RankBound(Protocol):
    """A per-rank part whose state belongs to its rank alone (random generators): resumed at another
    world size it restarts from a seed instead of taking rank 0's state, as position-like parts do."""

    def restart(self, seed: int) -> None: ...


@dataclass
class StateParts:
    """Per rank: every part below is held on every rank. `per_rank`: each rank saves its own (the
    loader position, a few hundred bytes; the RNG, about 5 KB plus 16 bytes per CUDA device); at
    another world size every rank reads rank 0's (RankBound parts restart instead). `shared`: the
    same on every rank, saved by rank 0 alone (the EMA weights, 4 bytes per parameter); a shared
    part absent from a checkpoint keeps its fresh state (an EMA turned on at a resume)."""

    per_rank: dict[str, Stateful] = field(default_factory=dict)
    shared: dict[str, Stateful] = field(default_factory=dict)


class RandomState:
    """The host's random generators: Python's, NumPy's global, torch's CPU and CUDA ones."""

    def state_dict(self) -> dict:
        return {
            "torch": torch.get_rng_state(),
            "numpy": np.random.get_state(),
            "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        }

    def load_state_dict(self, state: dict) -> None:
        torch.set_rng_state(state["torch"])
        np.random.set_state(state["numpy"])
        random.setstate(state["python"])
        if state["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])

    def restart(self, seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)
