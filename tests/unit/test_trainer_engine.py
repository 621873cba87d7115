"""The learning-rate schedule (trainer/engine.py) of the shipped recipes: warm-up, then linear, cosine
or step decay."""

from __future__ import annotations

import pytest

from vitforge.trainer import ConfigError, load_config
from vitforge.trainer.engine import learning_rate


def test_learning_rate_schedule():
    cfg = load_config("vit_h14_pretrain", ["train.steps=110000"])
    assert learning_rate(cfg, 0) == pytest.approx(3e-4 / 10000)
    assert learning_rate(cfg, 9999) == pytest.approx(3e-4)
    assert learning_rate(cfg, 60000) == pytest.approx(1.5e-4)
    assert learning_rate(cfg, 110000) == pytest.approx(0.0)
    cosine = load_config("vit_h14_finetune", ["train.steps=1500"])
    assert learning_rate(cosine, 1000) == pytest.approx(0.01 * 0.5)


def test_the_bit_recipes_and_their_step_schedule():
    upstream = load_config("bit_r50x1_upstream")
    opt = upstream.optimizer
    assert (opt.name, opt.momentum, opt.weight_decay, opt.warmup_steps) == ("sgd", 0.9, 1e-4, 5000)
    assert opt.lr == pytest.approx(0.03 * upstream.train.global_batch / 256)
    assert upstream.train.steps == round(90 * 14_197_122 / 4096) and upstream.accumulation(64) == 1
    steps = upstream.train.steps
    for epoch, rate in ((29.9, 0.48), (30.1, 0.048), (59.9, 0.048), (60.1, 0.0048), (80.1, 0.00048)):
        assert learning_rate(upstream, int(epoch / 90 * steps)) == pytest.approx(rate)
    assert learning_rate(upstream, 0) == pytest.approx(0.48 / 5000)
    tiny = load_config("bit_tiny_cpu")
    assert tiny.model.name == "bit_tiny_cpu" and tiny.optimizer.schedule == "step"
    for bad in ("[0.6,0.3]", "[0.5,1.0]", "[0]"):
        with pytest.raises(ConfigError, match="optimizer.decay_at: decay_at must be ascending fractions"):
            load_config("bit_tiny_cpu", [f"optimizer.decay_at={bad}"])
