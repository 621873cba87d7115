"""`vitforge inspect CHECKPOINT [--images SHARDS] --out DIR`: the ViT paper's figures for a checkpoint.

Writes PNGs and numbers.json to DIR: position-embedding similarity (Figure 7 centre), the principal
components of the RGB embedding filters (Figure 7 left) and, with --images, the mean attention
distance per head and layer (Figure 7 right) and attention rollout maps (Figure 6) over those images.
CHECKPOINT: a run (its newest complete checkpoint) or DIR/RUN/step_N, local or s3://; EMA weights
are used when the run kept them.
"""

from __future__ import annotations

import argparse
import json
import tempfile

import numpy as np

from vitforge.core import setup_logging
from vitforge.core.cli_args import positive_int
from vitforge.pipeline import IMAGENET_MEAN, IMAGENET_STD, LoaderSpec, build_loader

from .config import ConfigError
from .export import consolidate, trained_model
from .figures import compute, write_figures
from .model_names import is_vit
from .objective import get_objective
from .objectives import saved_objective


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="vitforge inspect", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("checkpoint", help="DIR/RUN or DIR/RUN/step_N, local or s3://")
    p.add_argument("--images", help="shards (folder or s3:// prefix with dataset.json) for the attention figures")
    p.add_argument(
        "--count", type=positive_int, default=8, help="images to average attention over and show (default 8)"
    )
    p.add_argument("--out", required=True, help="folder for the PNGs and numbers.json")
    args = p.parse_args(argv)
    setup_logging()
    with tempfile.TemporaryDirectory(prefix="vitforge-inspect-") as scratch:
        weights = consolidate(args.checkpoint, scratch)
    saved = weights.manifest.get("config", {}).get("model", {})
    if not is_vit(saved.get("name", "")):
        raise ConfigError(
            f"{weights.url}: {saved.get('name')} is not a ViT: the paper's figures read position "
            "embeddings, patch-embedding filters and attention, which a ResNet does not have"
        )
    # the figures are those of what an export holds: the ViT (a masked-patch model's encoder)
    model = get_objective(saved_objective(weights.manifest)).exported(trained_model(weights))

    images = None
    if args.images:
        spec = LoaderSpec(
            args.images, batch_size=args.count, image_size=saved["image_size"], train=False, backend="torch", workers=0
        )
        images = next(iter(build_loader(spec)))["image"].float()
    numbers = compute(model, images)
    written = write_figures(numbers, images, args.out, IMAGENET_MEAN, IMAGENET_STD)
    summary = {"checkpoint": weights.url, "weights": weights.weights, "files": written, "grid": numbers["grid"]}
    if "mean_attention_distance" in numbers:
        summary["mean_attention_distance_per_layer"] = np.round(
            numbers["mean_attention_distance"].mean(axis=1), 3
        ).tolist()
    print(json.dumps(summary))
    return 0
