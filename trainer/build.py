"""Building a training run on one rank: its loaders, model and engine (restored from the run's newest
checkpoint, or initialised from another run or a timm file for fine-tuning), checkpointer, metrics,
EMA and probes, handed to the Trainer (train.py) as components."""

from __future__ import annotations

import logging
import os
import tempfile
from typing import Any

import torch
import torch.distributed as dist

from vitforge.core import is_remote
from vitforge.pipeline import LoaderSpec, build_loader, build_mixture_loader

from .checkpoint import Checkpointer, Restored
from .config import Config, ConfigError
from .distributed import agree_keeping, all_ok, broadcast_state
from .ema import EMA
from .engine import build_engine
from .export import check_fits, consolidate
from .identity import CHANGES, check_resume
from .metrics import MetricsLog
from .model import adapt_state_dict, build_model
from .objective import OBJECTIVES, Objective, get_objective
from .preemption import StopRequest
from .probe_eval import ProbeSet, build_probes
from .run_store import METRICS
from .state import RandomState, StateParts
from .tracking import TrackingFeed, check_trackers, start_tracking
from .train import Trainer

log = logging.getLogger("vitforge.train")


def build_data_loader(cfg: Config, source, train: bool, env, device):
    """A rank's loader of `source`: a dataset, or (training) a mixture's list of sources."""
    mixture = isinstance(source, list)
    aug = cfg.augment
    crops = (
        {"scale": aug.crop_scale, "ratio": aug.crop_ratio, "flip": aug.flip, "randaugment": aug.randaugment}
        if train
        else {}
    )
    spec = LoaderSpec.of(
        cfg.data,
        source[0].url if mixture else source,
        batch_size=cfg.train.micro_batch,
        image_size=cfg.model.image_size,
        train=train,
        backend="synthetic" if source == "synthetic" else cfg.data.backend,
        subset=cfg.data.subset if train else None,
        dtype="bfloat16" if cfg.train.precision == "bf16" else "float32",
        **crops,
    )
    accumulation = cfg.accumulation(env.world_size) if train else 1
    if mixture:
        return build_mixture_loader(spec, source, env.rank, env.world_size, device, accumulation, env.local_world_size)
    return build_loader(
        spec,
        env.rank,
        env.world_size,
        device,
        synthetic_classes=cfg.model.num_classes or 1000,
        accumulation=accumulation,
        ranks_per_node=env.local_world_size,
    )


def metrics_folder(cfg: Config) -> str:
    """Where metrics.jsonl and TensorBoard go: the run folder when it is local, else ./logs/RUN."""
    if cfg.checkpoint.log_dir:
        return cfg.checkpoint.log_dir
    if is_remote(cfg.checkpoint.dir):
        return os.path.join("logs", cfg.checkpoint.run)
    return cfg.checkpoint.run_url.removeprefix("file://")


def build_trainer(cfg: Config, env, device, stop: StopRequest) -> tuple[Trainer, Checkpointer, TrackingFeed | None]:
    """Every component of a training run, built and restored (or initialised) on this rank: the
    Trainer, its checkpointer (the run's lease claimed) and, on rank 0, the tracking feed."""
    check_trackers(cfg.tracking, warm=env.rank == 0)
    RandomState().restart(cfg.train.seed)
    train_loader, val_loader, probes = _data_loaders(cfg, env, device)
    index = train_loader.index
    num_classes = cfg.model.num_classes or (index.num_classes if index else None)
    objective = get_objective(cfg.train.objective)
    check_labelled(objective, train_loader, val_loader)
    if objective.labelled and not num_classes:
        raise ConfigError("model.num_classes is not set and the training data has no dataset.json to read it from")
    if cfg.train.ema_decay is not None and cfg.train.zero_stage == 3:
        raise ConfigError("train.ema_decay needs train.zero_stage <= 2 (ZeRO-3 partitions the weights)")
    ema = EMA(cfg.train.ema_decay) if cfg.train.ema_decay is not None else None
    metrics = MetricsLog(metrics_folder(cfg), enabled=env.rank == 0)
    checkpointer = _checkpointer(cfg, env, train_loader, ema, metrics)
    config = cfg.model_dump(mode="json")
    engine, restored, history = _restore(cfg, env, device, checkpointer, config, num_classes)
    if ema is not None:  # unless restored: from the weights training starts from (restored, fine-tuned from, fresh)
        ema.start(engine.module)
    manifest_extra = {
        "config": config,
        "num_classes": num_classes,
        "train_samples": train_loader.num_samples,
        "classes": getattr(index, "classes", None),
        "objective": cfg.train.objective,
        **({CHANGES: history} if history else {}),
    }
    trainer = Trainer(
        cfg,
        env,
        device,
        engine,
        train_loader,
        val_loader,
        objective,
        checkpointer,
        metrics,
        ema,
        manifest_extra,
        stop,
        probes,
    )
    _start_at(trainer, metrics, checkpointer, restored, env.rank)
    # Each rank reads its shards' index files now, not at its first batch: a bad one ends every
    # rank with its error instead of leaving the others in the next collective.
    all_ok(
        lambda: [
            loader.prepare() for loader in (train_loader, val_loader, *probe_loaders(probes)) if loader is not None
        ]
    )
    feed = (
        start_tracking(cfg, checkpointer.run, metrics.path, restored.step if restored else None)
        if env.rank == 0
        else None
    )
    return trainer, checkpointer, feed


def _start_at(
    trainer: Trainer, metrics: MetricsLog, checkpointer: Checkpointer, restored: Restored | None, rank: int
) -> None:
    """The trainer and its metrics log at the step training starts from: a restored checkpoint's
    (its metrics kept up to there) or 0."""
    metrics.open()
    if restored is not None:
        trainer.state.step = restored.step
        metrics.resume_at(restored.step, saved_metrics(checkpointer) if rank == 0 else None)
        log.info("resumed %s at step %d", checkpointer.run.object_url(restored.tag), restored.step)
    else:
        metrics.resume_at(0, None)


def _data_loaders(cfg: Config, env, device) -> tuple[Any, Any, list[ProbeSet]]:
    """The rank's training loader, its held-out loader (or None) and the probes' loaders; a
    mixture's label space is checked against data.val's classes."""
    train_loader = build_data_loader(cfg, cfg.data.train, True, env, device)
    index = train_loader.index
    val_loader = build_data_loader(cfg, cfg.data.val, False, env, device) if cfg.data.val else None
    if val_loader is not None and hasattr(index, "check_eval"):  # a mixture: its label space against data.val's
        index.check_eval(getattr(val_loader.index, "classes", None), cfg.data.val)
    probes = build_probes(cfg.eval, lambda source: build_data_loader(cfg, source, False, env, device))
    return train_loader, val_loader, probes


def _checkpointer(cfg: Config, env, train_loader, ema: EMA | None, metrics: MetricsLog) -> Checkpointer:
    """The run's checkpointer, with the parts a checkpoint holds beside DeepSpeed's files; it claims
    the run's lease unless the run saves no checkpoints."""
    # What a checkpoint holds beside DeepSpeed's files: one entry per part.
    parts = StateParts(
        per_rank={"loader": train_loader, "rng": RandomState()}, shared={"ema": ema} if ema is not None else {}
    )
    checkpointer = Checkpointer(
        cfg.checkpoint.run_url,
        cfg.checkpoint.staging,
        cfg.checkpoint.keep_last,
        cfg.checkpoint.keep_every,
        cfg.checkpoint.lease_minutes,
        cfg.checkpoint.upload_timeout_minutes,
        metrics.path if env.rank == 0 else None,
        parts,
    )
    if cfg.checkpoint.save:
        checkpointer.claim()
    return checkpointer


def _restore(
    cfg: Config, env, device, checkpointer: Checkpointer, config: dict, num_classes: int | None
) -> tuple[Any, Restored | None, list]:
    """The engine, restored from the run's checkpoint (which must be of this run, its changed
    settings logged) or initialised (checkpoint.init_from, or fresh): (engine, what was restored,
    the history of changed settings for the manifests)."""

    def make_model() -> torch.nn.Module:
        return build_model(
            cfg.model.name,
            num_classes,
            cfg.model.image_size,
            cfg.model.drop_path,
            cfg.model.dropout,
            cfg.model.pre_logits,
            cfg.train.objective,
        )

    def engine_for(universal: bool):
        config = cfg
        if universal:  # DeepSpeed must know at construction that it will load a universal checkpoint
            config = cfg.model_copy(
                update={
                    "deepspeed": {
                        **cfg.deepspeed,
                        "checkpoint": {**cfg.deepspeed.get("checkpoint", {}), "load_universal": True},
                    }
                }
            )
        return build_engine(config, make_model, env.world_size, device)

    changes: dict[str, list] = {}

    def same_run(manifest: dict, url: str) -> None:
        changes.clear()
        changes.update(check_resume(manifest, config, num_classes, url))

    engine, restored = checkpointer.restore(engine_for, cfg.checkpoint.resume, same_run)
    history = list(restored.manifest.get(CHANGES, [])) if restored is not None else []
    if restored is not None and changes:
        log.info(
            "resuming %s with changed settings: %s",
            checkpointer.run.object_url(restored.tag),
            "; ".join(f"{key} {saved!r} -> {now!r}" for key, (saved, now) in changes.items()),
        )
        history.append({"step": restored.step, "settings": changes})
    if restored is None and cfg.checkpoint.init_from:
        replaced = init_from(engine, cfg.checkpoint.init_from, device, make_model)
        log.info("initialised from %s (%s)", cfg.checkpoint.init_from, "; ".join(replaced) or "as is")
    return engine, restored, history


def probe_loaders(probes: list[ProbeSet]) -> list:
    return [loader for probe in probes for loader in (probe.train, probe.test)]


def check_labelled(objective: Objective, *loaders) -> None:
    """An objective that learns from class labels refuses data sharded without them."""
    if not objective.labelled:
        return
    unlabelled = " or ".join(o.name for o in map(get_objective, OBJECTIVES) if not o.labelled)
    # a mixture's sources one by one, so the error names the one without labels
    for loader in [part for each in loaders if each is not None for part in getattr(each, "loaders", [each])]:
        if loader.index is not None and not loader.index.labelled:
            raise ConfigError(
                f"{loader.spec.dataset} has no class labels (sharded with --no-labels): {objective.name} "
                f"needs them; pre-train on it with --set train.objective={unlabelled}"
            )


def saved_metrics(checkpointer: Checkpointer) -> bytes | None:
    try:
        return checkpointer.run.get_bytes(METRICS)
    except FileNotFoundError:
        return None


def init_from(engine, source: str, device: torch.device, make_model) -> list[str]:
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
        set_fp32_master(param, value, zero3)

    with torch.no_grad():
        broadcast_state(kept[0] if kept is not None else None, device, receive)
    return changed


def set_fp32_master(param: torch.nn.Parameter, value: torch.Tensor, zero3: bool) -> None:
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
    piece = value.flatten()[start : start + size]
    mine[: piece.numel()] = piece
    safe_set_local_fp32_param(param, mine)
