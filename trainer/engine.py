"""DeepSpeed applied from outside the model: config generation, ZeRO-3 construction, the optimizer."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import torch

from .config import Config
from .model import weight_decay_groups


def deepspeed_config(cfg: Config, world_size: int) -> dict:
    train = cfg.train
    zero: dict = {"stage": train.zero_stage}
    if train.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if train.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    if train.zero_stage == 3:
        # Exact logits on export (docs/ARCHITECTURE.md, measured facts); the memory saving is small for ViTs.
        zero["memory_efficient_linear"] = False
    generated = {
        "train_batch_size": train.global_batch,
        "train_micro_batch_size_per_gpu": train.micro_batch,
        "gradient_accumulation_steps": cfg.accumulation(world_size),
        "gradient_clipping": cfg.optimizer.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": train.precision == "bf16"},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    return _merge(generated, cfg.deepspeed)


def _merge(base: dict, override: dict) -> dict:
    merged = copy.deepcopy(base)
    for key, value in override.items():
        merged[key] = (
            _merge(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) else value
        )
    return merged


def make_optimizer(cfg: Config, model: torch.nn.Module, device: torch.device) -> torch.optim.Optimizer:
    opt = cfg.optimizer
    groups = weight_decay_groups(model, opt.weight_decay)
    if opt.name == "sgd":
        return torch.optim.SGD(groups, lr=opt.lr, momentum=opt.momentum)
    fused = opt.fused == "on" or (opt.fused == "auto" and device.type == "cuda")
    # None, not False: torch then picks its multi-tensor (foreach) kernels where they exist.
    return torch.optim.AdamW(groups, lr=opt.lr, betas=opt.betas, fused=True if fused else None)


def compile_blocks(model: torch.nn.Module) -> int:
    """torch.compile every transformer block in place, as torchtitan does: the blocks are alike,
    so they share one compiled graph, and the module tree and state-dict keys stay as they were
    (checkpoints load with or without compile). Returns how many blocks were compiled."""
    from timm.models.vision_transformer import Block

    blocks = [m for m in model.modules() if isinstance(m, Block)]
    for block in blocks:
        block.compile()
    return len(blocks)


def set_tf32(device: torch.device, enabled: bool) -> None:
    """TF32 for fp32 matmuls and convolutions on CUDA (a no-op elsewhere)."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = enabled
        torch.backends.cudnn.allow_tf32 = enabled


def learning_rate(cfg: Config, step: int) -> float:
    """Linear warmup to the peak, then linear or cosine decay to min_lr at the last step, or BiT's
    staircase (x0.1 from each decay_at fraction of the steps on): a pure function of the step, so
    resuming needs no scheduler state."""
    opt, total = cfg.optimizer, cfg.train.steps
    if step < opt.warmup_steps:
        return opt.lr * (step + 1) / opt.warmup_steps
    if opt.schedule == "constant":
        return opt.lr
    if opt.schedule == "step":
        return opt.lr * 0.1 ** sum(step >= fraction * total for fraction in opt.decay_at)
    progress = min((step - opt.warmup_steps) / max(total - opt.warmup_steps, 1), 1.0)
    shape = 1 - progress if opt.schedule == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
    return opt.min_lr + (opt.lr - opt.min_lr) * shape


def build_engine(cfg: Config, make_model: Callable[[], torch.nn.Module], world_size: int, device: torch.device):
    import deepspeed

    ds_config = deepspeed_config(cfg, world_size)
    if cfg.train.zero_stage == 3:
        # zero.Init partitions parameters as they are created, so timm's init runs on empty shards
        # (docs/ARCHITECTURE.md, measured facts). Rank 0 builds the model normally, with the same seed as every other
        # stage, and its values are copied into the partitions: ZeRO-3 starts from the same weights.
        import torch.distributed as dist

        reference = make_model() if dist.get_rank() == 0 else None
        with deepspeed.zero.Init(config_dict_or_path=ds_config):
            model = make_model()
        sources = dict(reference.named_parameters()) if reference is not None else {}
        for name, param in model.named_parameters():
            with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                if reference is not None:
                    param.data.copy_(sources[name].data)
        del reference
    else:
        model = make_model()
    if cfg.model.grad_checkpointing:
        model.set_grad_checkpointing(True)
    if cfg.model.compile:
        compile_blocks(model)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=make_optimizer(cfg, model, device), config=ds_config)
    return engine
