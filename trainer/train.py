"""`vitforge train` / `vitforge eval`: the training loop, readable in one screen.

Step-based: one step is one optimizer update (micro-batch x accumulation x world size images);
epochs come from the loader, whose position is checkpointed with the model, so a resumed run
continues the same sample stream.
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from pipeline import IGNORE_LABEL, LoaderSpec, build_loader

from . import checkpoint
from .config import Config, ConfigError
from .distributed import detect_env, init_distributed, shutdown
from .engine import build_engine, learning_rate
from .model import adapt_state_dict, build_model, forward_flops

log = logging.getLogger("vitforge.train")
# Dense bf16 peak FLOP/s per device (NVIDIA data sheets, SXM parts); MFU = model FLOPs/s / peak.
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12}


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)


@dataclass
class Metrics:
    """Rank 0 writes one JSON line per log step (and TensorBoard scalars when tensorboard is installed)."""

    run_dir: str
    enabled: bool
    writer: object = field(default=None, repr=False)

    def __post_init__(self):
        if self.enabled:
            os.makedirs(self.run_dir, exist_ok=True)
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(os.path.join(self.run_dir, "tensorboard"))
            except ImportError:
                log.info("tensorboard is not installed: metrics go to metrics.jsonl only")

    def write(self, step: int, values: dict) -> None:
        if not self.enabled:
            return
        with open(os.path.join(self.run_dir, "metrics.jsonl"), "a") as f:
            f.write(json.dumps({"step": step, **values}) + "\n")
        if self.writer is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)):
                    self.writer.add_scalar(key, value, step)
            self.writer.flush()


def masked_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over real labels only (-1: replaced or padding samples); 0 when there are
    none. No data-dependent branch, so no device sync."""
    total = F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_LABEL, reduction="sum")
    return total / (labels != IGNORE_LABEL).sum().clamp(min=1)


def evaluate(engine, loader, params: dict | None = None) -> dict:
    """Top-1, top-5 and loss over the whole eval set, summed across ranks; padding is ignored."""
    model = engine.module
    was_training = model.training
    model.eval()
    totals = torch.zeros(4, dtype=torch.float64)  # loss sum, top1, top5, count
    with torch.no_grad():
        for batch in loader:
            images, labels = batch["image"], batch["label"]
            logits = torch.func.functional_call(model, params, (images,)) if params else model(images)
            valid = labels != IGNORE_LABEL
            logits, labels = logits.float()[valid], labels[valid]
            if len(labels):
                top5 = logits.topk(min(5, logits.shape[1]), dim=1).indices
                totals += torch.tensor([F.cross_entropy(logits, labels, reduction="sum").item(),
                                        (top5[:, 0] == labels).sum().item(),
                                        (top5 == labels[:, None]).any(dim=1).sum().item(), len(labels)],
                                       dtype=torch.float64)
    dist.all_reduce(totals)
    model.train(was_training)
    count = max(totals[3].item(), 1)
    return {"eval_loss": totals[0].item() / count, "eval_top1": totals[1].item() / count,
            "eval_top5": totals[2].item() / count, "eval_samples": int(totals[3].item())}


def load_initial_weights(engine, path: str) -> list[str]:
    """Fine-tuning start: our checkpoint folder (consolidated from any ZeRO stage) or a timm state dict."""
    if os.path.isdir(path):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(path, tag=checkpoint.latest(path))
    elif path.endswith(".safetensors"):
        from safetensors.torch import load_file

        state = load_file(path)
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)
        state = state.get("state_dict", state.get("model", state))
    state = {k.removeprefix("module."): v.detach() for k, v in state.items()}
    state, changed = adapt_state_dict(state, engine.module)
    engine.module.load_state_dict(state, strict=True)
    return changed


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _loader(cfg: Config, source: str, train: bool, env, device):
    spec = LoaderSpec(source, batch_size=cfg.train.micro_batch, image_size=cfg.model.image_size, train=train,
                      backend="synthetic" if source == "synthetic" else cfg.data.backend, seed=cfg.data.seed,
                      workers=cfg.data.workers, dtype="bfloat16" if cfg.train.precision == "bf16" else "float32")
    return build_loader(spec, env.rank, env.world_size, device, synthetic_classes=cfg.model.num_classes or 1000,
                        accumulation=cfg.accumulation(env.world_size) if train else 1)


def run(cfg: Config, evaluate_only: str | None = None) -> dict:
    """Train (or, with `evaluate_only` = a run folder, evaluate its latest checkpoint) on every rank."""
    env = detect_env()
    device = init_distributed(env)
    ok = False
    try:
        result = _run(cfg, env, device, evaluate_only)
        ok = True
        return result
    finally:
        shutdown(graceful=ok)


def _run(cfg: Config, env, device, evaluate_only: str | None) -> dict:
    cfg.accumulation(env.world_size)  # batch arithmetic checked before anything is built
    _seed_everything(cfg.train.seed)
    train_loader = _loader(cfg, cfg.data.train, True, env, device)
    num_classes = cfg.model.num_classes or (train_loader.index.num_classes if train_loader.index else None)
    if not num_classes:
        raise ConfigError("model.num_classes is not set and the training data has no dataset.json to read it from")
    val_loader = _loader(cfg, cfg.data.val, False, env, device) if cfg.data.val else None
    run_dir = evaluate_only or os.path.join(cfg.checkpoint.dir, cfg.checkpoint.run)
    tag = checkpoint.latest(run_dir)
    if tag and not evaluate_only and checkpoint.read_manifest(run_dir, tag)["world_size"] != env.world_size:
        # DeepSpeed must know at construction that it will load a universal checkpoint.
        cfg = cfg.model_copy(update={"deepspeed": {**cfg.deepspeed, "checkpoint": {
            **cfg.deepspeed.get("checkpoint", {}), "load_universal": True}}})
    engine = build_engine(cfg, lambda: build_model(cfg.model.name, num_classes, cfg.model.image_size,
                                                   cfg.model.drop_path), env.world_size)
    metrics = Metrics(run_dir, enabled=env.rank == 0 and evaluate_only is None)
    if evaluate_only:
        return _evaluate_run(engine, val_loader, evaluate_only)
    step, ema = 0, None
    if tag:
        step, mine, shared = checkpoint.load(run_dir, tag, engine)
        train_loader.load_state_dict(mine["loader"])
        ema = shared.get("ema")
        log.info("resumed %s at step %d", os.path.join(run_dir, tag), step)
    elif cfg.checkpoint.init_from:
        changes = load_initial_weights(engine, cfg.checkpoint.init_from)
        log.info("initialised from %s (%s)", cfg.checkpoint.init_from, "; ".join(changes) or "as is")
    if cfg.train.ema_decay is not None and ema is None:
        if cfg.train.zero_stage == 3:
            raise ConfigError("train.ema_decay needs train.zero_stage <= 2 (ZeRO-3 partitions the weights)")
        ema = {k: v.detach().float().clone() for k, v in engine.module.named_parameters()}
    return _train(cfg, env, device, engine, train_loader, val_loader, metrics, run_dir, step, ema)


def _evaluate_run(engine, val_loader, run_dir: str) -> dict:
    """Weights consolidated from any ZeRO stage and world size; the EMA weights when the run kept them."""
    if val_loader is None:
        raise ConfigError("data.val is not set: nothing to evaluate on")
    tag = checkpoint.latest(run_dir)
    if tag is None:
        raise ConfigError(f"{run_dir}: no checkpoint to evaluate")
    load_initial_weights(engine, run_dir)
    shared = os.path.join(run_dir, tag, "shared_state.pt")
    ema = torch.load(shared, weights_only=False).get("ema") if os.path.exists(shared) else None
    return {"checkpoint": os.path.join(run_dir, tag), "weights": "ema" if ema else "model",
            **evaluate(engine, val_loader, ema)}


def _train(cfg, env, device, engine, loader, val_loader, metrics, run_dir, step, ema) -> dict:
    accumulation = cfg.accumulation(env.world_size)
    images_per_step = cfg.train.global_batch
    flops_per_image = 3 * forward_flops(engine.module)  # forward + backward
    peak = peak_flops(device)
    window = {"loss": torch.zeros((), device=device), "micro": 0, "start": time.perf_counter(), "steps": 0}
    micro, last = 0, {}
    end = min(cfg.train.steps, cfg.train.stop_at or cfg.train.steps)
    while step < end:
        for batch in loader:
            lr = learning_rate(cfg, step)
            for group in engine.optimizer.param_groups:
                group["lr"] = lr
            loss = masked_loss(engine(batch["image"]), batch["label"])
            engine.backward(loss)
            engine.step()
            window["loss"] += loss.detach().float()  # summed on the device: no sync per micro-step
            window["micro"] += 1
            micro += 1
            if micro % accumulation:
                continue
            step += 1
            window["steps"] += 1
            if ema is not None:
                with torch.no_grad():
                    for name, param in engine.module.named_parameters():
                        ema[name].mul_(cfg.train.ema_decay).add_(param.detach().float(), alpha=1 - cfg.train.ema_decay)
            if step % cfg.train.log_every == 0 or step == end:
                last = _log(engine, loader, metrics, step, lr, window, images_per_step, flops_per_image, peak, device)
            if val_loader is not None and (step % cfg.train.eval_every == 0 or step == end):
                last.update(evaluate(engine, val_loader, ema))
                metrics.write(step, {k: v for k, v in last.items() if k.startswith("eval")})
            if cfg.checkpoint.save and (step % cfg.train.checkpoint_every == 0 or step == end):
                checkpoint.save(run_dir, engine, step, {"loader": loader.state_dict()},
                                {"ema": ema} if ema is not None else {}, cfg.model_dump(mode="json"))
            if step >= end:
                break
    return last


def _log(engine, loader, metrics, step, lr, window, images_per_step, flops_per_image, peak, device) -> dict:
    loss = torch.tensor([window["loss"].item(), window["micro"]], dtype=torch.float64)
    dist.all_reduce(loss)
    elapsed = time.perf_counter() - window["start"]
    images_per_s = window["steps"] * images_per_step / elapsed
    world = dist.get_world_size()
    stats = loader.stats()
    grad_norm = engine.get_global_grad_norm()
    values = {
        "loss": loss[0].item() / loss[1].item(), "lr": lr,
        "grad_norm": float(grad_norm) if grad_norm is not None else None,
        "images_per_s": images_per_s, "images_per_s_per_gpu": images_per_s / world,
        "data_wait_fraction": stats["data_wait_fraction"], "bad_samples": stats["bad_samples"],
        "mfu": flops_per_image * images_per_s / (world * peak) if peak else None,
        "memory_gb": (torch.cuda.max_memory_allocated(device) if device.type == "cuda"
                      else _max_rss_bytes()) / 2**30,
    }
    metrics.write(step, values)
    if dist.get_rank() == 0:
        mfu = f" mfu {values['mfu']:.1%}" if values["mfu"] is not None else ""
        log.info("step %d loss %.4f lr %.2e %.0f img/s (%.0f per rank) data wait %.0f%%%s",
                 step, values["loss"], lr, images_per_s, images_per_s / world, 100 * values["data_wait_fraction"], mfu)
    window.update(loss=torch.zeros((), device=device), micro=0, start=time.perf_counter(), steps=0)
    return values


def _max_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
