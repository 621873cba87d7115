"""`vitforge ckpt export` of a masked-patch pre-training checkpoint (the encoder under timm's names,
the objective named, the pre-training head kept apart on request, an unknown objective refused),
export's fall-back past damaged checkpoints like `train`'s, and `ckpt list`'s verdict on a
checkpoint whose manifest lists a missing or mis-sized file."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from common.cli import train, vitforge
from vitforge.core import CheckpointError, UsageError


@pytest.fixture(scope="module")
def pretrained(data):
    """A masked-patch pre-training run with checkpoints at steps 2, 4 and 6 (one process, tiny)."""
    train(data, "export_mpp", "train.objective=masked_patch_prediction", "train.steps=6",
          "train.checkpoint_every=2", "train.log_every=2", "data.val=null", nproc=1)
    return data / "runs" / "export_mpp"


def copy_of(run, tmp_path):
    """A copy to damage: the module's run stays intact for the other tests."""
    return shutil.copytree(run, tmp_path / run.name)


def manifest_files(run, tag: str) -> dict:
    return json.loads((run / tag / "manifest.json").read_text())["files"]


@pytest.mark.slow
def test_masked_patch_export_is_the_encoder_under_timm_names(pretrained, tmp_path):
    from safetensors.torch import load_file
    from timm.models.vision_transformer import VisionTransformer

    from vitforge.trainer import TINY_MODELS, build_model
    from vitforge.trainer.export import consolidate, load_exact

    out = tmp_path / "mpp.safetensors"
    vitforge("ckpt", "export", pretrained, "--out", out, "--include-head")
    description = json.loads((tmp_path / "mpp.json").read_text())
    assert description["objective"] == "masked_patch_prediction" and description["num_classes"] == 0
    assert description["step"] == 6 and description["head"] == "mpp.head.safetensors"
    encoder = VisionTransformer(img_size=description["image_size"], num_classes=description["num_classes"],
                                **TINY_MODELS[description["model"]]).eval()
    encoder.load_state_dict(load_file(out), strict=True)
    # The same features as the trained encoder inside the project's own model.
    with torch.no_grad():
        trained = consolidate(str(pretrained / "step_00000006"), str(tmp_path / "scratch"))
        model = build_model("vit_tiny_cpu", 0, 32, objective="masked_patch_prediction").eval()
        load_exact(model, trained.state, trained.url)
        images = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
        expected = model.vit.forward_head(model.vit.forward_features(images), pre_logits=True)
        assert torch.equal(encoder(images), expected)
    head = load_file(tmp_path / description["head"])
    assert sorted(head) == ["head.bias", "head.weight", "mask_token"]
    assert all(torch.equal(head[k], trained.state[k]) for k in head)


def test_an_objective_that_cannot_be_exported_is_refused(pretrained, tmp_path):
    from vitforge.trainer.export import export

    run = copy_of(pretrained, tmp_path)
    manifest = run / "step_00000006" / "manifest.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "objective": "contrastive"}))
    out = tmp_path / "x.safetensors"
    with pytest.raises(UsageError, match="step_00000006: objective 'contrastive' cannot be exported"):
        export(str(run / "step_00000006"), str(out), str(tmp_path / "scratch"))
    assert not out.exists()


@pytest.mark.slow
def test_export_of_a_run_falls_back_past_damaged_checkpoints(pretrained, tmp_path):
    from vitforge.trainer.export import consolidate

    run = copy_of(pretrained, tmp_path)
    (run / "step_00000006" / "manifest.json").write_text("garbage{")
    (run / "step_00000004" / sorted(manifest_files(run, "step_00000004"))[0]).unlink()
    out = tmp_path / "model.safetensors"
    exported = vitforge("ckpt", "export", run, "--out", out)
    assert "not valid JSON" in exported.stderr and "falling back to step_00000004" in exported.stderr
    assert "missing" in exported.stderr and "falling back to step_00000002" in exported.stderr
    description = json.loads((tmp_path / "model.json").read_text())
    assert description["step"] == 2 and description["source"].endswith("step_00000002")
    assert "head" not in description and not (tmp_path / "model.head.safetensors").exists()
    # A checkpoint asked for by name is never swapped for another.
    with pytest.raises(CheckpointError, match="step_00000006/manifest.json: not valid JSON"):
        consolidate(str(run / "step_00000006"), str(tmp_path / "scratch"))


@pytest.mark.slow
def test_ckpt_list_marks_a_checkpoint_with_a_missing_or_mis_sized_file_incomplete(pretrained, tmp_path):
    run = copy_of(pretrained, tmp_path)
    missing = sorted(manifest_files(run, "step_00000002"))[0]
    (run / "step_00000002" / missing).unlink()
    cut = run / "step_00000004" / sorted(manifest_files(run, "step_00000004"))[-1]
    cut.write_bytes(cut.read_bytes()[:-1])
    rows = {line.split()[5]: line for line in vitforge("ckpt", "list", run).stdout.splitlines()[1:]}
    assert " incomplete " in rows["step_00000002"] and f"{missing}: missing" in rows["step_00000002"]
    assert " incomplete " in rows["step_00000004"] and "the manifest says" in rows["step_00000004"]
    assert " complete " in rows["step_00000006"] and "<- latest" in rows["step_00000006"]
