"""The EMA's weights (trainer/ema.py) handed to a model of another dtype."""

from __future__ import annotations

import pytest
import torch

from vitforge.trainer import build_model, get_objective
from vitforge.trainer.ema import like_parameters


def test_ema_weights_reach_a_bf16_model_in_its_own_dtype():
    """DeepSpeed's bf16 module with the EMA's fp32 weights: cast to the module's dtypes, the probe's
    forward pass runs (fp32 weights on bf16 inputs would fail in the first convolution)."""
    model = build_model("vit_tiny_cpu", 7, 32).to(torch.bfloat16).eval()
    ema = {k: v.detach().float() for k, v in model.named_parameters()}
    images = torch.randn(2, 3, 32, 32, dtype=torch.bfloat16)
    features = get_objective("classification").features
    with pytest.raises(RuntimeError):
        features(model, images, ema)
    torch.testing.assert_close(features(model, images, like_parameters(ema, model)), features(model, images, None))
