"""The trainer's seams: the objective registry (loud on unknown names, open to a new objective) and
the checkpointer's named state parts (a part added to the dict is saved and restored).

The part test is one real DeepSpeed process (gloo on CPU) saving to and restoring from a local run
folder, run as this file's script (`python tests/unit/test_state_parts.py RUN_URL OUT`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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
    from dataclasses import replace

    import torch

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


@pytest.mark.slow
def test_a_part_added_to_the_dict_is_saved_and_restored(tmp_path):
    from common.cli import EXTENSIONS, REPO

    out = tmp_path / "out"
    out.mkdir()
    result = subprocess.run([sys.executable, __file__, f"file://{tmp_path / 'runs'}/parts", str(out)], cwd=REPO,
                            env={**os.environ, **EXTENSIONS},
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads((out / "seen.json").read_text())
    assert seen["step"] == 1 and seen["counter"] == 7 and seen["shared"] == 3
    assert seen["draws"] == seen["expected_draws"]  # the RNG part came back as it was saved
    assert seen["rank_file"] == ["counter", "rng"] and seen["shared_file"] == ["tally"]
    assert seen["old_checkpoint"] == {"counter": 0, "shared": 0}  # a part the checkpoint lacks starts fresh


class Counter:
    """A part a later version might add: one number."""

    def __init__(self):
        self.value = 0

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


def _parts(run_url: str, out: str) -> None:
    import torch

    from vitforge.trainer import RandomState, StateParts
    from vitforge.trainer.checkpoint import Checkpointer
    from vitforge.trainer.distributed import detect_env, init_distributed, shutdown
    from vitforge.trainer.engine import build_engine

    env = detect_env()
    device = init_distributed(env)
    cfg = load_config("tiny_cpu", ["data.train=synthetic"])
    counter, tally = Counter(), Counter()

    def checkpointer(parts: StateParts) -> Checkpointer:
        made = Checkpointer(run_url, str(Path(out, "staging")), None, None, 10, 10, None, parts)
        made.claim()
        return made

    def make_model():
        return build_model(cfg.model.name, 10, cfg.model.image_size)

    def restore(made: Checkpointer):
        return made.restore(lambda universal: build_engine(cfg, make_model, env.world_size, device), "auto")

    # The step_1 checkpoint of an older version, which had no counter and no tally.
    first = checkpointer(StateParts(per_rank={"rng": RandomState()}))
    engine, _ = restore(first)
    first.save(engine, 1, {"config": cfg.model_dump(mode="json")})
    first.wait()
    first.release()
    parts = StateParts(per_rank={"counter": counter, "rng": RandomState()}, shared={"tally": tally})
    again = checkpointer(parts)
    restore(again)
    old = {"counter": counter.value, "shared": tally.value}
    again.release()

    saving = checkpointer(parts)
    engine, _ = restore(saving)
    counter.value, tally.value = 7, 3
    saving.save(engine, 1, {"config": cfg.model_dump(mode="json")})
    saving.wait()
    saving.release()
    expected = torch.rand(4).tolist()
    counter.value = tally.value = 0
    loading = checkpointer(parts)
    _, restored = restore(loading)
    loading.release()
    folder = Path(run_url.removeprefix("file://"), "step_00000001")
    Path(out, "seen.json").write_text(json.dumps({
        "step": restored.step, "counter": counter.value, "shared": tally.value, "draws": torch.rand(4).tolist(),
        "expected_draws": expected, "old_checkpoint": old,
        "rank_file": sorted(torch.load(folder / "rank0_state.pt", weights_only=False)),
        "shared_file": sorted(torch.load(folder / "shared_state.pt", weights_only=False))}))
    shutdown(graceful=True)


if __name__ == "__main__":
    _parts(*sys.argv[1:3])
