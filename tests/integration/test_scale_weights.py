"""Weights moved tensor by tensor (fine-tune init, eval) and every collective on the engine's device:
real DeepSpeed ZeRO 1-3 on 2 gloo CPU processes.

The GPU rule cannot run here, so it is faked, and named so: FakeAccelerator stands in for a GPU
(tensors made on, or moved to, its device hold their data on the CPU but report another device,
and mix with host tensors only as CUDA ones do), and fake_nccl_rule stands in for NCCL's "no CPU
tensors": a collective that vitforge itself calls must get tensors on that device. The trainer is
given the fake device as its engine's device; a tensor it makes without naming that device stays a
host tensor and fails the rule, as it would fail on the first GPU run. This file is also the
worker that torchrun starts (`python tests/integration/test_scale_weights.py MODE ...`).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from common.cli import EXTENSIONS, REPO
from vitforge.core import free_port

FAKE_DEVICE = torch.device("meta")  # a device this torch knows that is not the CPU
CPU = torch.device("cpu")


# -- the fakes (what cannot run here: a GPU and NCCL) ----------------------------------------
def _on_fake(func, args, kwargs):
    """Run an op for FakeAccelerator: on the wrapped host tensors, refusing to mix a fake-device
    tensor with a host one of more than 0 dimensions, as CUDA refuses."""
    from torch.utils._pytree import tree_map

    kwargs = dict(kwargs or {})
    everything = (*args, *kwargs.values())
    if func not in (torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default) and \
            any(isinstance(a, torch.Tensor) and not isinstance(a, OnFakeDevice) and a.dim() for a in everything):
        raise RuntimeError(f"{func}: expected all tensors on the same device, got {FAKE_DEVICE} and cpu")
    unwrap = lambda a: a.inner if isinstance(a, OnFakeDevice) else a  # noqa: E731
    out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
    if func is torch.ops.aten._to_copy.default and kwargs.get("device") == CPU:
        return out
    if func._schema.is_mutable:
        return args[0] if isinstance(args[0], OnFakeDevice) else out
    return tree_map(lambda o: OnFakeDevice(o) if isinstance(o, torch.Tensor) else o, out)


class OnFakeDevice(torch.Tensor):
    """A tensor on the fake accelerator: its data is `inner`, on the host."""
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=FAKE_DEVICE,
                                                   strides=inner.stride())

    def __init__(self, inner: torch.Tensor):
        self.inner = inner

    def tolist(self):
        return self.inner.tolist()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _on_fake(func, args, kwargs)


def _fake_accelerator_mode():
    """Factories and .to() that name FAKE_DEVICE give OnFakeDevice tensors."""
    from torch.overrides import TorchFunctionMode
    from torch.utils._device import _device_constructors

    class FakeAccelerator(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if func in _device_constructors() and kwargs.get("device") is not None and \
                    torch.device(kwargs["device"]) == FAKE_DEVICE:
                return OnFakeDevice(func(*args, **{**kwargs, "device": CPU}))
            if func is torch.Tensor.to and FAKE_DEVICE in (kwargs.get("device"), *args[1:]):
                source = args[0].inner if isinstance(args[0], OnFakeDevice) else args[0]
                return OnFakeDevice(source.to(dtype=kwargs.get("dtype"), copy=True))
            if func is torch.Tensor.__setitem__ and isinstance(args[0], OnFakeDevice) and \
                    not isinstance(args[2], torch.Tensor):  # a Python number: a host scalar, as CUDA takes it
                args = (args[0], args[1], torch.tensor(args[2], dtype=args[0].dtype))
            return func(*args, **kwargs)

    return FakeAccelerator()


@contextlib.contextmanager
def fake_nccl_rule(checked: list[str]):
    """Stands in for NCCL: a tensor collective called from vitforge's code must get tensors on the
    fake device (appended to `checked`); DeepSpeed's own collectives, on the CPU engine, pass."""
    import torch.distributed as dist

    names = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_gather_into_tensor",
             "reduce_scatter_tensor", "reduce", "gather")
    originals = {name: getattr(dist, name) for name in names}

    def guarded(name):
        def collective(*args, **kwargs):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            tensors = [t for a in (*args, *kwargs.values()) for t in (a if isinstance(a, list) else [a])
                       if isinstance(t, torch.Tensor)]
            if caller.startswith("vitforge."):
                host = [t for t in tensors if not isinstance(t, OnFakeDevice)]
                if host:
                    raise RuntimeError(f"fake NCCL: dist.{name} from {caller} got a tensor on {host[0].device}, "
                                       f"not on the engine's device {FAKE_DEVICE} (NCCL has no CPU tensors)")
                checked.append(f"{caller}.{name}")
            unwrap = lambda a: [unwrap(x) for x in a] if isinstance(a, list) else \
                (a.inner if isinstance(a, OnFakeDevice) else a)  # noqa: E731
            return originals[name](*[unwrap(a) for a in args], **{k: unwrap(v) for k, v in kwargs.items()})
        return collective

    for name in names:
        setattr(dist, name, guarded(name))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


# -- the workers (one per rank, under torchrun) --------------------------------------------
def _dump(path: str, value) -> None:
    torch.save(value, path) if path.endswith(".pt") else Path(path).write_text(json.dumps(value))


def worker_collectives(data: str, out: str) -> None:
    """A real 2-rank run (ZeRO-2, 3 steps, a log line per step, one evaluation) whose Trainer
    believes it is on the fake accelerator; then a model moved with load_broadcast on that device."""
    import torch.distributed as dist

    from vitforge.trainer import Trainer, build_model, load_config
    from vitforge.trainer.distributed import detect_env, init_distributed, shutdown
    from vitforge.trainer.export import load_broadcast
    from vitforge.trainer.preemption import StopRequest
    from vitforge.trainer.build import build_trainer as _build

    cfg = load_config("tiny_cpu", [f"data.train={data}/train", f"data.val={data}/val", "data.backend=torch",
                                   "data.workers=0", f"checkpoint.dir={out}", "checkpoint.run=fake",
                                   "checkpoint.save=false", "train.steps=3", "train.log_every=1",
                                   "train.eval_every=3", "train.straggler_every=1"])
    env = detect_env()
    device = init_distributed(env)
    built, *_ = _build(cfg, env, device, StopRequest(None))
    checked: list[str] = []
    with _fake_accelerator_mode(), fake_nccl_rule(checked):
        trainer = Trainer(cfg, env, FAKE_DEVICE, built.engine, built.train_loader, built.val_loader, built.objective,
                          built.checkpointer, built.metrics, built.ema, built.manifest_extra, built.stop)
        result = trainer.train()
        fresh = build_model(cfg.model.name, 10, cfg.model.image_size)
        own = built.engine.module.state_dict()  # whole on every rank at ZeRO-2
        load_broadcast(fresh, own if env.rank == 0 else None, "rank 0's model", FAKE_DEVICE)
    same = all(torch.equal(v, own[k]) for k, v in fresh.state_dict().items())
    if dist.get_rank() == 1:
        _dump(os.path.join(out, "collectives.json"), {"result": result, "checked": checked, "broadcast_same": same})
    shutdown()


def worker_weights(run_url: str, out: str, stage: int, precision: str) -> None:
    """Fine-tune init (into 48 px and 7 classes: position embeddings resampled, head replaced) and
    eval's weight load, as rank 1 ends up with them, with the optimizer's fp32 master; errors reach
    both ranks."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_fp32_param

    from vitforge.core import CheckpointError
    from vitforge.trainer import build_model, load_config
    from vitforge.trainer.distributed import detect_env, init_distributed, shutdown
    from vitforge.trainer.engine import build_engine
    from vitforge.trainer.export import consolidate_on_rank0, load_broadcast
    from vitforge.trainer.build import init_from as _init_from

    env = detect_env()
    device = init_distributed(env)
    cfg = load_config("tiny_cpu", [f"train.zero_stage={stage}", f"train.precision={precision}", "model.image_size=48",
                                   "optimizer.lr=1e-6", "optimizer.warmup_steps=0"])
    torch.manual_seed(0)

    def make_model():
        return build_model("vit_tiny_cpu", 7, 48)

    engine = build_engine(cfg, make_model, env.world_size, device)

    def whole() -> dict:
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), enabled=stage == 3):
            return {k: v.detach().clone() for k, v in engine.module.named_parameters()}

    def master() -> dict:  # a collective: every rank calls it
        return {k: safe_get_full_fp32_param(v).clone() for k, v in engine.module.named_parameters()}

    changed = _init_from(engine, run_url, device, make_model)
    tuned, tuned_master = whole(), master()
    # One step at a learning rate of 1e-6: the weights stay where fine-tuning put them (the
    # optimizer's fp32 master copy was set), not where the random initialisation was.
    dtype = next(engine.module.parameters()).dtype
    engine(torch.randn(cfg.train.micro_batch, 3, 48, 48, dtype=dtype)).sum().backward()
    engine.step()
    drift = max((v - tuned_master[k]).abs().max().item() for k, v in master().items())
    with tempfile.TemporaryDirectory() as scratch:
        state, described = consolidate_on_rank0(run_url, scratch)
        evaluated = build_model("vit_tiny_cpu", described.manifest["num_classes"], 32)
        load_broadcast(evaluated, state, described.url, device)
    try:
        _init_from(engine, run_url + "-missing", device, make_model)
        error = None
    except CheckpointError as e:
        error = str(e)
    if dist.get_rank() == 1:
        _dump(os.path.join(out, "tuned.pt"), tuned)
        _dump(os.path.join(out, "master.pt"), tuned_master)
        _dump(os.path.join(out, "evaluated.pt"), evaluated.state_dict())
        _dump(os.path.join(out, "weights.json"), {"changed": changed, "drift": drift, "error": error,
                                                  "rank0_state": state is not None})
    shutdown()


def _torchrun(*args: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), __file__, *args]
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300,
                            env={**os.environ, **EXTENSIONS})
    assert result.returncode == 0, result.stderr[-4000:]


# -- the tests -----------------------------------------------------------------------------------
@pytest.mark.slow
def test_every_collective_takes_tensors_on_the_engines_device(data, tmp_path):
    _torchrun("collectives", str(data), str(tmp_path))
    report = json.loads((tmp_path / "collectives.json").read_text())
    checked = report["checked"]
    # every step's flags, every log line's loss and wait, the evaluation, and the weights' tensors
    assert checked.count("vitforge.trainer.train.all_reduce") == 3 + 3 * 2 + 1, checked
    assert checked.count("vitforge.trainer.distributed.broadcast") > 10, checked
    assert checked.count("vitforge.trainer.stragglers.gather") == 2, checked  # the exchanges at steps 2 and 3
    assert report["result"]["eval_samples"] == 100 and report["result"]["loss"] > 0
    assert report["broadcast_same"]


@pytest.mark.parametrize("stage,precision", [(1, "fp32"), (2, "bf16"), (3, "bf16")])
def test_fine_tune_init_eval_and_export_move_the_same_weights(zero_run, tmp_path, stage, precision):
    """Bit for bit what one process consolidating the checkpoint gives (today's path, where every
    rank consolidated): fine-tune init after adapt_state_dict, eval's model, the export. Under bf16
    the optimizer's fp32 master holds the checkpoint's fp32 values, not the module's bf16 copy."""
    from safetensors.torch import load_file

    from vitforge.trainer import adapt_state_dict, build_model
    from vitforge.trainer.export import consolidate, export

    run_url = str(zero_run(stage))
    _torchrun("weights", run_url, str(tmp_path), str(stage), precision)
    report = json.loads((tmp_path / "weights.json").read_text())
    reference = consolidate(run_url, str(tmp_path / "scratch")).state
    adapted, changed = adapt_state_dict(reference, build_model("vit_tiny_cpu", 7, 48))
    assert report["changed"] == changed and "pos_embed 4x4 -> 6x6" in changed
    assert not report["rank0_state"]  # rank 1 held no consolidated state
    tuned = torch.load(tmp_path / "tuned.pt")
    assert tuned.keys() == adapted.keys() and all(torch.equal(tuned[k], adapted[k].to(tuned[k].dtype)) for k in tuned)
    master = torch.load(tmp_path / "master.pt")
    assert master.keys() == adapted.keys() and all(torch.equal(master[k], adapted[k]) for k in master)
    assert precision == "fp32" or not all(torch.equal(tuned[k].float(), adapted[k]) for k in tuned)  # bf16 rounded
    assert report["drift"] < 1e-4, report["drift"]
    assert "no complete checkpoint" in report["error"]  # rank 0's error, raised on rank 1 too
    evaluated = torch.load(tmp_path / "evaluated.pt")
    assert evaluated.keys() == reference.keys() and all(torch.equal(evaluated[k], reference[k]) for k in reference)
    export(run_url, str(tmp_path / "model.safetensors"), str(tmp_path / "scratch2"))
    exported = load_file(str(tmp_path / "model.safetensors"))
    assert exported.keys() == reference.keys() and all(torch.equal(exported[k], reference[k]) for k in reference)


if __name__ == "__main__":
    mode, *rest = sys.argv[1:]
    if mode == "collectives":
        worker_collectives(*rest)
    else:
        worker_weights(rest[0], rest[1], int(rest[2]), rest[3])
