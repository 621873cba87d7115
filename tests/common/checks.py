"""What the tests read back from a run or a dataset, and the planted secret they look for."""

from __future__ import annotations

import json
import tarfile
import tempfile
import uuid
from pathlib import Path

import torch

SECRET = "sEcReT-" + uuid.uuid4().hex  # must never appear in any output


def tree_bytes(root: Path) -> dict[str, bytes]:
    """Every file under root (relative path -> bytes): the whole output, compared byte for byte."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def without_plan(tree: dict[str, bytes]) -> dict[str, bytes]:
    """An output tree (tree_bytes) but the plans' slices and headers (of every version), which are cut
    for the job's part count."""
    return {name: data for name, data in tree.items() if not (name.startswith("_work/") and "plan/" in name)}


def dataset_samples(out: Path) -> list[dict]:
    """Every sample of a sharded dataset, read with tarfile: key, info (json), cls (None when it has
    none), ext, image bytes, txt (a caption's bytes, None without one)."""
    manifest = json.loads((out / "dataset.json").read_text())
    samples = []
    for shard in manifest["shards"]:
        with tarfile.open(out / shard["name"]) as tar:
            members = {m.name: tar.extractfile(m).read() for m in tar if m.isfile()}
        by_key: dict[str, dict] = {}
        for name, data in members.items():
            key, ext = name.split(".", 1)
            by_key.setdefault(key, {"key": key})[ext] = data
        for key, sample in by_key.items():
            ext = next(e for e in ("jpg", "png", "webp") if e in sample)
            cls = int(sample["cls"]) if "cls" in sample else None
            samples.append({"key": key, "info": json.loads(sample["json"]), "cls": cls,
                            "ext": ext, "image_bytes": sample[ext], "txt": sample.get("txt")})
    return samples


def losses(folder) -> dict[int, float]:
    lines = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    steps = [m["step"] for m in lines if "loss" in m]
    assert len(steps) == len(set(steps)), f"duplicated steps in metrics.jsonl: {steps}"
    return {m["step"]: m["loss"] for m in lines if "loss" in m}


def weights(url: str) -> dict:
    from vitforge.trainer.export import consolidate

    with tempfile.TemporaryDirectory() as scratch:
        return consolidate(url, scratch, prefer_ema=False).state


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
