"""Straggler detection: every `train.straggler_every` steps the ranks compare their step timings,
and rank 0 names each rank slower than the median by more than `train.straggler_threshold`, with
its host and its data wait, and keeps a per-host timing table (timing.md, timing.json) beside
metrics.jsonl.

What is compared. In synchronous data parallelism every rank finishes a step at the same moment:
the fast ranks wait for the slow one inside the step's collectives (the gradient reduction), so
the wall time between finished steps is the job's step time, the same everywhere, and names
nobody. What differs is each rank's own work before it reaches them: its data wait (the train
loader's own counter) and its forward pass (no collective in it up to ZeRO-2; ZeRO-3's parameter
gathers make it partly shared). Their sum, a rank's "own time", is what is compared. The forward is
timed by a pre- and a post-hook on the model (CUDA events on a GPU, read after the step's
agreement has synchronised the stream: no extra synchronisation), training forwards only.

Cost. Per step on every rank: two clock reads (or event records) per micro-batch and a few float
additions; no collective. Every `straggler_every` steps one gather of 5 floats per rank to rank 0.
Per rank: a fixed handful of floats (and 2 CUDA events per micro-batch of a step). Rank 0 also
holds every rank's host name and running totals, world size x (a host name + 8 floats): about
25 KB at 512 ranks, and rewrites two files of one row per host and one per rank at each exchange.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist

log = logging.getLogger("vitforge.train")
TIMING_MD = "timing.md"
TIMING_JSON = "timing.json"
# What each rank sends at an exchange: steps, step seconds (sum, max), data wait and forward seconds (sums).
STEPS, STEP_SUM, STEP_MAX, WAIT_SUM, FORWARD_SUM = range(5)


class ForwardTimer:
    """Seconds this rank spent in training forward passes since the last `take()`."""

    def __init__(self, module: torch.nn.Module, device: torch.device):
        self.module, self.cuda = module, device.type == "cuda"
        self.seconds = 0.0
        self.started = 0.0
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # this step's, reused
        self.used = 0
        module.register_forward_pre_hook(self._before)
        module.register_forward_hook(self._after)

    def _before(self, module, args) -> None:
        if not module.training:
            return
        if not self.cuda:
            self.started = time.perf_counter()
            return
        if self.used == len(self.events):
            self.events.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
        self.events[self.used][0].record()

    def _after(self, module, args, output) -> None:
        if not module.training:
            return
        if not self.cuda:
            self.seconds += time.perf_counter() - self.started
            return
        self.events[self.used][1].record()
        self.used += 1

    def take(self) -> float:
        """Call after the step's stream has been synchronised (its events are then complete)."""
        seconds = self.seconds + sum(start.elapsed_time(end) for start, end in self.events[: self.used]) / 1000
        self.seconds, self.used = 0.0, 0
        return seconds


class StragglerWatch:
    def __init__(
        self,
        every: int,
        threshold: float,
        rank: int,
        world_size: int,
        device: torch.device,
        module: torch.nn.Module,
        loader,
        folder: str,
    ):
        """Collective (gathers the host names to rank 0). `loader`: the train loader, whose
        `wait_seconds` counts this rank's data wait; `folder`: where rank 0 writes the table."""
        self.every, self.threshold = every, threshold
        self.rank, self.world_size, self.device = rank, world_size, device
        self.loader, self.folder = loader, folder
        self.forward = ForwardTimer(module, device)
        self.hosts = [None] * world_size if rank == 0 else None
        dist.gather_object(socket.gethostname(), self.hosts, dst=0)
        self.window = [0.0] * 5  # plain floats: a step's bookkeeping is a few additions
        self.last: float | None = None  # when the previous step finished
        self.last_wait = 0.0
        self.first_step: int | None = None
        self.exchanges = 0
        # Rank 0: running totals per rank over this invocation's exchanges.
        self.totals = torch.zeros(world_size, 5, dtype=torch.float64) if rank == 0 else None
        self.flagged = [0] * world_size if rank == 0 else None

    def step_done(self, step: int) -> None:
        """After each optimizer step's agreement (every rank); exchanges every `every` steps. The
        first step of an invocation only starts the clock: it holds the start-up's stalls."""
        now = time.perf_counter()
        forward = self.forward.take()
        wait = self.loader.wait_seconds
        if self.last is not None:
            seconds = now - self.last
            window = self.window
            window[STEPS] += 1
            window[STEP_SUM] += seconds
            window[STEP_MAX] = max(window[STEP_MAX], seconds)
            window[WAIT_SUM] += wait - self.last_wait
            window[FORWARD_SUM] += forward
            if self.first_step is None:
                self.first_step = step
        self.last, self.last_wait = now, wait
        if step % self.every == 0 and self.window[STEPS] > 0:
            self.exchange(step)

    def exchange(self, step: int) -> None:
        """Collective: every rank's window to rank 0, which names the stragglers and rewrites the table."""
        # On the collective's device: NCCL has no CPU tensors.
        mine = torch.tensor(self.window, dtype=torch.float64, device=self.device)
        gathered = [torch.zeros_like(mine) for _ in range(self.world_size)] if self.rank == 0 else None
        dist.gather(mine, gathered, dst=0)
        self.window = [0.0] * 5
        if self.rank != 0:
            return
        windows = torch.stack(gathered).cpu()
        self.exchanges += 1
        steps = windows[:, STEPS].clamp(min=1)
        own = ((windows[:, WAIT_SUM] + windows[:, FORWARD_SUM]) / steps).tolist()
        median = statistics.median(own)
        for r, seconds in enumerate(own):
            if seconds > median * (1 + self.threshold):
                self.flagged[r] += 1
                wait = windows[r, WAIT_SUM].item() / steps[r].item()
                log.warning(
                    "step %d: rank %d on %s is a straggler: %.3f s of its own per step, median %.3f s "
                    "(+%.0f%%): data wait %.3f s%s, forward %.3f s; the job's step time %.3f s",
                    step,
                    r,
                    self.hosts[r],
                    seconds,
                    median,
                    100 * (seconds / median - 1) if median else 0.0,
                    wait,
                    " (input-bound)" if wait > seconds / 2 else "",
                    windows[r, FORWARD_SUM].item() / steps[r].item(),
                    windows[r, STEP_SUM].item() / steps[r].item(),
                )
        totals = self.totals
        totals[:, [STEPS, STEP_SUM, WAIT_SUM, FORWARD_SUM]] += windows[:, [STEPS, STEP_SUM, WAIT_SUM, FORWARD_SUM]]
        totals[:, STEP_MAX] = torch.maximum(totals[:, STEP_MAX], windows[:, STEP_MAX])
        self.write(step)

    def report(self, step: int) -> dict:
        """Rank 0: the running totals by rank and by host."""
        totals, steps = self.totals, self.totals[:, STEPS].clamp(min=1)
        ranks = [
            {
                "rank": r,
                "host": self.hosts[r],
                "steps": int(totals[r, STEPS]),
                "mean_step_s": totals[r, STEP_SUM].item() / steps[r].item(),
                "max_step_s": totals[r, STEP_MAX].item(),
                "mean_own_s": (totals[r, WAIT_SUM] + totals[r, FORWARD_SUM]).item() / steps[r].item(),
                "mean_data_wait_s": totals[r, WAIT_SUM].item() / steps[r].item(),
                "flagged": self.flagged[r],
            }
            for r in range(self.world_size)
        ]
        by_host: dict[str, list[dict]] = {}
        for row in ranks:
            by_host.setdefault(row["host"], []).append(row)
        hosts = [
            {
                "host": host,
                "ranks": _ranges([row["rank"] for row in rows]),
                "mean_step_s": statistics.fmean(row["mean_step_s"] for row in rows),
                "max_step_s": max(row["max_step_s"] for row in rows),
                "mean_own_s": statistics.fmean(row["mean_own_s"] for row in rows),
                "mean_data_wait_s": statistics.fmean(row["mean_data_wait_s"] for row in rows),
                "flagged": sum(row["flagged"] for row in rows),
            }
            for host, rows in by_host.items()
        ]
        return {
            "steps": [self.first_step, step],
            "every": self.every,
            "threshold": self.threshold,
            "exchanges": self.exchanges,
            "hosts": hosts,
            "ranks": ranks,
        }

    def write(self, step: int) -> None:
        report = self.report(step)
        lines = [
            f"# Step timing by host, steps {report['steps'][0]}-{step}",
            "",
            f"{self.exchanges} exchanges, every {self.every} steps. Own time: a rank's data wait plus its "
            "forward pass per step, the work it does before the step's collectives; flagged: a rank's own "
            f"time over the median's by more than {self.threshold:.0%} at an exchange. The step time is the "
            "job's (every rank waits for the slowest); its max includes evaluations and checkpoints.",
            "",
            "| host | ranks | mean step s | max step s | mean own s | mean data wait s | times flagged |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        lines += [
            f"| {h['host']} | {h['ranks']} | {h['mean_step_s']:.4f} | {h['max_step_s']:.4f} | "
            f"{h['mean_own_s']:.4f} | {h['mean_data_wait_s']:.4f} | {h['flagged']} |"
            for h in report["hosts"]
        ]
        os.makedirs(self.folder, exist_ok=True)
        for name, text in ((TIMING_MD, "\n".join(lines) + "\n"), (TIMING_JSON, json.dumps(report, indent=1))):
            path = os.path.join(self.folder, name)
            with open(path + ".tmp", "w") as f:
                f.write(text)
            os.replace(path + ".tmp", path)  # a reader never sees half a table


def _ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    spans: list[list[int]] = []
    for r in sorted(ranks):
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
