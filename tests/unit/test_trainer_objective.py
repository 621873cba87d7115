"""The objectives (trainer/objective.py): the registry is loud on unknown names and open to a new
objective, and each objective's features are the pre-logits of the model it exports."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from vitforge.trainer import OBJECTIVES, ConfigError, build_model, get_objective, load_config, register_objective


def test_an_unknown_objective_names_the_known_ones():
    with pytest.raises(ConfigError, match=r"unknown objective 'contrastive' \(known: classification, "
                                          r"masked_patch_prediction\)"):
        get_objective("contrastive")
    with pytest.raises(ConfigError, match="train.objective: unknown objective 'contrastive'"):
        load_config("tiny_cpu", ["data.train=synthetic", "train.objective=contrastive"])
    with pytest.raises(ValueError, match="'classification' is registered already"):
        register_objective(OBJECTIVES["classification"])


def test_a_registered_objective_is_a_valid_config_and_builds_its_own_model():
    def encoder_only(make_vit, num_classes, pre_logits):
        return make_vit(0)

    register_objective(replace(OBJECTIVES["classification"], name="features", build=encoder_only, labelled=False))
    try:
        assert load_config("tiny_cpu", ["data.train=synthetic", "train.objective=features"]).train.objective == \
            "features"
        model = build_model("vit_tiny_cpu", 10, 32, objective="features")
        assert model(torch.zeros(1, 3, 32, 32)).shape == (1, 64)  # the pooled features, no class head
    finally:
        del OBJECTIVES["features"]


@pytest.mark.parametrize("objective, pre_logits", [("classification", False), ("classification", True),
                                                   ("masked_patch_prediction", False)])
def test_each_objective_gives_the_pre_logits_of_the_model_it_exports(objective, pre_logits):
    """The features a probe reads: the exported ViT's pooled token (forward_head(pre_logits=True)),
    through the paper's tanh layer when the model has its pre-training head; the same with the
    weights handed in instead of the module's own (EMA)."""
    torch.manual_seed(0)
    model = build_model("vit_tiny_cpu", 7, 32, pre_logits=pre_logits, objective=objective).eval()
    images = torch.randn(3, 3, 32, 32)
    vit = get_objective(objective).exported(model)
    want = vit.forward_head(vit.forward_features(images), pre_logits=True)
    if pre_logits:
        want = torch.tanh(vit.head.pre_logits(want))
    features = get_objective(objective).features
    torch.testing.assert_close(features(model, images, None), want)
    halved = {k: v.detach() / 2 for k, v in model.named_parameters()}
    assert not torch.allclose(features(model, images, halved), want)
    with torch.no_grad():
        for p in model.parameters():
            p /= 2
    torch.testing.assert_close(features(model, images, halved), features(model, images, None))
