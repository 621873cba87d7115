"""The probes of eval.probes on a model: frozen pre-logits features of every image of each probe
dataset, computed by all ranks at once, gathered to rank 0 in bounded pieces, probed there in
closed form (few-shot, all-data linear, kNN: trainer/probe.py), the results shared with every rank.

Each rank computes its share of a split with the eval transform (the loader's resize and centre
crop, no augmentation) and the objective's features (the encoder's pre-logits for every objective).
Rows are then put in one order that depends only on the samples (a hash of each sample's key), not
on the world size or the loader's order, so a seed draws the same shots at every evaluation of a
run and at any world size.

Per rank: its share of a split's features while they are computed (rows / world x width x 4
bytes). Rank 0 also holds, for the probe being computed, both splits' real rows once (rows x width
x 4 bytes: 256 MB for 50,000 images at ViT-H/14's width of 1,280), 24 bytes per row of every
rank's labels and keys, and one piece of the gather, whose rows are sized so that it never holds
more than GATHER_BYTES however many ranks send. The probes then run on rank 0's device while the
others wait in one collective: they must finish within train.collective_timeout_s (seconds for
few-shot; kNN and the all-data probe grow with the train split: rows x test rows x width FLOPs).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
import torch.distributed as dist

from vitforge.pipeline import IGNORE_LABEL, Loader

from .config import ConfigError
from .distributed import agree
from .objective import Objective
from .output_config import EvalConfig
from .probe import ProbeError, choose_shots, knn_top1, linear_probe

GATHER_BYTES = 64 << 20
META = 3  # label, key hash, real: int64 columns beside each row's features


@dataclass
class ProbeSet:
    """One probe dataset's two eval loaders and its classes."""

    name: str
    train: Loader
    test: Loader
    num_classes: int
    classes: list[str] | None


def build_probes(cfg: EvalConfig, make_loader: Callable[[str], Loader]) -> list[ProbeSet]:
    """Eval loaders for every probe dataset; each split must be labelled, with the same classes."""
    probes = []
    for name, data in cfg.probes.items():
        loaders = {}
        for split in ("train", "test"):
            where = f"eval.probes.{name}.{split}"
            try:
                loaders[split] = make_loader(getattr(data, split))
            except (OSError, ValueError) as e:  # a missing folder, an unreadable dataset.json
                raise ConfigError(f"{where} ({getattr(data, split)}): {e}") from e
            index = loaders[split].index
            if index is None or not index.labelled or not index.num_classes:
                raise ConfigError(
                    f"{where} ({getattr(data, split)}): a probe needs labelled shards with a "
                    "dataset.json (from `vitforge shard`) that gives the class count"
                )
        train, test = loaders["train"].index, loaders["test"].index
        if train.num_classes != test.num_classes:
            raise ConfigError(
                f"eval.probes.{name}: the train split has {train.num_classes} classes, the test split "
                f"{test.num_classes}"
            )
        differ = [i for i, (a, b) in enumerate(zip(train.classes or [], test.classes or [])) if a != b]
        if differ:
            first = differ[0]
            raise ConfigError(
                f"eval.probes.{name}: class {first} is {train.classes[first]!r} in the train split and "
                f"{test.classes[first]!r} in the test split"
            )
        if cfg.fewshot and not cfg.allow_fewer and train.class_counts:  # known now: refuse before training
            short = [
                (train.classes[c] if train.classes else c, n)
                for c, n in enumerate(train.class_counts)
                if n < max(cfg.fewshot)
            ]
            if short:
                raise ConfigError(
                    f"eval.probes.{name}.train: {len(short)} class(es) have fewer than "
                    f"{max(cfg.fewshot)} images for eval.fewshot: "
                    f"{', '.join(f'{c} ({n})' for c, n in short[:10])} (or set eval.allow_fewer)"
                )
        probes.append(ProbeSet(name, loaders["train"], loaders["test"], train.num_classes, train.classes))
    return probes


def key_hash(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little", signed=True)


@torch.no_grad()
def split_features(
    model: torch.nn.Module, loader, objective: Objective, params: dict | None, keys: dict[int, str] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (rows, width) float32 features and (rows, META) int64 label, key hash and
    realness (padding and replaced samples are not real). `keys`, when given, gets each row's key
    by its hash (rows / world entries of some 40 bytes), to name the shots."""
    features, meta = [], []
    for batch in loader:
        if keys is not None:
            keys.update((key_hash(k), k) for k in batch["key"])
        rows = objective.features(model, batch["image"], params).float()
        labels = batch["label"].cpu().long()
        real = batch["real"].cpu() & (labels != IGNORE_LABEL)
        hashes = torch.tensor([key_hash(k) for k in batch["key"]], dtype=torch.int64)
        features.append(rows)
        meta.append(torch.stack([labels, hashes, real.long()], 1).to(rows.device))
    if not features:  # every rank has the same batches, so every rank is here
        raise ProbeError(f"{loader.spec.dataset}: no samples to probe")
    return torch.cat(features), torch.cat(meta)


def gather_rows(features: torch.Tensor, meta: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Rank 0: every rank's real rows, ordered by key hash, as (features, labels, key hashes); None
    elsewhere. Every rank has the same number of rows (the eval loader pads its last batches). The
    small columns come first, so that rank 0 knows where each row goes; each piece of features is
    then written straight to its place: rank 0 holds the split's real rows once, plus one piece."""
    world, rank = dist.get_world_size(), dist.get_rank()
    count, width = features.shape
    meta_pieces = list(_pieces(meta, max(1, GATHER_BYTES // (world * 8 * META))))
    if rank == 0:
        meta_all = np.concatenate(meta_pieces, 1).reshape(-1, META)  # rank-major: rank r's rows, then r+1's
        real = np.flatnonzero(meta_all[:, 2] == 1)
        hashes = meta_all[real, 1]
        order = np.argsort(hashes, kind="stable")
        if len(order) > 1 and (np.diff(hashes[order]) == 0).any():
            raise ProbeError(
                "two samples share a key (same shard file name and sample name): the probe cannot "
                "order its rows the same way at every world size; shard them with distinct names"
            )
        place = np.full(len(meta_all), -1)
        place[real[order]] = np.arange(len(order))
        out = np.empty((len(order), width), np.float32)
    piece = max(1, GATHER_BYTES // (world * 4 * width))
    for at, sent in zip(range(0, count, piece), _pieces(features, piece)):
        if rank == 0:
            rows = sent.shape[1]
            rank_rows = np.arange(world)[:, None] * count + at + np.arange(rows)[None, :]
            where = place[rank_rows]
            out[where[where >= 0]] = sent[where >= 0]
    if rank != 0:
        return None
    return out, meta_all[real[order], 0], meta_all[real[order], 1]


def _pieces(tensor: torch.Tensor, rows: int):
    """dist.gather of `rows` rows at a time from every rank: on rank 0, each piece as a (world,
    rows, ...) numpy array; on the others, None per piece (every rank iterates alike)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    for start in range(0, len(tensor), rows):
        part = tensor[start : start + rows].contiguous()
        into = [torch.empty_like(part) for _ in range(world)] if rank == 0 else None
        dist.gather(part, into, dst=0)
        yield np.stack([t.cpu().numpy() for t in into]) if rank == 0 else None


def probe_metrics(
    probe: ProbeSet, train: tuple[np.ndarray, ...], test: tuple[np.ndarray, ...], cfg: EvalConfig, device: torch.device
) -> tuple[dict, dict[int, np.ndarray]]:
    """Every configured evaluator on one probe dataset's gathered features (rank 0), on `device`
    (the GPU's, when there is one), and each k's shots (their key hashes). Beside each few-shot
    top-1: the regulariser chosen, and a fingerprint of the shots' keys, so that a run's metrics
    show the same shots at every evaluation."""
    train_x, train_y = (torch.from_numpy(a).to(device) for a in train[:2])
    test_x, test_y = (torch.from_numpy(a).to(device) for a in test[:2])
    out: dict[str, float | str] = {}
    shot_keys: dict[int, np.ndarray] = {}
    for shots in cfg.fewshot:
        chosen = choose_shots(train[1], train[2], shots, cfg.seed, probe.num_classes, cfg.allow_fewer, probe.classes)
        rows = torch.from_numpy(chosen).to(device)
        result = linear_probe(train_x[rows], train_y[rows], test_x, test_y, probe.num_classes)
        out[f"eval_fewshot_{probe.name}_{shots}shot"] = result.top1
        out[f"eval_fewshot_{probe.name}_{shots}shot_l2"] = result.l2
        shot_keys[shots] = np.sort(train[2][chosen])
        out[f"eval_fewshot_{probe.name}_{shots}shot_images"] = shots_fingerprint(shot_keys[shots])
    if cfg.linear:
        out[f"eval_linear_{probe.name}"] = linear_probe(train_x, train_y, test_x, test_y, probe.num_classes).top1
    if cfg.knn:
        out[f"eval_knn_{probe.name}"] = knn_top1(train_x, train_y, test_x, test_y, probe.num_classes, cfg.knn)
    return out, shot_keys


def shots_fingerprint(hashes: np.ndarray) -> str:
    """16 hex digits naming a set of samples (their sorted key hashes)."""
    return hashlib.sha256(np.sort(hashes).astype(np.int64).tobytes()).hexdigest()[:16]


def name_shots(shot_keys: dict[int, np.ndarray], keys: dict[int, str]) -> dict[str, list[str]] | None:
    """Rank 0: each k's shots by sample key ("SHARD.tar:NAME"), from the ranks that read them; None elsewhere."""
    wanted = {int(h) for hashes in shot_keys.values() for h in hashes}
    mine = {h: keys[h] for h in wanted & keys.keys()}
    found: list | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, found, dst=0)
    if found is None:
        return None
    named = {h: k for part in found for h, k in part.items()}
    return {f"{shots}shot": sorted(named[int(h)] for h in hashes) for shots, hashes in shot_keys.items()}


def run_probes(
    model: torch.nn.Module,
    probes: list[ProbeSet],
    objective: Objective,
    cfg: EvalConfig,
    device: torch.device,
    params: dict | None = None,
    record: Callable[[dict], None] | None = None,
) -> dict:
    """Every probe's metrics, on every rank (a probe's error, e.g. too few images of a class for the
    shots, is raised on every rank). All ranks must call it: the features' forward passes and the
    gather are collective. `record`: given (on rank 0) each probe's shots by sample key,
    {probe: {"5shot": [keys]}}; all ranks must pass one or none."""
    was_training = model.training
    model.eval()
    try:
        results, shots = {}, {}
        for probe in probes:
            keys: dict[int, str] | None = {} if record else None
            train = gather_rows(*split_features(model, probe.train, objective, params, keys))
            test = gather_rows(*split_features(model, probe.test, objective, params))
            metrics, shot_keys = agree(partial(probe_metrics, probe, train, test, cfg, device))
            del train, test  # one probe's features at a time
            results.update(metrics)
            if record and shot_keys:
                shots[probe.name] = name_shots(shot_keys, keys)
        if record and shots and dist.get_rank() == 0:
            record(shots)
        return results
    finally:
        model.train(was_training)
