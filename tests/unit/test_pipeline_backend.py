"""The loader backends' registry (pipeline/backend.py): an unknown name is refused naming the
registered ones, and a backend registered by name is built by the loader."""

from __future__ import annotations

import pytest
import torch

from vitforge.pipeline import LoaderSpec, build_loader


def test_an_unknown_backend_is_refused_naming_the_registered_ones():
    from vitforge.pipeline import backend_names, find_backend
    from vitforge.trainer import ConfigError, load_config

    known = "(dali, dali-cpu, synthetic, torch)"
    assert backend_names() == ["dali", "dali-cpu", "synthetic", "torch"]
    for refuse in (lambda: LoaderSpec("x", batch_size=1, backend="dalli"), lambda: find_backend("dalli"),
                   lambda: load_config("tiny_cpu", ["data.backend=dalli"])):
        with pytest.raises(ValueError, match=r"backend must be auto or a registered loader backend") as caught:
            refuse()
        assert known in str(caught.value) and "'dalli'" in str(caught.value)
    with pytest.raises(ConfigError, match=r"^.*tiny_cpu.yaml: data.backend: "):
        load_config("tiny_cpu", ["data.backend=dalli"])


def test_a_backend_registered_by_name_is_built_by_the_loader(monkeypatch):
    from vitforge.core import UsageError
    from vitforge.pipeline import backend as registry
    from vitforge.pipeline import backend_names, register_backend

    with pytest.raises(UsageError, match="already registered"):
        register_backend("torch")(lambda *args: None)
    with pytest.raises(UsageError, match="cannot be one"):
        register_backend("auto")(lambda *args: None)
    monkeypatch.setattr(registry, "_backends", dict(registry._backends))  # the registration ends with the test
    built = []

    @register_backend("ones", reads_dataset=False)
    def ones(spec, index, device, num_classes):
        backend = registry.SyntheticBackend(spec, num_classes, device)
        backend.name, backend.images = "ones", torch.ones_like(backend.images)
        built.append((index, num_classes))
        return backend

    assert "ones" in backend_names()
    loader = build_loader(LoaderSpec("unused", batch_size=2, image_size=8, backend="ones"), synthetic_samples=6,
                          synthetic_classes=3)
    assert [b["image"].sum().item() for b in loader] == [2 * 3 * 8 * 8] * 3 and built == [(None, 3)]
    assert loader.stats()["backend"] == "ones"
