"""The GPU-minded paths, run where a CPU can run them: blocks compiled with torch.compile (inductor
on the CPU), AdamW's fused kernel (it has a CPU version), TF32 (CUDA only: a no-op here), and the
host-to-device copy one batch ahead (its ordering; the CUDA stream itself needs a GPU)."""

from __future__ import annotations

import pytest
import torch

from common.cli import EXTENSIONS, train_args, vitforge
from vitforge.pipeline.ahead import copy_ahead
from vitforge.trainer import ConfigError, build_model, load_config
from vitforge.trainer.engine import compile_blocks, make_optimizer, set_tf32


@pytest.mark.slow
def test_compiled_blocks_compute_what_eager_ones_do_and_keep_their_keys():
    torch.manual_seed(0)
    model, eager = build_model("vit_tiny_cpu", 10, 32), build_model("vit_tiny_cpu", 10, 32)
    eager.load_state_dict(model.state_dict())
    keys = list(model.state_dict())
    assert compile_blocks(model) == 2  # vit_tiny_cpu has 2 blocks
    assert list(model.state_dict()) == keys  # checkpoints load with or without compile
    images = torch.randn(4, 3, 32, 32)
    compiled_out, eager_out = model(images), eager(images)
    assert torch.allclose(compiled_out, eager_out, atol=1e-5)
    compiled_out.square().sum().backward()
    eager_out.square().sum().backward()
    for (name, a), b in zip(model.named_parameters(), eager.parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-5), name
    masked = build_model("vit_tiny_cpu", 10, 32, objective="masked_patch_prediction")
    hybrid = build_model("vit_hybrid_tiny_cpu", 10, 32)
    assert compile_blocks(masked) == 2 and compile_blocks(hybrid) == 2  # the encoder's blocks, not the stem


def test_fused_adamw_steps_like_the_default_one():
    torch.manual_seed(0)
    cfg = load_config("tiny_cpu", ["optimizer.fused=on", "optimizer.warmup_steps=0"])
    models = [build_model("vit_tiny_cpu", 10, 32) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    initial = [p.detach().clone() for p in models[0].parameters()]
    fused = make_optimizer(cfg, models[0], torch.device("cpu"))
    plain = make_optimizer(cfg.model_copy(update={"optimizer": cfg.optimizer.model_copy(update={"fused": "auto"})}),
                           models[1], torch.device("cpu"))
    assert fused.defaults["fused"] is True and not plain.defaults["fused"]  # auto: fused on CUDA only
    # The same gradients for both (well above Adam's eps, where the two kernels' rounding differs
    # most): three steps, weight decay included.
    generator = torch.Generator().manual_seed(1)
    gradients = [[torch.randn(p.shape, generator=generator) * 1e-2 for p in models[0].parameters()]
                 for _ in range(3)]
    for model, optimizer in zip(models, (fused, plain)):
        for step in gradients:
            for param, grad in zip(model.parameters(), step):
                param.grad = grad.clone()
            optimizer.step()
    assert max((p - start).abs().max() for p, start in zip(models[0].parameters(), initial)) > 1e-3  # they moved
    for a, b in zip(*(m.parameters() for m in models)):
        assert torch.allclose(a, b, atol=1e-6), (a - b).abs().max()


def test_tf32_is_a_cuda_setting_only():
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    set_tf32(torch.device("cpu"), not before[0])
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == before


@pytest.mark.skipif(not torch.cuda.is_available(), reason="TF32 flags take effect on a CUDA device only")
def test_tf32_turns_on_and_off_on_cuda():
    set_tf32(torch.device("cuda"), True)
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    set_tf32(torch.device("cuda"), False)
    assert not torch.backends.cuda.matmul.allow_tf32


def test_copy_ahead_moves_each_batch_once_in_order_one_ahead_of_the_consumer():
    moved = []

    def move(batch):
        moved.append(batch["n"])
        return {**batch, "moved": True}

    delivered = []
    for batch in copy_ahead(iter([{"n": i} for i in range(5)]), move):
        delivered.append(batch["n"])
        assert batch["moved"]
        # When the consumer holds batch i, batch i+1 is already moved (its copy overlaps the step).
        assert moved[-1] == min(batch["n"] + 1, 4)
    assert delivered == moved == list(range(5))
    assert list(copy_ahead(iter([]), move)) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the side-stream copy needs a CUDA device")
def test_copy_ahead_on_a_cuda_stream_delivers_the_same_tensors():
    device = torch.device("cuda")
    batches = [{"image": torch.full((4, 8), float(i)).pin_memory()} for i in range(4)]
    out = list(copy_ahead(iter(batches), lambda b: {"image": b["image"].to(device, non_blocking=True) * 2},
                          torch.cuda.Stream(device)))
    assert [float(b["image"].mean()) for b in out] == [0.0, 2.0, 4.0, 6.0]


def test_compile_with_zero3_is_refused():
    with pytest.raises(ConfigError, match="model.compile needs train.zero_stage <= 2"):
        load_config("tiny_cpu", ["model.compile=true", "train.zero_stage=3"])


@pytest.mark.slow(seconds=55)
def test_a_compiled_fused_run_resumes_uncompiled(data):
    """Through `vitforge train` (one process): compile and the fused optimizer change no
    checkpoint format, so a run continues with them off."""
    common = ["train.steps=8", "train.checkpoint_every=4", "train.log_every=1", "data.val=null"]
    first = vitforge("train", *train_args(data, "compiled", *common, "model.compile=true", "optimizer.fused=on",
                                          "train.stop_at=4"), env=EXTENSIONS, check=False, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    second = vitforge("train", *train_args(data, "compiled", *common), env=EXTENSIONS, check=False)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed" in second.stderr and "at step 4" in second.stderr
