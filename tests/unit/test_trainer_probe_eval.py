"""The probes run during training (trainer/probe_eval.py): their datasets are checked when the run
starts."""

from __future__ import annotations

import re

import pytest

from vitforge.pipeline import LoaderSpec, build_loader
from vitforge.trainer import ConfigError
from vitforge.trainer.output_config import EvalConfig
from vitforge.trainer.probe_eval import build_probes


def test_probe_datasets_are_checked_when_the_run_starts(data, tmp_path):
    """A missing split, too few images of a class for the shots (dataset.json's class counts) and
    mismatched classes are errors naming the probe and the split, before any training step."""
    def make(source):
        return build_loader(LoaderSpec(source, batch_size=8, image_size=32, train=False, backend="torch", workers=0))

    def probes(test, **settings):
        return EvalConfig(probes={"digits": {"train": str(data / "train"), "test": str(test)}}, **settings)

    nowhere = tmp_path / "nowhere"
    with pytest.raises(ConfigError, match=re.escape(f"eval.probes.digits.test ({nowhere}): ")):
        build_probes(probes(nowhere, fewshot=[5]), make)
    with pytest.raises(ConfigError, match=r"eval.probes.digits.train: 10 class\(es\) have fewer than 50 images"):
        build_probes(probes(data / "val", fewshot=[5, 50]), make)  # 40 images per class
    built = build_probes(probes(data / "val", fewshot=[50], allow_fewer=True), make)
    assert [(p.name, p.num_classes, len(p.classes)) for p in built] == [("digits", 10, 10)]
