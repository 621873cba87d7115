"""The training loop: a Trainer composed of components, the step readable in one screen.

Step-based: one step is one optimizer update (micro-batch x accumulation x world size images);
epochs come from the loader, whose position is checkpointed with the model, so a resumed run
continues the same sample stream. The components (engine, loaders, objective, checkpointer,
metrics, EMA) are built by small functions (build.py) and handed to the Trainer; the stateful parts
(loader position, RNG, EMA: state.StateParts) are handed to the checkpointer, which saves and
restores them. entry.py runs it on each rank of a job; evaluate() is the loop's evaluation, which
`vitforge eval` (entry.run_eval) shares.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist

from vitforge.core import DivergedError, VitforgeError
from vitforge.core import errors as exit_codes

from .checkpoint import Checkpointer
from .config import Config
from .distributed import together
from .ema import EMA, like_parameters
from .engine import learning_rate
from .metrics import MetricsLog
from .mixing import Mixing, mix_batch
from .model import PEAK_FLOPS, forward_flops
from .objective import Objective
from .preemption import StopRequest
from .probe_eval import ProbeSet, run_probes
from .profiling import NEVER, profile_window
from .run_store import tag_for
from .stragglers import StragglerWatch
from .watchdog import Watchdog

log = logging.getLogger("vitforge.train")
SHOTS = "probe_shots.json"


class Requeue(VitforgeError):
    """Stopped early on a signal or time limit with a complete checkpoint: run again to resume."""

    exit_code = exit_codes.REQUEUE
    kind = "stopped for requeue"


class PeerLost(Requeue):
    """A collective failed because a node stopped answering (killed, cut off): nothing was saved
    after the newest complete checkpoint; run again (a SLURM job requeues) on healthy nodes."""

    kind = "lost a peer node"


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)


@dataclass
class TrainState:
    step: int = 0
    micro: int = 0  # micro-batches of the step under way so far (gradient accumulation), 0 between steps
    nonfinite_streak: int = 0
    last_checkpoint: float = field(default_factory=time.monotonic)


class StepAgreement(NamedTuple):
    """What every rank agrees on after a step (one all-reduce)."""

    stop_reason: str | None  # why the run stops now (a signal, the time budget), or None
    nonfinite: bool  # the loss or gradient norm is not finite on some rank
    timed_checkpoint: bool  # train.checkpoint_every_minutes has passed on rank 0's clock


@dataclass
class Window:
    """What the log line reports: sums since the last log step."""

    loss: torch.Tensor
    micro: int = 0
    steps: int = 0
    start: float = field(default_factory=time.perf_counter)


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    loader,
    objective: Objective,
    device: torch.device,
    params: dict | None = None,
    seed: int = 0,
) -> dict:
    """The objective's metrics over the whole eval set, summed across ranks; padding is ignored."""
    was_training = model.training
    model.eval()
    totals = torch.zeros(4, dtype=torch.float64)  # on the host, where eval_counts returns its counts
    for batch in loader:
        inputs, targets = objective.inputs(batch, model, 0, seed)
        logits = torch.func.functional_call(model, params, inputs) if params else model(*inputs)
        totals += objective.eval_counts(logits, targets)
    totals = totals.to(device)  # the collective's device: NCCL has no CPU tensors
    dist.all_reduce(totals)
    model.train(was_training)
    return objective.eval_metrics(totals)


def _straggler_watch(cfg: Config, env, device, engine, train_loader, metrics: MetricsLog) -> StragglerWatch | None:
    """The exchange of step and data-wait times every train.straggler_every steps; None when off."""
    every = cfg.train.straggler_every
    if not every:
        return None
    return StragglerWatch(
        every,
        cfg.train.straggler_threshold,
        env.rank,
        env.world_size,
        device,
        engine.module,
        train_loader,
        metrics.folder,
    )


class Trainer:
    def __init__(
        self,
        cfg: Config,
        env,
        device,
        engine,
        train_loader,
        val_loader,
        objective: Objective,
        checkpointer: Checkpointer,
        metrics: MetricsLog,
        ema: EMA | None,
        manifest_extra: dict,
        stop: StopRequest,
        probes: Sequence[ProbeSet] = (),
    ):
        self.cfg, self.env, self.device = cfg, env, device
        self.engine, self.train_loader, self.val_loader = engine, train_loader, val_loader
        self.objective, self.checkpointer, self.metrics, self.ema = objective, checkpointer, metrics, ema
        self.manifest_extra = manifest_extra
        self.probes = list(probes)
        self.shots_recorded = False  # the probes' shots go to SHOTS at this invocation's first evaluation
        self.state = TrainState()
        self.accumulation = cfg.accumulation(env.world_size)
        self.end = min(cfg.train.steps, cfg.train.stop_at or cfg.train.steps)
        self.flops_per_image = 3 * forward_flops(
            cfg.model.name,
            cfg.model.image_size,  # forward + backward
            getattr(engine.module, "num_classes", 1),
            cfg.train.objective,
        )
        aug = cfg.augment
        self.mixing = Mixing(
            getattr(engine.module, "num_classes", 0),
            cfg.data.seed,
            aug.mixup,
            aug.cutmix,
            aug.mix_prob,
            aug.switch_prob,
            aug.label_smoothing,
        )
        self.peak = peak_flops(device)
        self.stop = stop
        self.window = Window(torch.zeros((), device=device))
        self.step_loss = torch.zeros((), device=device)  # summed over the step's micro-batches
        self.flags = torch.zeros(3, device=device)  # what ranks agree on after each step
        self.last: dict = {}
        self.run_start = (time.perf_counter(), 0)
        # Progress marks for this rank's hang watchdog (run() starts it): a save may wait for two uploads.
        self.watchdog = Watchdog(
            cfg.train.hang_timeout_s,
            cfg.train.hang_floor_s,
            cfg.train.collective_timeout_s,
            {"checkpoint save": 2 * 60 * cfg.checkpoint.upload_timeout_minutes},
        )
        self.stragglers = _straggler_watch(cfg, env, device, engine, train_loader, metrics)
        self.profiler = profile_window(cfg.train.profile_steps, self.end, env.rank, device, checkpointer.run.store)
        self.profile_at = self.profiler.next_at if self.profiler else NEVER  # the step after which it acts next

    # -- the loop ----------------------------------------------------------------------------
    def train(self) -> dict:
        self.run_start = (time.perf_counter(), self.state.step)  # for the running images/s
        self.window = Window(torch.zeros((), device=self.device))
        if self.state.step >= self.end:
            log.info(
                "nothing to train: the run is already at step %d of %d (raise train.steps to go on, or "
                "use a new checkpoint.run)",
                self.state.step,
                self.end,
            )
            return {"step": self.state.step, "complete": True}
        if self.state.step >= self.profile_at:  # a window that opens at this invocation's first step
            self.profile_at = self.profiler.after(self.state.step)
        while self.state.step < self.end:
            for batch in self.train_loader:
                if self.train_step(batch) and self.after_step():
                    return self.last
        return self.last

    def train_step(self, batch) -> bool:
        """One micro-batch; True when it completed an optimizer step."""
        lr = learning_rate(self.cfg, self.state.step)
        for group in self.engine.optimizer.param_groups:
            group["lr"] = lr
        inputs, targets = self.objective.inputs(batch, self.engine.module, self.train_loader.epoch, self.cfg.data.seed)
        if self.mixing.soft:
            images, targets = mix_batch(
                inputs[0], targets, self.mixing, self.state.step, self.state.micro, self.env.rank
            )
            inputs = (images, *inputs[1:])
        loss = self.objective.loss(self.engine(*inputs), targets)
        self.engine.backward(loss)
        self.engine.step()
        self.window.loss += loss.detach().float()  # summed on the device: no sync per micro-step
        self.step_loss += loss.detach().float()
        self.window.micro += 1
        self.state.micro += 1
        if self.state.micro < self.accumulation:  # gradients accumulate: the step needs more micro-batches
            return False
        self.state.micro = 0
        self.state.step += 1
        self.window.steps += 1
        self.lr = lr
        return True

    def after_step(self) -> bool:
        """Agree, check, average, log and evaluate, checkpoint or stop, profile; True when this
        invocation should end."""
        step = self.state.step
        self.watchdog.beat(step)
        agreed = self.agree_on_step()
        if self.stragglers is not None:  # timed here, after the step's last collective; exchanged every N steps
            self.stragglers.step_done(step)
        self.check_finite(agreed.nonfinite)
        if self.ema is not None:
            self.ema.update(self.engine.module)
        self.log_and_evaluate(step)
        self.checkpoint_or_stop(step, agreed)
        if step >= self.profile_at:  # an int comparison per step outside a profiler window
            with self.watchdog.phase("profile"):  # a window's end exports and uploads every rank's trace
                self.profile_at = self.profiler.after(step)
        return step >= self.end

    def check_finite(self, nonfinite: bool) -> None:
        """train.max_nonfinite steps in a row with a non-finite loss or gradient norm end the run."""
        if not nonfinite:
            self.state.nonfinite_streak = 0
            return
        self.state.nonfinite_streak += 1
        limit = self.cfg.train.max_nonfinite
        if self.state.nonfinite_streak >= limit:
            raise together(
                DivergedError(
                    f"step {self.state.step}: the loss or gradient norm is not finite "
                    f"({self.state.nonfinite_streak} consecutive step(s), "
                    f"train.max_nonfinite {limit}); stopped before it reached a checkpoint"
                )
            )

    def log_and_evaluate(self, step: int) -> None:
        cfg = self.cfg
        if step % cfg.train.log_every == 0 or step == self.end:
            self.last = self.log_step()
        val = self.val_loader is not None and (step % cfg.train.eval_every == 0 or step == self.end)
        probes = bool(self.probes) and (step % (cfg.eval.every or cfg.train.eval_every) == 0 or step == self.end)
        if val or probes:
            with self.watchdog.phase("evaluation"):
                results = self.evaluate(val, probes)
            self.last.update(results)
            self.metrics.write(step, results)

    def checkpoint_or_stop(self, step: int, agreed: StepAgreement) -> None:
        """A checkpoint when one is due; on a stop, a complete one and then Requeue."""
        cfg = self.cfg
        if agreed.stop_reason:
            self.save(wait=True)
            saved = (
                self.checkpointer.run.object_url(tag_for(step))
                if cfg.checkpoint.save
                else "(none: checkpoint.save is false)"
            )
            raise Requeue(
                f"stopped at step {step} ({agreed.stop_reason}); checkpoint {saved} is complete: "
                "run the same command again to resume"
            )
        if (
            (cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0)
            or agreed.timed_checkpoint
            or step == self.end
        ):
            self.save(wait=step == self.end)

    def evaluate(self, val: bool = True, probes: bool = True) -> dict:
        """data.val's metrics and the probes' (those asked for), with the EMA weights when there are some."""
        weights = like_parameters(self.ema.weights, self.engine.module) if self.ema else None
        out = {}
        if val and self.val_loader is not None:
            out.update(
                evaluate(self.engine.module, self.val_loader, self.objective, self.device, weights, self.cfg.data.seed)
            )
        if probes and self.probes:
            started = time.perf_counter()
            out.update(
                run_probes(
                    self.engine.module,
                    self.probes,
                    self.objective,
                    self.cfg.eval,
                    self.device,
                    weights,
                    None if self.shots_recorded else self.record_shots,
                )
            )
            self.shots_recorded = True
            out["eval_probe_seconds"] = time.perf_counter() - started
        return out

    def record_shots(self, shots: dict) -> None:
        """Which images the few-shot probes fit on, by sample key (rank 0), beside metrics.jsonl."""
        with open(os.path.join(self.metrics.folder, SHOTS), "w") as f:
            json.dump(shots, f, indent=1)

    def agree_on_step(self) -> StepAgreement:
        """One small all-reduce per step: does any rank want to stop (signal, time budget), is the
        loss or gradient norm non-finite anywhere, is a timed checkpoint due (rank 0's clock)."""
        reason = self.stop.reason()
        minutes = self.cfg.train.checkpoint_every_minutes
        timed = bool(minutes) and self.env.rank == 0 and time.monotonic() - self.state.last_checkpoint >= minutes * 60
        flags = self.flags
        flags[0], flags[2] = float(reason is not None), float(timed)
        # Non-finite shows in the sum: the loss, plus the gradient norm where DeepSpeed computes it.
        check = self.step_loss
        grad_norm = self.engine.get_global_grad_norm()
        if grad_norm is not None:
            check = check + torch.as_tensor(grad_norm, dtype=torch.float32, device=self.device)
        flags[1] = (~torch.isfinite(check)).float()
        self.step_loss = torch.zeros((), device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        stop, nonfinite, timed = (bool(v) for v in flags.tolist())
        if stop and reason is None:
            reason = "another rank was signalled"
        return StepAgreement(reason if stop else None, nonfinite, timed)

    def save(self, wait: bool) -> None:
        if not self.cfg.checkpoint.save:
            return
        if self.state.nonfinite_streak:
            log.warning("step %d: not saving a checkpoint of a model with non-finite values", self.state.step)
            return
        with self.watchdog.phase("checkpoint save"):
            self.checkpointer.save(
                self.engine,
                self.state.step,
                {**self.manifest_extra, "zero_stage": self.engine.zero_optimization_stage()},
            )
            self.state.last_checkpoint = time.monotonic()
            stall = self.checkpointer.last_stall
            log.info(
                "step %d: checkpoint written locally in %.2f s (waited %.2f s for the previous upload)%s",
                self.state.step,
                stall["write_s"],
                stall["wait_s"],
                "; uploading" if not wait else "",
            )
            if wait:
                self.checkpointer.wait()
                dist.barrier()

    def log_step(self) -> dict:
        window, step = self.window, self.state.step
        loss = torch.tensor([window.loss.item(), window.micro], dtype=torch.float64, device=self.device)
        dist.all_reduce(loss)
        now = time.perf_counter()
        images_per_s = window.steps * self.cfg.train.global_batch / (now - window.start)
        running = self.state.step - self.run_start[1]
        images_per_s_running = running * self.cfg.train.global_batch / (now - self.run_start[0])
        world = self.env.world_size
        stats = self.train_loader.stats()
        loader_window = self.train_loader.window()
        sources = loader_window.get("sources", [])  # a mixture's, each source's own wait
        # The slowest rank's wait is the job's: the others wait for it in the next collective.
        wait = torch.tensor(
            [
                loader_window["data_wait_fraction"],
                stats["data_wait_fraction"],
                *[source["data_wait_fraction"] for source in sources],
            ],
            dtype=torch.float64,
            device=self.device,
        )
        dist.all_reduce(wait, op=dist.ReduceOp.MAX)
        grad_norm = self.engine.get_global_grad_norm()
        values = {
            "loss": loss[0].item() / loss[1].item(),
            "lr": self.lr,
            "grad_norm": float(grad_norm) if grad_norm is not None else None,
            "images_per_s": images_per_s,
            "images_per_s_per_gpu": images_per_s / world,
            "images_per_s_running": images_per_s_running,
            "data_wait_fraction": wait[0].item(),
            "data_wait_fraction_running": wait[1].item(),
            "bad_samples": stats["bad_samples"],
            "mfu": self.flops_per_image * images_per_s / (world * self.peak) if self.peak else None,
            "memory_gb": (
                torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else _max_rss_bytes()
            )
            / 2**30,
        }
        for i, source in enumerate(stats.get("sources", [])):  # samples all ranks took from it since the run began
            values[f"source_{i}_samples_seen"] = source["samples_taken"]
            values[f"source_{i}_data_wait_fraction"] = wait[2 + i].item()
        self.metrics.write(step, values)
        if self.env.rank == 0:
            mfu = f" mfu {values['mfu']:.1%}" if values["mfu"] is not None else ""
            log.info(
                "step %d loss %.4f lr %.2e %.0f img/s (%.0f per rank) data wait %.0f%% (running %.0f%%)%s",
                step,
                values["loss"],
                self.lr,
                images_per_s,
                images_per_s / world,
                100 * values["data_wait_fraction"],
                100 * values["data_wait_fraction_running"],
                mfu,
            )
        self.window = Window(torch.zeros((), device=self.device))
        return values


def _max_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
