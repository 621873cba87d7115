"""Consolidated weights from a checkpoint of any ZeRO stage and world size, for `vitforge eval`,
`vitforge ckpt export` and fine-tuning (`checkpoint.init_from`).

One consolidation per job: in a multi-rank job rank 0 fetches and consolidates
(`consolidate_on_rank0`) and the weights reach the other ranks tensor by tensor
(`load_broadcast`), never as one pickled object. Export runs in one process.

Every file is fetched and its sha256 checked before DeepSpeed's zero-to-fp32 reads it. A run URL
means its newest usable checkpoint, chosen as `train` chooses where to resume. Loading never
re-initialises a layer: a parameter whose shape differs is an error naming it. An export is the
part of the model its objective names (objective.Objective.exported) under timm's key names.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
from dataclasses import dataclass, replace

import torch

from vitforge.core import CheckpointError, UsageError, atomic_path, atomic_write
from vitforge.pipeline import IMAGENET_MEAN, IMAGENET_STD

from .checkpoint_files import SHARED_STATE, needed_files
from .distributed import agree, agree_keeping, broadcast_state
from .model import build_model
from .model_names import check_model_name
from .objective import OBJECTIVES, PreLogitsHead, get_objective
from .objectives import saved_objective
from .run_store import RunStore, split_checkpoint_url

log = logging.getLogger("vitforge.export")


@dataclass
class Consolidated:
    state: dict  # timm key names, fp32
    manifest: dict
    url: str  # the checkpoint's URL
    weights: str  # "ema" or "model"


def consolidate(url: str, scratch: str, prefer_ema: bool = True) -> Consolidated:
    """A step URL's checkpoint, or a run URL's newest usable one (a damaged one is passed over with
    a warning, as `train` does)."""
    run_url, tag = split_checkpoint_url(url)
    run = RunStore(run_url)
    candidates = run.candidates("auto") if tag is None else [tag]
    if not candidates:
        raise CheckpointError(f"{run_url}: no complete checkpoint (a step folder with a manifest.json)")
    return run.first_usable(candidates, lambda t: _consolidate(run, t, scratch, prefer_ema), explicit=tag is not None)


def _consolidate(run: RunStore, tag: str, scratch: str, prefer_ema: bool) -> Consolidated:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    manifest = run.manifest(tag)
    folder = run.fetch(tag, needed_files(sorted(manifest["files"]), set(), everything=True), manifest, scratch)
    try:
        # zero-to-fp32 prints its progress to stdout, which is a command's result (JSON) here.
        with contextlib.redirect_stdout(io.StringIO()) as said:
            state = get_fp32_state_dict_from_zero_checkpoint(folder, tag=tag)
        log.debug("zero-to-fp32: %s", said.getvalue().strip())
    except Exception as e:  # DeepSpeed raises assorted types for files it cannot interpret
        raise CheckpointError(f"{run.object_url(tag)}: zero-to-fp32 could not consolidate it: {e}") from None
    state = {k.removeprefix("module."): v.detach() for k, v in state.items()}
    weights = "model"
    shared = os.path.join(folder, tag, SHARED_STATE)
    if prefer_ema and os.path.exists(shared):
        ema = torch.load(shared, weights_only=False).get("ema")
        if ema:
            state.update({k: v.detach().float() for k, v in ema.items()})
            weights = "ema"
    return Consolidated(state, manifest, run.object_url(tag), weights)


def consolidate_on_rank0(url: str, scratch: str, prefer_ema: bool = True) -> tuple[dict | None, Consolidated]:
    """`consolidate` once per job: rank 0 fetches and consolidates and keeps the weights (returned
    first; None on the other ranks); every rank gets the rest (manifest, URL, which weights) with an
    empty state, or raises rank 0's error."""
    kept, described = agree_keeping(
        lambda: consolidate(url, scratch, prefer_ema), lambda weights: replace(weights, state={})
    )
    return (kept.state if kept is not None else None), described


def check_fits(target: dict[str, torch.Tensor], state: dict, where: str) -> None:
    """The checkpoint `state` has exactly `target`'s names and shapes, or an error naming what differs."""
    missing = sorted(set(target) - set(state))
    unexpected = sorted(set(state) - set(target))
    if missing or unexpected:
        raise CheckpointError(f"{where}: does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, value in target.items():
        if tuple(state[name].shape) != tuple(value.shape):
            raise CheckpointError(
                f"{where}: parameter {name} has shape {tuple(state[name].shape)} in the "
                f"checkpoint but {tuple(value.shape)} in the model (model config differs?)"
            )


def load_exact(model: torch.nn.Module, state: dict, where: str, assign: bool = False) -> None:
    """load_state_dict(strict=True), with any missing, unexpected or mis-shaped parameter named.
    `assign`: the model takes the state's tensors themselves (one built on the meta device: no
    second copy of the weights)."""
    check_fits(model.state_dict(), state, where)
    model.load_state_dict(state, strict=True, assign=assign)


def load_broadcast(model: torch.nn.Module, state: dict | None, where: str, device: torch.device) -> None:
    """Rank 0's `state` (None on the other ranks) into every rank's `model`, which holds its own
    full weights, tensor by tensor on `device`: the values load_exact gives (the same copy_), with
    a rank's host peak one tensor beyond the model. Checked on rank 0; a misfit raises on every rank."""
    target = model.state_dict()
    agree(lambda: check_fits(target, state, where))
    with torch.no_grad():
        broadcast_state(state, device, lambda name, tensor: target[name].copy_(tensor))


def trained_model(weights: Consolidated) -> torch.nn.Module:
    """The model the checkpoint was trained as, holding its weights (built on the meta device)."""
    objective = saved_objective(weights.manifest)
    saved = weights.manifest.get("config", {}).get("model", {})
    check_model_name(saved["name"])
    with torch.device("meta"):
        model = build_model(
            saved["name"],
            weights.manifest.get("num_classes") or 0,
            saved["image_size"],
            pre_logits=saved.get("pre_logits", False),
            objective=objective,
        )
    load_exact(model, weights.state, weights.url, assign=True)
    return model


def model_description(manifest: dict, exported: torch.nn.Module) -> dict:
    """What a user needs beside the weights: the timm name, the input, the classifier's size (0:
    the encoder alone) and class map, and the objective it was trained for."""
    model = manifest.get("config", {}).get("model", {})
    return {
        "model": model.get("name"),
        "image_size": model.get("image_size"),
        "pre_logits": isinstance(getattr(exported, "head", None), PreLogitsHead),
        "num_classes": exported.num_classes,
        "classes": manifest.get("classes") if exported.num_classes else None,
        "objective": saved_objective(manifest),
        "mean": list(IMAGENET_MEAN),
        "std": list(IMAGENET_STD),
        "step": manifest.get("step"),
    }


def export(url: str, out: str, scratch: str, include_head: bool = False) -> dict:
    """Write OUT (.safetensors: the timm model the objective exports, strict-loadable), with
    `include_head` OUT.head.safetensors (the objective's pre-training head), and OUT's .json
    description last; return the description."""
    if not out.endswith(".safetensors"):
        raise UsageError(f"--out {out}: the file name must end in .safetensors")
    weights = consolidate(url, scratch)
    objective = saved_objective(weights.manifest)
    if objective not in OBJECTIVES:
        raise UsageError(
            f"{weights.url}: objective {objective!r} cannot be exported (this vitforge exports {', '.join(OBJECTIVES)})"
        )
    model = trained_model(weights)
    exported = get_objective(objective).exported(model)
    timm_state = exported.state_dict(keep_vars=True)
    inside = {id(v) for v in timm_state.values()}
    head = {k: v for k, v in model.state_dict(keep_vars=True).items() if id(v) not in inside}
    if include_head and not head:
        raise UsageError(
            f"--include-head: a {objective} export has no separate pre-training head (its whole model goes to {out})"
        )
    description = {**model_description(weights.manifest, exported), "weights": weights.weights, "source": weights.url}
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    _save(timm_state, out, {"model": str(description["model"]), "objective": objective})
    if include_head:
        head_out = out.removesuffix(".safetensors") + ".head.safetensors"
        _save(head, head_out, {"objective": objective})
        description["head"] = os.path.basename(head_out)
    elif head:
        log.info("left out %s's pre-training head (%s): --include-head keeps it", objective, ", ".join(sorted(head)))
    atomic_write(out.removesuffix(".safetensors") + ".json", json.dumps(description, indent=1).encode())
    return description


def _save(state: dict, out: str, metadata: dict) -> None:
    from safetensors.torch import save_file

    with atomic_path(out) as tmp:
        save_file({k: v.detach().contiguous() for k, v in state.items()}, tmp, metadata={"format": "pt", **metadata})
