"""The trainer: real DeepSpeed ZeRO across 2 processes (gloo on CPU), on shards made by `vitforge shard`."""

from __future__ import annotations

import json
import math

import pytest
import torch

from common.cli import EXTENSIONS, train, train_args, vitforge
from vitforge.trainer import (PAPER_PARAMETERS, adapt_state_dict, build_model, forward_flops, load_config,
                              parameter_count)

def metrics(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def losses(run) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in metrics(run) if "loss" in m}


def final_weights(folder) -> dict:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    tag = (folder / "latest").read_text().strip()
    return {k: v.detach() for k, v in get_fp32_state_dict_from_zero_checkpoint(str(folder), tag=tag).items()}


def test_parameter_counts_match_the_paper():
    for name, paper in PAPER_PARAMETERS.items():
        assert abs(parameter_count(name) - paper) / paper < 0.015, name


def analytic_vit_flops(model) -> float:
    """The ViT count by hand (2 x multiply-adds): per block QKV and output projections 4*N*D^2, MLP
    2*N*D*H, attention scores and values 2*N^2*D; plus the patch embedding and the head."""
    dim, patches = model.embed_dim, model.patch_embed.num_patches
    tokens, hidden = patches + model.num_prefix_tokens, model.blocks[0].mlp.fc1.out_features
    per_block = 4 * tokens * dim * dim + 2 * tokens * dim * hidden + 2 * tokens * tokens * dim
    patch_embed = patches * dim * math.prod(model.patch_embed.proj.weight.shape[1:])
    return 2.0 * (len(model.blocks) * per_block + patch_embed + dim * model.num_classes)


@pytest.mark.parametrize("name,size", [("vit_tiny_cpu", 32), ("vit_base_patch16_224", 224),
                                       ("vit_huge_patch14_224", 224), ("vit_huge_patch14_224", 518)])
def test_counted_flops_equal_the_analytic_vit_count(name, size):
    with torch.device("meta"):
        model = build_model(name, 1000, size)
    assert forward_flops(name, size) == analytic_vit_flops(model)
    if (name, size) == ("vit_huge_patch14_224", 224):
        assert abs(forward_flops(name, size) / 2 - 167.4e9) / 167.4e9 < 0.005  # the paper's 167.4 GMACs


@pytest.mark.parametrize("name,size", [("vit_hybrid_tiny_cpu", 32), ("vit_base_r50_s16_224", 224)])
def test_a_hybrid_counts_its_resnet_stem_too(name, size):
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        model = build_model(name, 1000, size)
        images = torch.empty(1, 3, size, size)
    with FlopCounterMode(display=False) as stem:
        model.patch_embed.backbone(images)
    assert stem.get_total_flops() > 0.1 * analytic_vit_flops(model)  # a stem worth counting
    assert forward_flops(name, size) == stem.get_total_flops() + analytic_vit_flops(model)


def test_position_embeddings_interpolate_for_higher_resolution():
    torch.manual_seed(0)
    original = build_model("vit_small_cpu", 10, 32).eval()
    images = torch.randn(2, 3, 32, 32)
    state = original.state_dict()
    same, changed = adapt_state_dict(state, build_model("vit_small_cpu", 10, 32))
    assert changed == []
    copy = build_model("vit_small_cpu", 10, 32).eval()
    copy.load_state_dict(same)
    assert torch.equal(copy(images), original(images))
    bigger = build_model("vit_small_cpu", 7, 64).eval()
    adapted, changed = adapt_state_dict(state, bigger)
    assert adapted["pos_embed"].shape == (1, 1 + 8 * 8, 128) and "pos_embed 4x4 -> 8x8" in changed[0]
    assert any("head.weight" in c for c in changed)
    bigger.load_state_dict(adapted, strict=True)
    assert bigger(torch.randn(2, 3, 64, 64)).shape == (2, 7)
    # Upsampled 4x4 -> 8x8 embeddings still carry the original grid: resampled back to 4x4 they
    # give nearly the original model's features at the original resolution.
    from timm.layers import resample_abs_pos_embed

    back = resample_abs_pos_embed(adapted["pos_embed"], new_size=(4, 4), num_prefix_tokens=1)
    restored = build_model("vit_small_cpu", 10, 32).eval()
    restored.load_state_dict({**state, "pos_embed": back})
    a, b = original.forward_features(images), restored.forward_features(images)
    assert torch.nn.functional.cosine_similarity(a.flatten(1), b.flatten(1)).min() > 0.99


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stages_learn(zero_run, stage):
    run = zero_run(stage)
    history = losses(run)
    first, last = history[1], sum(history[s] for s in range(51, 61)) / 10
    assert last < 0.5 * first, (first, last)
    final = metrics(run)[-1]
    assert final["eval_samples"] == 100 and final["eval_top1"] > 0.5  # chance is 0.1
    if stage == 2:  # the window's and the running data wait and images/s, in metrics.jsonl and TensorBoard
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        logged = metrics(run)[5]
        assert 0 <= logged["data_wait_fraction"] <= 1 and 0 <= logged["data_wait_fraction_running"] <= 1
        assert logged["images_per_s"] > 0 and logged["images_per_s_running"] > 0
        events = EventAccumulator(str(run / "tensorboard")).Reload()
        assert {"data_wait_fraction", "data_wait_fraction_running", "images_per_s_running"} <= \
            set(events.Tags()["scalars"])


@pytest.mark.slow
def test_stages_agree_and_match_plain_pytorch(data, zero_run):
    """The first 6 steps of each stage's run: warm-up (10 steps), whose learning rate does not
    depend on the run's length, so a 6-step run without DeepSpeed must give the same losses."""
    one, two, three = ({s: v for s, v in losses(zero_run(stage)).items() if s <= 6} for stage in (1, 2, 3))
    assert sorted(one) == list(range(1, 7))
    assert one == two  # ZeRO-1 and ZeRO-2 compute the same thing, bit for bit on CPU
    assert all(abs(one[s] - three[s]) < 1e-4 for s in one), (one, three)
    reference = _plain_pytorch_losses(data, steps=6)
    assert all(abs(one[s] - reference[s - 1]) < 1e-4 for s in one), (one, reference)


def _plain_pytorch_losses(data, steps: int) -> list[float]:
    """The same run without DeepSpeed: one process sees both ranks' batches."""
    from vitforge.pipeline import LoaderSpec, build_loader
    from vitforge.trainer.engine import learning_rate, make_optimizer
    from vitforge.trainer.objective import masked_loss

    cfg = load_config("tiny_cpu", [f"data.train={data / 'train'}", "train.steps=6"])
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model.name, 10, cfg.model.image_size)
    optimizer = make_optimizer(cfg, model, torch.device("cpu"))
    spec = LoaderSpec(str(data / "train"), batch_size=cfg.train.micro_batch, image_size=32, backend="torch",
                      workers=0, seed=cfg.data.seed)
    ranks = [iter(build_loader(spec, rank, 2)) for rank in range(2)]
    result = []
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(cfg, step)
        optimizer.zero_grad()
        batches = [next(r) for r in ranks]
        loss = sum(masked_loss(model(b["image"]), b["label"]) for b in batches) / 2
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optimizer.grad_clip)
        optimizer.step()
        result.append(loss.item())
    return result


@pytest.mark.slow
def test_gradient_accumulation_matches_a_bigger_micro_batch(data):
    train(data, "micro8", "train.micro_batch=8", "train.global_batch=16", "train.steps=5", "train.log_every=1",
          "data.val=null")
    train(data, "micro4x2", "train.micro_batch=4", "train.global_batch=16", "train.steps=5", "train.log_every=1",
          "data.val=null")
    a, b = losses(data / "runs" / "micro8"), losses(data / "runs" / "micro4x2")
    assert a.keys() == b.keys() and all(abs(a[s] - b[s]) < 1e-4 for s in a), (a, b)


@pytest.mark.slow
def test_eval_and_fine_tune_at_higher_resolution(data, zero_run):
    zero2 = zero_run(2)
    result = vitforge("eval", "tiny_cpu", "--checkpoint", zero2, "--set",
                      f"data.train={data / 'train'}", "--set", f"data.val={data / 'val'}", "--set",
                      "data.backend=torch", "--set", "data.workers=0", env=EXTENSIONS)
    evaluated = json.loads(result.stdout.strip().splitlines()[-1])
    assert evaluated["eval_top1"] == pytest.approx(metrics(zero2)[-1]["eval_top1"])
    tuned = train(data, "finetune", "model.image_size=48", "optimizer.name=sgd", "optimizer.lr=0.01",
                  "optimizer.weight_decay=0.0", "train.ema_decay=0.99", "train.steps=4", "train.eval_every=4",
                  f"checkpoint.init_from={zero2}")
    assert "pos_embed 4x4 -> 6x6" in tuned.stderr
    assert metrics(data / "runs" / "finetune")[-1]["eval_top1"] > 0.3


@pytest.mark.parametrize("override, message", [
    ("train.bogus=1", "train.bogus: unknown key"),
    ("train.steps=many", "train.steps: Input should be a valid integer"),
    ("train.global_batch=30", "not divisible by train.micro_batch 16 x 1 ranks"),
    ("data.train=/nonexistent/dataset", "no dataset manifest"),
])
@pytest.mark.slow
def test_config_errors_are_clear(data, override, message):
    result = vitforge("train", "tiny_cpu", "--set", override, "--set", f"checkpoint.dir={data / 'runs'}",
                      env=EXTENSIONS, check=False)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr


def test_shipped_recipes_validate():
    pretrain = load_config("vit_h14_pretrain")
    assert pretrain.optimizer.betas == (0.9, 0.999) and pretrain.optimizer.weight_decay == 0.1
    assert pretrain.train.global_batch == 4096 and pretrain.optimizer.warmup_steps == 10000
    finetune = load_config("vit_h14_finetune")
    assert finetune.model.image_size == 518 and finetune.train.ema_decay == 0.9999
    assert finetune.optimizer.name == "sgd" and finetune.optimizer.schedule == "cosine"
    assert pretrain.accumulation(64) == 1 and finetune.accumulation(64) == 1
    deit = load_config("vit_b16_in1k")
    assert (deit.augment.mixup, deit.augment.cutmix, deit.augment.label_smoothing) == (0.8, 1.0, 0.1)
    assert pretrain.model.pre_logits and not finetune.model.pre_logits and not deit.model.pre_logits
    assert deit.model.drop_path == 0.1 and deit.optimizer.weight_decay == 0.05 and deit.accumulation(8) == 1


def test_slurm_variables_map_to_torch_ones():
    from vitforge.core import first_host
    from vitforge.trainer.distributed import detect_env

    assert first_host("gpu[07-09,12],cpu1") == "gpu07"
    assert first_host("node5,node6") == "node5"
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1", "SLURM_JOB_NODELIST": "dgx[003-004]",
           "SLURM_JOB_ID": "123456", "SLURM_TASKS_PER_NODE": "8(x2)"}
    result = detect_env(env)
    assert (result.rank, result.world_size, result.local_rank, result.master_addr) == (5, 16, 1, "dgx003")
    assert result.local_world_size == 8 and env["LOCAL_WORLD_SIZE"] == "8"
    assert env["RANK"] == "5" and env["WORLD_SIZE"] == "16" and env["MASTER_ADDR"] == "dgx003"
    assert env["MASTER_PORT"] == str(20000 + 123456 % 20000)
    torchrun = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400",
                "SLURM_PROCID": "7", "SLURM_NTASKS": "8", "LOCAL_WORLD_SIZE": "2"}
    assert detect_env(torchrun).rank == 1  # a launcher's own variables win over SLURM's
    assert detect_env(torchrun).local_world_size == 2


def test_learning_rate_schedule():
    from vitforge.trainer.engine import learning_rate

    cfg = load_config("vit_h14_pretrain", ["train.steps=110000"])
    assert learning_rate(cfg, 0) == pytest.approx(3e-4 / 10000)
    assert learning_rate(cfg, 9999) == pytest.approx(3e-4)
    assert learning_rate(cfg, 60000) == pytest.approx(1.5e-4)
    assert learning_rate(cfg, 110000) == pytest.approx(0.0)
    cosine = load_config("vit_h14_finetune", ["train.steps=1500"])
    assert learning_rate(cosine, 1000) == pytest.approx(0.01 * 0.5)


@pytest.mark.slow
def test_zero3_bf16_with_activation_checkpointing(data):
    train(data, "z3bf16", "train.zero_stage=3", "train.precision=bf16", "model.grad_checkpointing=true",
          "train.steps=30", "train.eval_every=30", "train.log_every=1")
    history = losses(data / "runs" / "z3bf16")
    assert sum(history[s] for s in range(26, 31)) / 5 < 0.8 * history[1]
    assert metrics(data / "runs" / "z3bf16")[-1]["eval_top1"] > 0.2


@pytest.mark.slow
def test_resume_at_another_world_size(data):
    """Saved by 2 ranks with ZeRO-3, resumed by 1 through DeepSpeed's universal checkpoint: the same
    samples and (to float tolerance: accumulation sums in another order) the same losses as 2 ranks.
    (ZeRO-2, through the S3 store: test_checkpoint.)"""
    common = ["train.steps=24", "train.log_every=1", "train.checkpoint_every=12", "data.val=null",
              "train.zero_stage=3"]
    train(data, "ws3_straight", *common)
    train(data, "ws3_moved", *common, "train.stop_at=12")
    result = train(data, "ws3_moved", *common, nproc=1)
    assert "at step 12" in result.stderr
    assert "to a universal checkpoint" in result.stderr
    assert not (data / "runs" / "ws3_moved" / "step_00000012_universal").exists()  # converted in staging
    straight, moved = losses(data / "runs" / "ws3_straight"), losses(data / "runs" / "ws3_moved")
    assert moved.keys() == straight.keys()
    assert all(abs(moved[s] - straight[s]) < 1e-3 for s in moved), (straight, moved)
    a, b = final_weights(data / "runs" / "ws3_straight"), final_weights(data / "runs" / "ws3_moved")
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-3


@pytest.mark.slow
def test_a_subset_trains_on_part_of_the_data_and_evaluates_on_all_of_it(data):
    result = train(data, "subset", "data.subset=0.25", "train.steps=2", "train.eval_every=2", "train.log_every=1")
    assert "subset 0.25 of" in result.stderr and ": 100 samples" in result.stderr  # 25% of 400
    assert metrics(data / "runs" / "subset")[-1]["eval_samples"] == 100  # the whole val set
    bad = vitforge("train", *train_args(data, "subset_bad", "data.subset=5000", "train.steps=2"), env=EXTENSIONS,
                   check=False)
    assert bad.returncode == 2 and "subset 5000 selects 5000 of 400 samples" in bad.stderr


def test_the_pre_training_head_is_dropped_for_a_zero_initialised_classifier():
    """Paper section 3.1: pre-train with a tanh pre-logits layer; fine-tune with one zero-initialised
    linear layer, the rest of the network as it was."""
    torch.manual_seed(0)
    pretrained = build_model("vit_tiny_cpu", 10, 32, pre_logits=True)
    assert {k for k in pretrained.state_dict() if k.startswith("head.")} == {
        "head.pre_logits.weight", "head.pre_logits.bias", "head.fc.weight", "head.fc.bias"}
    images = torch.randn(3, 3, 32, 32)
    hidden = torch.tanh(pretrained.head.pre_logits(pretrained.forward_head(pretrained.forward_features(images),
                                                                           pre_logits=True)))
    assert torch.allclose(pretrained(images), pretrained.head.fc(hidden))
    tuned = build_model("vit_tiny_cpu", 7, 32)
    state, changed = adapt_state_dict(pretrained.state_dict(), tuned)
    assert "head.pre_logits.weight dropped (the pre-training head's representation layer)" in changed
    assert "head.weight (7, 64) zero-initialised for 7 classes" in changed
    tuned.load_state_dict(state, strict=True)
    assert torch.count_nonzero(tuned.head.weight) == 0 and torch.count_nonzero(tuned.head.bias) == 0
    assert torch.equal(tuned.forward_features(images), pretrained.forward_features(images))
    again = build_model("vit_tiny_cpu", 10, 32, pre_logits=True)
    kept, changed = adapt_state_dict(pretrained.state_dict(), again)
    assert changed == [] and all(torch.equal(kept[k], v) for k, v in pretrained.state_dict().items())


@pytest.mark.slow
def test_a_start_from_a_plain_shell_reuses_the_installations_op_build(data, tmp_path):
    """No venv on PATH (Debian's ninja first, where it is installed), no TORCH_EXTENSIONS_DIR, a
    fresh home: `vitforge build-ops` and a train find the op `make test` built, and rebuild nothing."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from vitforge.core import free_port

    cache = Path(sys.prefix) / "torch_extensions" / "deepspeed_shm_comm"
    built = {p.name: p.stat().st_mtime_ns for p in cache.iterdir()}
    plain = {k: v for k, v in os.environ.items() if k not in ("TORCH_EXTENSIONS_DIR", "VIRTUAL_ENV")}
    plain.update(PATH="/usr/bin:/bin", HOME=str(tmp_path / "home"), OMP_NUM_THREADS="1")
    ops = subprocess.run([sys.executable, "-m", "vitforge", "build-ops"], env=plain, capture_output=True, text=True,
                         timeout=300)
    assert ops.returncode == 0 and f"built in {Path(sys.prefix) / 'torch_extensions'}" in ops.stdout, ops.stderr
    one = {**plain, "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    result = subprocess.run([sys.executable, "-m", "vitforge", "train", *train_args(data, "plain_shell", "train.steps=1",
                                                                                     "data.val=null")],
                            env=one, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert {p.name: p.stat().st_mtime_ns for p in cache.iterdir()} == built  # nothing rebuilt
    assert not (tmp_path / "home" / ".cache" / "torch_extensions").exists()
