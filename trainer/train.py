"""`vitforge train` / `vitforge eval`: a Trainer composed of components, the step readable in one screen.

Step-based: one step is one optimizer update (micro-batch x accumulation x world size images);
epochs come from the loader, whose position is checkpointed with the model, so a resumed run
continues the same sample stream. The components (engine, loaders, objective, checkpointer,
metrics, EMA) are built by small functions and handed to the Trainer; the stateful parts (loader
position, RNG, EMA: state.StateParts) are handed to the checkpointer, which saves and restores them.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from vitforge.core import DivergedError, VitforgeError, die_with_parent, is_remote
from vitforge.core import errors as exit_codes
from vitforge.pipeline import LoaderSpec, build_loader

from .checkpoint import Checkpointer
from .config import Config, ConfigError
from .distributed import PeerWatch, agree_keeping, all_ok, broadcast_state, detect_env, init_distributed, shutdown
from .engine import build_engine, learning_rate, set_tf32
from .export import check_fits, consolidate, consolidate_on_rank0, load_broadcast
from .metrics import MetricsLog
from .model import PEAK_FLOPS, adapt_state_dict, build_model, check_model_config, forward_flops
from .mixing import Mixing, mix_batch
from .objective import OBJECTIVES, Objective, get_objective
from .objectives import saved_objective
from .preemption import StopRequest
from .probe_eval import ProbeSet, build_probes, run_probes
from .profiling import NEVER, profile_window
from .run_store import METRICS, tag_for
from .state import RandomState, StateParts
from .stragglers import StragglerWatch
from .tracking import TrackingFeed, check_trackers, start_tracking
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
    micro: int = 0  # micro-batches since the last optimizer step
    nonfinite_streak: int = 0
    last_checkpoint: float = field(default_factory=time.monotonic)


@dataclass
class Window:
    """What the log line reports: sums since the last log step."""
    loss: torch.Tensor
    micro: int = 0
    steps: int = 0
    start: float = field(default_factory=time.perf_counter)


class EMA:
    """Polyak averaging of the weights (ZeRO <= 2: the weights must be whole on every rank). A
    shared state part: restored from a checkpoint, or started from the weights training starts from."""

    def __init__(self, decay: float):
        self.decay = decay
        self.weights: dict | None = None

    def start(self, model: torch.nn.Module) -> None:
        if self.weights is None:
            self.weights = {k: v.detach().float().clone() for k, v in model.named_parameters()}

    def state_dict(self) -> dict:
        return self.weights

    def load_state_dict(self, state: dict) -> None:
        self.weights = state

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        for name, param in model.named_parameters():
            self.weights[name].mul_(self.decay).add_(param.detach().float(), alpha=1 - self.decay)


def build_data_loader(cfg: Config, source: str, train: bool, env, device):
    aug = cfg.augment
    crops = ({"scale": aug.crop_scale, "ratio": aug.crop_ratio, "flip": aug.flip, "randaugment": aug.randaugment}
             if train else {})
    spec = LoaderSpec.of(cfg.data, source, batch_size=cfg.train.micro_batch, image_size=cfg.model.image_size,
                         train=train, backend="synthetic" if source == "synthetic" else cfg.data.backend,
                         subset=cfg.data.subset if train else None,
                         dtype="bfloat16" if cfg.train.precision == "bf16" else "float32", **crops)
    return build_loader(spec, env.rank, env.world_size, device, synthetic_classes=cfg.model.num_classes or 1000,
                        accumulation=cfg.accumulation(env.world_size) if train else 1,
                        ranks_per_node=env.local_world_size)


def metrics_folder(cfg: Config) -> str:
    """Where metrics.jsonl and TensorBoard go: the run folder when it is local, else ./logs/RUN."""
    if cfg.checkpoint.log_dir:
        return cfg.checkpoint.log_dir
    if is_remote(cfg.checkpoint.dir):
        return os.path.join("logs", cfg.checkpoint.run)
    return cfg.checkpoint.run_url.removeprefix("file://")


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader, objective: Objective, device: torch.device, params: dict | None = None,
             seed: int = 0) -> dict:
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


class Trainer:
    def __init__(self, cfg: Config, env, device, engine, train_loader, val_loader, objective: Objective,
                 checkpointer: Checkpointer, metrics: MetricsLog, ema: EMA | None, manifest_extra: dict,
                 stop: StopRequest, probes: list[ProbeSet] = ()):
        self.cfg, self.env, self.device = cfg, env, device
        self.engine, self.train_loader, self.val_loader = engine, train_loader, val_loader
        self.objective, self.checkpointer, self.metrics, self.ema = objective, checkpointer, metrics, ema
        self.manifest_extra = manifest_extra
        self.probes = list(probes)
        self.shots_recorded = False  # the probes' shots go to SHOTS at this invocation's first evaluation
        self.state = TrainState()
        self.accumulation = cfg.accumulation(env.world_size)
        self.end = min(cfg.train.steps, cfg.train.stop_at or cfg.train.steps)
        self.flops_per_image = 3 * forward_flops(cfg.model.name, cfg.model.image_size,  # forward + backward
                                                 getattr(engine.module, "num_classes", 1), cfg.train.objective)
        aug = cfg.augment
        self.mixing = Mixing(getattr(engine.module, "num_classes", 0), cfg.data.seed, aug.mixup, aug.cutmix,
                             aug.mix_prob, aug.switch_prob, aug.label_smoothing)
        self.peak = peak_flops(device)
        self.stop = stop
        self.window = Window(torch.zeros((), device=device))
        self.step_loss = torch.zeros((), device=device)  # summed over the step's micro-batches
        self.flags = torch.zeros(3, device=device)  # what ranks agree on after each step
        self.last: dict = {}
        self.run_start = (time.perf_counter(), 0)
        # Progress marks for this rank's hang watchdog (run() starts it): a save may wait for two uploads.
        self.watchdog = Watchdog(cfg.train.hang_timeout_s, cfg.train.hang_floor_s, cfg.train.collective_timeout_s,
                                 {"checkpoint save": 2 * 60 * cfg.checkpoint.upload_timeout_minutes})
        every = cfg.train.straggler_every
        self.stragglers = StragglerWatch(every, cfg.train.straggler_threshold, env.rank, env.world_size, device,
                                         engine.module, train_loader, metrics.folder) if every else None
        self.profiler = profile_window(cfg.train.profile_steps, self.end, env.rank, device, checkpointer.run.store)
        self.profile_at = self.profiler.next_at if self.profiler else NEVER  # the step after which it acts next

    # -- the loop ----------------------------------------------------------------------------
    def train(self) -> dict:
        self.run_start = (time.perf_counter(), self.state.step)  # for the running images/s
        self.window = Window(torch.zeros((), device=self.device))
        if self.state.step >= self.end:
            log.info("nothing to train: the run is already at step %d of %d (raise train.steps to go on, or "
                     "use a new checkpoint.run)", self.state.step, self.end)
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
        inputs, targets = self.objective.inputs(batch, self.engine.module, self.train_loader.epoch,
                                                self.cfg.data.seed)
        if self.mixing.soft:
            images, targets = mix_batch(inputs[0], targets, self.mixing, self.state.step,
                                        self.state.micro % self.accumulation, self.env.rank)
            inputs = (images, *inputs[1:])
        loss = self.objective.loss(self.engine(*inputs), targets)
        self.engine.backward(loss)
        self.engine.step()
        self.window.loss += loss.detach().float()  # summed on the device: no sync per micro-step
        self.step_loss += loss.detach().float()
        self.window.micro += 1
        self.state.micro += 1
        if self.state.micro % self.accumulation:
            return False
        self.state.step += 1
        self.window.steps += 1
        self.lr = lr
        return True

    def after_step(self) -> bool:
        """Log, evaluate, check, checkpoint, stop; True when this invocation should end."""
        step, cfg = self.state.step, self.cfg
        self.watchdog.beat(step)
        stop_reason, nonfinite, timed = self.agree_on_step()
        if self.stragglers is not None:  # timed here, after the step's last collective; exchanged every N steps
            self.stragglers.step_done(step)
        if nonfinite:
            self.state.nonfinite_streak += 1
            if self.state.nonfinite_streak >= cfg.train.max_nonfinite:
                raise DivergedError(f"step {step}: the loss or gradient norm is not finite "
                                    f"({self.state.nonfinite_streak} consecutive step(s), train.max_nonfinite "
                                    f"{cfg.train.max_nonfinite}); stopped before it reached a checkpoint")
        else:
            self.state.nonfinite_streak = 0
        if self.ema is not None:
            self.ema.update(self.engine.module)
        if step % cfg.train.log_every == 0 or step == self.end:
            self.last = self.log_step()
        val = self.val_loader is not None and (step % cfg.train.eval_every == 0 or step == self.end)
        probes = bool(self.probes) and (step % (cfg.eval.every or cfg.train.eval_every) == 0 or step == self.end)
        if val or probes:
            with self.watchdog.phase("evaluation"):
                results = self.evaluate(val, probes)
            self.last.update(results)
            self.metrics.write(step, results)
        due = (cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0) or timed or step == self.end
        if stop_reason:
            self.save(wait=True)
            saved = self.checkpointer.run.object_url(tag_for(step)) if cfg.checkpoint.save else \
                "(none: checkpoint.save is false)"
            raise Requeue(f"stopped at step {step} ({stop_reason}); checkpoint {saved} is complete: "
                          "run the same command again to resume")
        if due:
            self.save(wait=step == self.end)
        if step >= self.profile_at:  # an int comparison per step outside a profiler window
            with self.watchdog.phase("profile"):  # a window's end exports and uploads every rank's trace
                self.profile_at = self.profiler.after(step)
        return step >= self.end

    def evaluate(self, val: bool = True, probes: bool = True) -> dict:
        """data.val's metrics and the probes' (those asked for), with the EMA weights when there are some."""
        weights = like_parameters(self.ema.weights, self.engine.module) if self.ema else None
        out = {}
        if val and self.val_loader is not None:
            out.update(evaluate(self.engine.module, self.val_loader, self.objective, self.device, weights,
                                self.cfg.data.seed))
        if probes and self.probes:
            started = time.perf_counter()
            out.update(run_probes(self.engine.module, self.probes, self.objective, self.cfg.eval, self.device,
                                  weights, None if self.shots_recorded else self.record_shots))
            self.shots_recorded = True
            out["eval_probe_seconds"] = time.perf_counter() - started
        return out

    def record_shots(self, shots: dict) -> None:
        """Which images the few-shot probes fit on, by sample key (rank 0), beside metrics.jsonl."""
        with open(os.path.join(self.metrics.folder, SHOTS), "w") as f:
            json.dump(shots, f, indent=1)

    def agree_on_step(self) -> tuple[str | None, bool, bool]:
        """One small all-reduce per step: does any rank want to stop (signal, time budget), is the
        loss or gradient norm non-finite anywhere, is a timed checkpoint due (rank 0's clock)."""
        reason = self.stop.reason()
        minutes = self.cfg.train.checkpoint_every_minutes
        timed = bool(minutes) and self.env.rank == 0 and \
            time.monotonic() - self.state.last_checkpoint >= minutes * 60
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
        return (reason if stop else None), nonfinite, timed

    def save(self, wait: bool) -> None:
        if not self.cfg.checkpoint.save:
            return
        if self.state.nonfinite_streak:
            log.warning("step %d: not saving a checkpoint of a model with non-finite values", self.state.step)
            return
        with self.watchdog.phase("checkpoint save"):
            self.checkpointer.save(self.engine, self.state.step,
                                   {**self.manifest_extra, "zero_stage": self.engine.zero_optimization_stage()})
            self.state.last_checkpoint = time.monotonic()
            stall = self.checkpointer.last_stall
            log.info("step %d: checkpoint written locally in %.2f s (waited %.2f s for the previous upload)%s",
                     self.state.step, stall["write_s"], stall["wait_s"], "; uploading" if not wait else "")
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
        # The slowest rank's wait is the job's: the others wait for it in the next collective.
        wait = torch.tensor([self.train_loader.window()["data_wait_fraction"], stats["data_wait_fraction"]],
                            dtype=torch.float64, device=self.device)
        dist.all_reduce(wait, op=dist.ReduceOp.MAX)
        grad_norm = self.engine.get_global_grad_norm()
        values = {
            "loss": loss[0].item() / loss[1].item(), "lr": self.lr,
            "grad_norm": float(grad_norm) if grad_norm is not None else None,
            "images_per_s": images_per_s, "images_per_s_per_gpu": images_per_s / world,
            "images_per_s_running": images_per_s_running,
            "data_wait_fraction": wait[0].item(), "data_wait_fraction_running": wait[1].item(),
            "bad_samples": stats["bad_samples"],
            "mfu": self.flops_per_image * images_per_s / (world * self.peak) if self.peak else None,
            "memory_gb": (torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda"
                          else _max_rss_bytes()) / 2**30,
        }
        self.metrics.write(step, values)
        if self.env.rank == 0:
            mfu = f" mfu {values['mfu']:.1%}" if values["mfu"] is not None else ""
            log.info("step %d loss %.4f lr %.2e %.0f img/s (%.0f per rank) data wait %.0f%% (running %.0f%%)%s",
                     step, values["loss"], self.lr, images_per_s, images_per_s / world,
                     100 * values["data_wait_fraction"], 100 * values["data_wait_fraction_running"], mfu)
        self.window = Window(torch.zeros((), device=self.device))
        return values


def like_parameters(weights: dict, module: torch.nn.Module) -> dict:
    """The EMA's fp32 weights in the module's own dtypes (bf16 under DeepSpeed's bf16), for a
    forward pass with them: one copy of the weights while it runs (EMA needs ZeRO <= 2: the
    weights are whole on every rank anyway)."""
    dtypes = {name: p.dtype for name, p in module.named_parameters()}
    return {name: value.to(dtypes[name]) for name, value in weights.items()}


def _max_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# -- entry points ----------------------------------------------------------------------------
def run(cfg: Config) -> dict:
    """Train on every rank of the job."""
    check_model_config(cfg.model, cfg.train.objective)
    env = detect_env()
    cfg.accumulation(env.world_size)  # batch arithmetic checked before anything is built
    # Handlers in place before anything slow; the CLI holds the signals until start-up is over
    # (stop.listen), so one that comes meanwhile stops the run after its first step.
    stop = StopRequest(cfg.train.max_minutes)
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a torchrun worker: die with the agent, never orphaned
        die_with_parent(os.getppid())
    checkpointer = peers = watchdog = feed = None
    ok = False
    try:
        try:
            device = init_distributed(env, cfg.train.collective_timeout_s)
            peers = PeerWatch(env, cfg.train.collective_timeout_s)
            set_tf32(device, cfg.train.tf32)
            trainer, checkpointer, feed = _build(cfg, env, device, stop)
        except Exception as e:
            _requeue_if_signalled(stop, e)
            raise
        stop.listen()
        if cfg.train.watchdog:
            watchdog = trainer.watchdog.start(env, checkpointer.run, peers.master_host)
        result = trainer.train()
        with trainer.watchdog.phase("checkpoint save"):
            checkpointer.wait()
        ok = True
        return result
    except Requeue:
        ok = checkpointer is not None  # every rank agreed to stop and the checkpoint is complete: leave together
        raise
    except RuntimeError as e:  # what a failed collective raises; with every peer alive it stays an error
        lost = peers.lost() if peers is not None and not isinstance(e, VitforgeError) else []
        if lost:
            # gloo prefixes its source location: "[.../unbound_buffer.cc:78] Timed out waiting 8000ms ..."
            first = re.sub(r"^\[[^\]]*\] ", "", (str(e).strip() or type(e).__name__).splitlines()[0])
            raise PeerLost(f"lost contact with {', '.join(lost)} during a collective: {first}; no checkpoint "
                           "written since the newest complete one: run again (a SLURM job requeues) to resume "
                           "from it") from e
        raise
    finally:
        if watchdog is not None:
            watchdog.stop()
        if peers is not None:
            peers.close()
        if feed is not None:  # while the lease is held: tracking.json is written by the run's owner only
            feed.close(finished=trainer.state.step >= cfg.train.steps)
        if checkpointer is not None:
            try:
                checkpointer.release()
            except Exception as e:  # the lease expires by itself; never mask the real outcome
                log.warning("could not release the run's lease: %s", e)
        shutdown(graceful=ok)
        stop.restore()


def _requeue_if_signalled(stop: StopRequest, error: Exception) -> None:
    """A stop signal held during start-up also reached this rank's children, and a child that
    does not hold it dies of it (ninja's compilers, JIT-building a DeepSpeed op): start-up then
    fails. Nothing was trained since the last checkpoint, so the run is as resumable as if it had
    stopped at a step. A vitforge error (config, storage, checkpoint) is real and stays one."""
    held = stop.held()
    if held is not None and not isinstance(error, VitforgeError):
        raise Requeue(f"{held} came during start-up, which then failed ({type(error).__name__}: "
                      f"{str(error).splitlines()[0] if str(error) else ''}); nothing was trained since the last "
                      "checkpoint") from error


def _build(cfg: Config, env, device, stop: StopRequest) -> tuple[Trainer, Checkpointer, TrackingFeed | None]:
    check_trackers(cfg.tracking, warm=env.rank == 0)
    RandomState().restart(cfg.train.seed)
    train_loader = build_data_loader(cfg, cfg.data.train, True, env, device)
    index = train_loader.index
    val_loader = build_data_loader(cfg, cfg.data.val, False, env, device) if cfg.data.val else None
    probes = build_probes(cfg.eval, lambda source: build_data_loader(cfg, source, False, env, device))
    num_classes = cfg.model.num_classes or (index.num_classes if index else None)
    objective = get_objective(cfg.train.objective)
    _check_labelled(objective, train_loader, val_loader)
    if objective.labelled and not num_classes:
        raise ConfigError("model.num_classes is not set and the training data has no dataset.json to read it from")
    if cfg.train.ema_decay is not None and cfg.train.zero_stage == 3:
        raise ConfigError("train.ema_decay needs train.zero_stage <= 2 (ZeRO-3 partitions the weights)")
    ema = EMA(cfg.train.ema_decay) if cfg.train.ema_decay is not None else None
    metrics = MetricsLog(metrics_folder(cfg), enabled=env.rank == 0)
    # What a checkpoint holds beside DeepSpeed's files: one entry per part.
    parts = StateParts(per_rank={"loader": train_loader, "rng": RandomState()},
                       shared={"ema": ema} if ema is not None else {})
    checkpointer = Checkpointer(cfg.checkpoint.run_url, cfg.checkpoint.staging, cfg.checkpoint.keep_last,
                                cfg.checkpoint.keep_every, cfg.checkpoint.lease_minutes,
                                cfg.checkpoint.upload_timeout_minutes, metrics.path if env.rank == 0 else None, parts)
    if cfg.checkpoint.save:
        checkpointer.claim()

    def make_model() -> torch.nn.Module:
        return build_model(cfg.model.name, num_classes, cfg.model.image_size, cfg.model.drop_path, cfg.model.dropout,
                           cfg.model.pre_logits, cfg.train.objective)

    def engine_for(universal: bool):
        config = cfg
        if universal:  # DeepSpeed must know at construction that it will load a universal checkpoint
            config = cfg.model_copy(update={"deepspeed": {**cfg.deepspeed, "checkpoint": {
                **cfg.deepspeed.get("checkpoint", {}), "load_universal": True}}})
        return build_engine(config, make_model, env.world_size, device)

    engine, restored = checkpointer.restore(engine_for, cfg.checkpoint.resume)
    if restored is None and cfg.checkpoint.init_from:
        changes = _init_from(engine, cfg.checkpoint.init_from, device, make_model)
        log.info("initialised from %s (%s)", cfg.checkpoint.init_from, "; ".join(changes) or "as is")
    if ema is not None:  # unless restored: from the weights training starts from (restored, fine-tuned from, fresh)
        ema.start(engine.module)
    trainer = Trainer(cfg, env, device, engine, train_loader, val_loader, objective,
                      checkpointer, metrics, ema, {"config": cfg.model_dump(mode="json"), "num_classes": num_classes,
                                                   "train_samples": train_loader.num_samples,
                                                   "classes": getattr(index, "classes", None),
                                                   "objective": cfg.train.objective}, stop, probes)
    metrics.open()
    if restored is not None:
        trainer.state.step = restored.step
        metrics.resume_at(restored.step, _saved_metrics(checkpointer) if env.rank == 0 else None)
        log.info("resumed %s at step %d", checkpointer.run.object_url(restored.tag), restored.step)
    else:
        metrics.resume_at(0, None)
    # Each rank reads its shards' index files now, not at its first batch: a bad one ends every
    # rank with its error instead of leaving the others in the next collective.
    all_ok(lambda: [loader.prepare() for loader in (train_loader, val_loader, *_probe_loaders(probes))
                    if loader is not None])
    feed = start_tracking(cfg, checkpointer.run, metrics.path, restored.step if restored else None) \
        if env.rank == 0 else None
    return trainer, checkpointer, feed


def _probe_loaders(probes: list[ProbeSet]) -> list:
    return [loader for probe in probes for loader in (probe.train, probe.test)]


def _check_labelled(objective: Objective, *loaders) -> None:
    """An objective that learns from class labels refuses data sharded without them."""
    if not objective.labelled:
        return
    unlabelled = " or ".join(o.name for o in OBJECTIVES.values() if not o.labelled)
    for loader in loaders:
        if loader is not None and loader.index is not None and not loader.index.labelled:
            raise ConfigError(f"{loader.spec.dataset} has no class labels (sharded with --no-labels): {objective.name} "
                              f"needs them; pre-train on it with --set train.objective={unlabelled}")


def _saved_metrics(checkpointer: Checkpointer) -> bytes | None:
    try:
        return checkpointer.run.get_bytes(METRICS)
    except FileNotFoundError:
        return None


def _init_from(engine, source: str, device: torch.device, make_model) -> list[str]:
    """Fine-tuning start: a run or checkpoint of ours (any ZeRO stage, local or s3://), or a timm
    state-dict file. The only place a layer may be replaced, and it says which.

    One download and consolidation per job, on rank 0, which also adapts the weights to the model
    (adapt_state_dict) and checks they fit; its errors reach every rank. The weights then go into
    the model tensor by tensor, broadcast from rank 0 on the engine's device: every rank writes its
    part of the optimizer's fp32 master from the fp32 tensor itself (bf16 would round the module's
    copy), and ZeRO-3 gathers one parameter at a time for the module's. Per rank: rank 0 the
    checkpoint's fp32 state (and at ZeRO-3 one more model, the
    template adapt_state_dict reads shapes and initial values from, as build_engine builds at
    ZeRO-3); every other rank one tensor beyond the model."""
    import deepspeed

    zero3 = engine.zero_optimization_stage() == 3

    def load() -> dict:
        if source.endswith(".safetensors"):
            from safetensors.torch import load_file

            return load_file(source)
        if os.path.isfile(source):
            state = torch.load(source, map_location="cpu", weights_only=True)
            return state.get("state_dict", state.get("model", state))
        with tempfile.TemporaryDirectory(prefix="vitforge-init-") as scratch:
            return consolidate(source, scratch, prefer_ema=True).state

    def load_and_adapt() -> tuple[dict, list[str]]:
        state = {k.removeprefix("module."): v.detach() for k, v in load().items()}
        # ZeRO-3's own module holds empty partitions: a whole model stands in for its shapes, built
        # without drawing from rank 0's random stream (the other ranks build none).
        with torch.random.fork_rng(devices=[]):
            template = make_model() if zero3 else engine.module
        state, changed = adapt_state_dict(state, template)
        check_fits(template.state_dict(), state, source)
        return state, changed

    kept, changed = agree_keeping(load_and_adapt, lambda adapted: adapted[1])
    params = dict(engine.module.named_parameters())
    buffers = dict(engine.module.named_buffers())

    def receive(name: str, value: torch.Tensor) -> None:
        if name in buffers:
            buffers[name].copy_(value)
            return
        param = params[name]
        with deepspeed.zero.GatheredParameters([param], modifier_rank=0, enabled=zero3):
            param.data.copy_(value)
        # The optimizer's fp32 master (ZeRO's partitions, or bf16's fp32 copy) gets the checkpoint's
        # values themselves, not the module's copy of them, which bf16 has rounded.
        _set_fp32_master(param, value, zero3)

    with torch.no_grad():
        broadcast_state(kept[0] if kept is not None else None, device, receive)
    return changed


def _set_fp32_master(param: torch.nn.Parameter, value: torch.Tensor, zero3: bool) -> None:
    """`value`, whole on every rank, into the part of the optimizer's fp32 master that this rank
    holds (nothing where the optimizer keeps none: the module's weights are the master)."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_local_fp32_param

    if not zero3:
        safe_set_full_fp32_param(param, value)
        return
    # DeepSpeed's full setter reads past the end of a parameter the world size does not divide (the
    # last partition is padded), so each rank cuts its own partition, padding included.
    size = param.ds_tensor.numel()
    start = dist.get_rank(group=param.ds_process_group) * size
    mine = torch.zeros(size, dtype=torch.float32, device=value.device)
    piece = value.flatten()[start:start + size]
    mine[:piece.numel()] = piece
    safe_set_local_fp32_param(param, mine)


def run_eval(cfg: Config, checkpoint_url: str, model_overrides: set[str]) -> dict:
    """Evaluate a checkpoint on data.val: the model and class map come from its manifest (keys
    set with --set model.X win), the training data is never touched."""
    if not cfg.data.val and not cfg.eval.probes:
        raise ConfigError("data.val and eval.probes are not set: nothing to evaluate on "
                          "(--set data.val=..., or eval.probes with --fewshot)")
    env = detect_env()
    device = init_distributed(env, cfg.train.collective_timeout_s)
    set_tf32(device, cfg.train.tf32)
    ok = False
    try:
        with tempfile.TemporaryDirectory(prefix="vitforge-eval-") as scratch:
            state, weights = consolidate_on_rank0(checkpoint_url, scratch)
            saved = weights.manifest.get("config", {}).get("model", {})
            model_cfg = cfg.model.model_copy(update={k: v for k, v in saved.items() if k not in model_overrides})
            num_classes = model_cfg.num_classes or weights.manifest.get("num_classes")
            check_model_config(model_cfg, saved_objective(weights.manifest))
            eval_cfg = cfg.model_copy(update={"model": model_cfg})
            val_loader = build_data_loader(eval_cfg, cfg.data.val, False, env, device) if cfg.data.val else None
            probes = build_probes(cfg.eval, lambda source: build_data_loader(eval_cfg, source, False, env, device))
            all_ok(lambda: [loader.prepare() for loader in (val_loader, *_probe_loaders(probes)) if loader is not None])
            objective = get_objective(saved_objective(weights.manifest))
            if val_loader is not None:
                _check_classes(weights.manifest.get("classes"), getattr(val_loader.index, "classes", None))
                _check_labelled(objective, val_loader)
            model = build_model(model_cfg.name, num_classes, model_cfg.image_size, pre_logits=model_cfg.pre_logits,
                                objective=objective.name).to(device)
            load_broadcast(model, state, weights.url, device)
            del state
            result = {"checkpoint": weights.url, "weights": weights.weights}
            if val_loader is not None:
                result.update(evaluate(model, val_loader, objective, device, seed=cfg.data.seed))
            if probes:
                result.update(run_probes(model, probes, objective, cfg.eval, device))
        ok = True
        return result
    finally:
        shutdown(graceful=ok)


def _check_classes(trained: list[str] | None, evaluated: list[str] | None) -> None:
    if trained and evaluated and list(trained) != list(evaluated):
        raise ConfigError(f"data.val has classes {evaluated[:5]}... but the checkpoint was trained on "
                          f"{trained[:5]}...: the labels would not mean the same thing")
