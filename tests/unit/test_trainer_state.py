"""The checkpointer's named state parts (trainer/state.py): a part added to the dict is saved and
restored, per rank or shared, and a part an older checkpoint lacks starts fresh.

The test is one real DeepSpeed process (gloo on CPU) saving to and restoring from a local run
folder, run as this file's script (`python tests/unit/test_trainer_state.py RUN_URL OUT`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vitforge.trainer import build_model, load_config


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
