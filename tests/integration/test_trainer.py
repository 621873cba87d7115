"""The trainer: real DeepSpeed ZeRO across 2 processes (gloo on CPU), on shards made by `vitforge shard`."""

from __future__ import annotations

import json

import pytest
import torch

from common.cli import EXTENSIONS, train, train_args, vitforge
from vitforge.trainer import build_model, load_config

def metrics(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def losses(run) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in metrics(run) if "loss" in m}


def final_weights(folder) -> dict:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    tag = (folder / "latest").read_text().strip()
    return {k: v.detach() for k, v in get_fp32_state_dict_from_zero_checkpoint(str(folder), tag=tag).items()}


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


@pytest.mark.slow
def test_zero3_bf16_with_activation_checkpointing(data):
    train(data, "z3bf16", "train.zero_stage=3", "train.precision=bf16", "model.grad_checkpointing=true",
          "train.steps=30", "train.eval_every=30", "train.log_every=1")
    history = losses(data / "runs" / "z3bf16")
    assert sum(history[s] for s in range(26, 31)) / 5 < 0.8 * history[1]
    assert metrics(data / "runs" / "z3bf16")[-1]["eval_top1"] > 0.2


@pytest.mark.slow
def test_a_zero3_run_resumed_at_another_world_size_gives_the_same_losses_and_weights(data):
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
