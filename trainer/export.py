"""Consolidated weights from a checkpoint of any ZeRO stage and world size, for `vitforge eval`,
`vitforge ckpt export` and fine-tuning (`checkpoint.init_from`).

Every file is fetched and its sha256 checked before DeepSpeed's zero-to-fp32 reads it. Loading
never re-initialises a layer: a parameter whose shape differs is an error naming it.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
from dataclasses import dataclass

import torch

from vitforge.core import CheckpointError, UsageError, atomic_path, atomic_write
from vitforge.pipeline import IMAGENET_MEAN, IMAGENET_STD

from .checkpoint import needed_files
from .run_store import RunStore, split_checkpoint_url

log = logging.getLogger("vitforge.export")


@dataclass
class Consolidated:
    state: dict  # timm key names, fp32
    manifest: dict
    url: str  # the checkpoint's URL
    weights: str  # "ema" or "model"


def resolve(url: str) -> tuple[RunStore, str]:
    """A run URL (its newest complete checkpoint) or a step URL -> (run store, tag)."""
    run_url, tag = split_checkpoint_url(url)
    run = RunStore(run_url)
    if tag is None:
        tags = run.complete_tags()
        if not tags:
            raise CheckpointError(f"{run_url}: no complete checkpoint (a step folder with a manifest.json)")
        tag = tags[-1]
    return run, tag


def consolidate(url: str, scratch: str, prefer_ema: bool = True) -> Consolidated:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    run, tag = resolve(url)
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
    shared = os.path.join(folder, tag, "shared_state.pt")
    if prefer_ema and os.path.exists(shared):
        ema = torch.load(shared, weights_only=False).get("ema")
        if ema:
            state.update({k: v.detach().float() for k, v in ema.items()})
            weights = "ema"
    return Consolidated(state, manifest, run.object_url(tag), weights)


def load_exact(model: torch.nn.Module, state: dict, where: str) -> None:
    """load_state_dict(strict=True), with any missing, unexpected or mis-shaped parameter named."""
    target = model.state_dict()
    missing = sorted(set(target) - set(state))
    unexpected = sorted(set(state) - set(target))
    if missing or unexpected:
        raise CheckpointError(f"{where}: does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, value in target.items():
        if tuple(state[name].shape) != tuple(value.shape):
            raise CheckpointError(f"{where}: parameter {name} has shape {tuple(state[name].shape)} in the "
                                  f"checkpoint but {tuple(value.shape)} in the model (model config differs?)")
    model.load_state_dict(state, strict=True)


def model_description(manifest: dict) -> dict:
    """What a user needs beside the weights: the timm name, the input and the class map."""
    model = manifest.get("config", {}).get("model", {})
    return {"model": model.get("name"), "image_size": model.get("image_size"),
            "pre_logits": model.get("pre_logits", False),
            "num_classes": manifest.get("num_classes"), "classes": manifest.get("classes"),
            "mean": list(IMAGENET_MEAN), "std": list(IMAGENET_STD), "step": manifest.get("step")}


def export(url: str, out: str, scratch: str) -> dict:
    """Write OUT (.safetensors) and OUT's .json description; return the description."""
    from safetensors.torch import save_file

    if not out.endswith(".safetensors"):
        raise UsageError(f"--out {out}: the file name must end in .safetensors")
    weights = consolidate(url, scratch)
    description = {**model_description(weights.manifest), "weights": weights.weights, "source": weights.url}
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with atomic_path(out) as tmp:
        save_file({k: v.contiguous() for k, v in weights.state.items()}, tmp,
                  metadata={"format": "pt", "model": str(description["model"])})
    atomic_write(out.removesuffix(".safetensors") + ".json", json.dumps(description, indent=1).encode())
    return description
