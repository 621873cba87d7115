"""Profiler windows: `train.profile_steps=[first, last]` records torch.profiler traces of those
optimizer steps on every rank, and on a GPU a CUDA memory snapshot, into RUN/profile/.

Layout: RUN/profile/steps_FIRST-LAST/
    rankR.<ns>.pt.trace.json          Chrome / Perfetto trace JSON (ui.perfetto.dev, chrome://tracing), in
                                      torch.profiler.tensorboard_trace_handler's layout: TensorBoard's
                                      profiler plugin reads it (--logdir on a local copy of RUN/profile)
    rankR.memory_snapshot.pickle      GPU only: the allocator's history over the window, for
                                      pytorch.org/memory_viz

Each step of the window is a ProfilerStep#N range (N: the optimizer step). The files are written
locally, then put into the run's store (a local folder or object storage) by each rank at the end
of the window, while its peers wait in the next collective: a diagnostic window costs its steps.
The window ends at the invocation's last step at the latest (train.stop_at); one cut short by a
stop signal writes nothing; one that starts inside a resumed run records its remaining steps.

Off (null), nothing is built: the trainer compares the step with NEVER once per step.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile

import torch

log = logging.getLogger("vitforge.train")
NEVER = sys.maxsize  # the step at which a run with no window calls `after`
SNAPSHOT_ENTRIES = 100_000  # allocator events kept for the memory snapshot (the newest ones)


class ProfileWindow:
    def __init__(self, first: int, last: int, rank: int, device: torch.device, store):
        """`store`: the run's store (a vitforge.core store at DIR/RUN). Per rank while recording:
        the profiler's event buffers (they grow with the window's steps and kernels), on a GPU
        SNAPSHOT_ENTRIES allocator events; nothing outside the window."""
        self.first, self.last, self.rank, self.device, self.store = first, last, rank, device, store
        self.profiler: torch.profiler.profile | None = None
        self.scratch: tempfile.TemporaryDirectory | None = None

    @property
    def next_at(self) -> int:
        """The finished step after which the trainer calls `after` next."""
        return self.first - 1

    def after(self, step: int) -> int:
        """Step `step` has finished (or this invocation starts after it): open the window before
        its first step, mark each step in it, close and write it after its last. Returns the step
        after which to be called next (NEVER once done)."""
        if self.profiler is None:
            if step >= self.last:  # the window is behind this run
                return NEVER
            self.start(step + 1)
            return step + 1
        if step < self.last:
            self.profiler.step()  # ProfilerStep#step ends, #step+1 begins
            return step + 1
        self.finish()
        return NEVER

    def start(self, first: int) -> None:
        self.first = first
        cuda = self.device.type == "cuda"
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        self.scratch = tempfile.TemporaryDirectory(prefix="vitforge-profile-")
        handler = torch.profiler.tensorboard_trace_handler(self.scratch.name, worker_name=f"rank{self.rank}")
        # A schedule of RECORD only: step() marks steps without exporting; stop() exports once.
        self.profiler = torch.profiler.profile(
            activities=activities, on_trace_ready=handler, schedule=lambda _: torch.profiler.ProfilerAction.RECORD
        )
        self.profiler.step_num = first  # the first range is ProfilerStep#first
        if cuda:
            torch.cuda.memory._record_memory_history(max_entries=SNAPSHOT_ENTRIES)
        self.profiler.start()
        if self.rank == 0:
            log.info("profiling steps %d-%d into %s", first, self.last, self.store.url(self.folder))

    @property
    def folder(self) -> str:
        return f"profile/steps_{self.first}-{self.last}"

    def finish(self) -> None:
        self.profiler.stop()  # exports the trace through the handler
        self.profiler = None
        if self.device.type == "cuda":
            torch.cuda.memory._dump_snapshot(os.path.join(self.scratch.name, f"rank{self.rank}.memory_snapshot.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
        with self.scratch:
            for name in sorted(os.listdir(self.scratch.name)):
                self.store.put_file(os.path.join(self.scratch.name, name), f"{self.folder}/{name}")
        if self.rank == 0:
            log.info("profile of steps %d-%d written to %s", self.first, self.last, self.store.url(self.folder))


def profile_window(
    steps: tuple[int, int] | None, end: int, rank: int, device: torch.device, store
) -> ProfileWindow | None:
    """The window of `train.profile_steps`, its last step capped at this invocation's `end`; None when off."""
    if steps is None:
        return None
    first, last = steps
    if first > end:
        if rank == 0:
            log.warning(
                "train.profile_steps %s starts after this invocation's last step %d: nothing is profiled",
                list(steps),
                end,
            )
        return None
    return ProfileWindow(first, min(last, end), rank, device, store)
