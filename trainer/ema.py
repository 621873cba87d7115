"""Polyak averaging of the weights (the ViT paper's fine-tuning: decay 0.9999), a shared state part.

Per rank: one fp32 copy of the model's parameters (ZeRO <= 2 only: the weights are whole on every rank)."""

from __future__ import annotations

import torch


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


def like_parameters(weights: dict, module: torch.nn.Module) -> dict:
    """The EMA's fp32 weights in the module's own dtypes (bf16 under DeepSpeed's bf16), for a
    forward pass with them: one copy of the weights while it runs (EMA needs ZeRO <= 2: the
    weights are whole on every rank anyway)."""
    dtypes = {name: p.dtype for name, p in module.named_parameters()}
    return {name: value.to(dtypes[name]) for name, value in weights.items()}
