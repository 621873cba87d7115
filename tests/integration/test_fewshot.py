"""The frozen-representation probes during training: real DeepSpeed ZeRO-3 across 2
processes (gloo on CPU), preempted with SIGUSR1 between two evaluations and resumed. (On a checkpoint
alone, at another world size: tests/integration/test_masked_patches.py.)"""

from __future__ import annotations

import json
import signal
import time

import numpy as np

import pytest

from common.cli import start_ranks, train
from vitforge.core import errors
from vitforge.trainer.probe_eval import key_hash, shots_fingerprint

# 12 steps at ZeRO-3, probes at 4, 8 and 12 (eval.every; train.eval_every would be data.val's, and
# is also the probes' default); the probe draws its shots from the training split and is scored on
# the held-out one.
PROBED = ["train.steps=12", "eval.every=4", "train.eval_every=1000", "train.checkpoint_every=4", "train.log_every=4",
          "train.zero_stage=3", "data.val=null", "eval.fewshot=[1,5]", "eval.knn=5", "eval.linear=true"]


def probed(data) -> list[str]:
    return [*PROBED, f"eval.probes={{digits: {{train: {data / 'train'}, test: {data / 'val'}}}}}"]


def eval_rows(run) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    timed = ("eval_probe_seconds",)
    return [{k: v for k, v in row.items() if k == "step" or k.startswith("eval_") and k not in timed}
            for row in rows if "eval_fewshot_digits_1shot" in row]


@pytest.mark.slow
def test_probes_during_a_preempted_zero3_run_equal_an_uninterrupted_one(data):
    train(data, "probed", *probed(data))
    straight = eval_rows(data / "runs" / "probed")
    assert [row["step"] for row in straight] == [4, 8, 12]
    last = straight[-1]
    for name in ("fewshot_digits_1shot", "fewshot_digits_5shot", "knn_digits", "linear_digits"):
        assert 0 <= last[f"eval_{name}"] <= 1, last
    assert last["eval_fewshot_digits_5shot"] > 0.5, last  # ten colours: a linear probe separates them
    # The same shots at every evaluation, recorded by sample key: 1 and 5 per class, the 1-shot ones
    # among the 5-shot ones, and the fingerprint in the metrics is theirs.
    assert len({row["eval_fewshot_digits_5shot_images"] for row in straight}) == 1
    assert straight[0]["eval_fewshot_digits_1shot_images"] != straight[0]["eval_fewshot_digits_5shot_images"]
    recorded = json.loads((data / "runs" / "probed" / "probe_shots.json").read_text())["digits"]
    assert len(recorded["1shot"]) == 10 and len(recorded["5shot"]) == 50
    assert set(recorded["1shot"]) < set(recorded["5shot"])
    for shots in ("1shot", "5shot"):
        hashes = np.array([key_hash(key) for key in recorded[shots]])
        assert shots_fingerprint(hashes) == last[f"eval_fewshot_digits_{shots}_images"]

    ranks = start_ranks(data, "probed-usr1", *probed(data))
    metrics = data / "runs" / "probed-usr1" / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.exists() and "eval_fewshot" in metrics.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    ranks[1].send_signal(signal.SIGUSR1)  # after the evaluation at step 4, before the one at 8
    outputs = [r.communicate(timeout=240) for r in ranks]
    assert [r.returncode for r in ranks] == [errors.REQUEUE] * 2, outputs
    stopped = int(outputs[0][1].split("stopped at step ")[1].split()[0])
    assert 4 <= stopped < 12, outputs[0][1][-2000:]
    train(data, "probed-usr1", *probed(data))
    # Not repeated, not skipped, and the same figures as if never stopped.
    assert eval_rows(data / "runs" / "probed-usr1") == straight
