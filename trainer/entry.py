"""`vitforge train` and `vitforge eval` on each rank of a job: start-up, the run, and how it ends
(complete, stopped for requeue with a complete checkpoint, a lost peer named, an error), always
leaving the process group and the run's lease behind it in order."""

from __future__ import annotations

import logging
import os
import re
import tempfile

from vitforge.core import VitforgeError, die_with_parent

from .build import build_data_loader, build_trainer, check_labelled, probe_loaders
from .config import Config, ConfigError
from .distributed import all_ok, detect_env, init_distributed, raised_together, shutdown
from .engine import set_tf32
from .export import consolidate_on_rank0, load_broadcast
from .model import build_model
from .model_names import check_model_config
from .objective import get_objective
from .objectives import saved_objective
from .peers import PeerWatch
from .preemption import StopRequest
from .probe_eval import build_probes, run_probes
from .train import PeerLost, Requeue, evaluate

log = logging.getLogger("vitforge.train")


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
            device = init_distributed(env, cfg.train.collective_timeout_s, cfg.train.rendezvous_timeout_s)
            peers = PeerWatch(env, cfg.train.collective_timeout_s)
            set_tf32(device, cfg.train.tf32)
            trainer, checkpointer, feed = build_trainer(cfg, env, device, stop)
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
    except Exception as e:
        ok = raised_together(e)  # every rank stops at this point: they leave together, as on success
        # a failed collective raises a RuntimeError; with every peer alive it stays an error
        collective = isinstance(e, RuntimeError) and not isinstance(e, VitforgeError) and not ok
        lost = peers.lost() if peers is not None and collective else []
        if lost == []:
            raise
        raise _peer_lost(e, lost) from e
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


def _peer_lost(error: Exception, lost: list[str] | None) -> PeerLost:
    """What a collective that failed because peers were lost (their hosts; None: rank 0 could not
    tell which) ends the run with."""
    # gloo prefixes its source location: "[.../unbound_buffer.cc:78] Timed out waiting 8000ms ..."
    first = re.sub(r"^\[[^\]]*\] ", "", (str(error).strip() or type(error).__name__).splitlines()[0])
    whom = (
        f"lost contact with {', '.join(lost)}"
        if lost
        else "lost contact with a peer (rank 0's rendezvous store did not answer in time to tell which)"
    )
    return PeerLost(
        f"{whom} during a collective: {first}; no checkpoint written since the newest complete one: "
        "run again (a SLURM job requeues) to resume from it"
    )


def _requeue_if_signalled(stop: StopRequest, error: Exception) -> None:
    """A stop signal held during start-up also reached this rank's children, and a child that
    does not hold it dies of it (ninja's compilers, JIT-building a DeepSpeed op): start-up then
    fails. Nothing was trained since the last checkpoint, so the run is as resumable as if it had
    stopped at a step. A vitforge error (config, storage, checkpoint) is real and stays one."""
    held = stop.held()
    if held is not None and not isinstance(error, VitforgeError):
        raise Requeue(
            f"{held} came during start-up, which then failed ({type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''}); nothing was trained since the last "
            "checkpoint"
        ) from error


def run_eval(cfg: Config, checkpoint_url: str, model_overrides: set[str]) -> dict:
    """Evaluate a checkpoint on data.val: the model and class map come from its manifest (keys
    set with --set model.X win), the training data is never touched."""
    if not cfg.data.val and not cfg.eval.probes:
        raise ConfigError(
            "data.val and eval.probes are not set: nothing to evaluate on "
            "(--set data.val=..., or eval.probes with --fewshot)"
        )
    env = detect_env()
    device = init_distributed(env, cfg.train.collective_timeout_s, cfg.train.rendezvous_timeout_s)
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
            all_ok(lambda: [loader.prepare() for loader in (val_loader, *probe_loaders(probes)) if loader is not None])
            objective = get_objective(saved_objective(weights.manifest))
            if val_loader is not None:
                _check_classes(weights.manifest.get("classes"), getattr(val_loader.index, "classes", None))
                check_labelled(objective, val_loader)
            model = build_model(
                model_cfg.name,
                num_classes,
                model_cfg.image_size,
                pre_logits=model_cfg.pre_logits,
                objective=objective.name,
            ).to(device)
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
        raise ConfigError(
            f"data.val has classes {evaluated[:5]}... but the checkpoint was trained on "
            f"{trained[:5]}...: the labels would not mean the same thing"
        )
