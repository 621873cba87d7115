"""The trainer's configuration (trainer/config.py): the shipped recipes hold the paper's settings, and
the data.* keys are the loader's settings, declared once."""

from __future__ import annotations

from vitforge.pipeline import LoaderSpec
from vitforge.trainer import load_config


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


def test_the_trainer_config_embeds_the_loader_settings_declared_once():
    """data.* keys are LoaderSettings' fields (type, default, bounds, doc), plus the data sets;
    LoaderSpec.of carries every one of them into the loader."""
    from vitforge.pipeline import LoaderSettings
    from vitforge.trainer import load_config
    from vitforge.trainer.config import DataConfig

    assert set(DataConfig.model_fields) == set(LoaderSettings.model_fields) | {"train", "val"}
    for schema in (DataConfig, LoaderSpec):
        for name, field in LoaderSettings.model_fields.items():
            mine = schema.model_fields[name]
            assert (mine.annotation, mine.default, mine.metadata, mine.description) == \
                (field.annotation, field.default, field.metadata, field.description), (schema, name)
            assert field.description, name  # documented (docs/CONFIG.md is generated from it)
    overrides = ["data.train=/x", "data.workers=3", "data.prefetch=5", "data.overlap=off", "data.subset=0.5",
                 "data.seed=7", "data.partitions=4", "data.cache_dir=/c", "data.cache_gb=1.5",
                 "data.read_block_mb=2", "data.shards_ahead=0", "data.backend=torch"]
    data = load_config("tiny_cpu", overrides).data
    made = LoaderSpec.of(data, "/x", batch_size=4)
    assert {n: getattr(made, n) for n in LoaderSettings.model_fields} == \
        {n: getattr(data, n) for n in LoaderSettings.model_fields}
    assert (made.workers, made.overlap, made.subset, made.cache_gb) == (3, "off", 0.5, 1.5)
    assert LoaderSpec.of(data, "/x", batch_size=4, subset=None).subset is None  # a call overrides a setting
