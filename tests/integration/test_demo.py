"""`vitforge demo`, shortened (fewer images and steps, the same code path): from generated JPEGs
to a trained, preempted, resumed, evaluated and exported ViT, with its report."""

from __future__ import annotations

import json

import pytest

from common.cli import EXTENSIONS, vitforge
from vitforge.testing import local_slurm_missing


@pytest.mark.slow(seconds=160)
def test_the_demo_trains_is_preempted_resumes_from_the_store_and_reports(tmp_path):
    out = tmp_path / "demo"
    result = vitforge("demo", "--out", out, "--images", "600", "--val-images", "100", "--steps", "240",
                      env=EXTENSIONS, timeout=900)
    for stage in range(1, 9):
        assert f"== [{stage}/8]" in result.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval"]["eval_top1"] >= 0.4 and summary["eval"]["eval_samples"] == 100  # chance is 0.1
    assert abs(summary["timm"]["top1"] - summary["eval"]["eval_top1"]) <= 0.05  # another decoder, same weights
    # Stopped by the signal partway, resumed from the object store's checkpoint of that step, finished.
    assert summary["store"] == "s3://vitforge-demo" and summary["steps"] == 240
    assert summary["stop_reason"] == "signal SIGUSR1" and 0 < summary["stop_step"] < 240
    assert summary["resumed_from"] == f"s3://vitforge-demo/runs/demo/step_{summary['stop_step']:08d}"
    assert summary["resume_step"] == summary["stop_step"]
    assert summary["launcher"] == ("slurm" if local_slurm_missing() is None else "direct")
    assert summary["packed"] == 600
    assert "the same bytes, shard for shard" in result.stdout and (out / "shards" / "dataset.json").exists()
    assert sorted(r["reason"] for r in summary["rejects"]) == ["corrupt", "empty", "not_an_image", "truncated"]
    report = (out / "report.md").read_text()
    for path in [summary["files"]["weights"], *summary["files"]["plots"], *summary["files"]["figures"]]:
        assert (tmp_path / path).stat().st_size > 0, path
    for name in ("loss.png", "accuracy.png", "throughput.png", "position_similarity.png"):
        assert name in report
    assert "broken_scan.jpg | corrupt" in report
