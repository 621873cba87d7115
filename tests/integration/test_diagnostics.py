"""Straggler detection and profiler windows: one real 2-rank run (DeepSpeed ZeRO-2, gloo on the
CPU) in which rank 1's loader is slowed on purpose and steps 3-4 are profiled."""

from __future__ import annotations

import json
import re
import socket
import textwrap

import pytest

from common.cli import train, vitforge

# Test equipment, not product code: imported at start-up by every process that has tmp_path first on
# PYTHONPATH; in rank 1 the torch loader backend sleeps before handing over each batch, as a slow
# disk or decoder would (inside the loader, where its data wait is counted).
SLOW_RANK_1 = textwrap.dedent("""
    import os
    if os.environ.get("RANK") == "1":
        import time
        from vitforge.pipeline import torch_backend
        batches = torch_backend.TorchBackend.batches

        def slow(self, *args, **kwargs):
            for batch in batches(self, *args, **kwargs):
                time.sleep(0.15)
                yield batch

        torch_backend.TorchBackend.batches = slow
""")


@pytest.mark.slow
def test_a_slow_rank_is_named_with_its_host_and_a_profiler_window_traces_its_steps(data, tmp_path):
    (tmp_path / "sitecustomize.py").write_text(SLOW_RANK_1)
    result = train(data, "diagnostics", "train.steps=6", "train.log_every=1", "data.val=null", "checkpoint.save=false",
                   "train.straggler_every=2", "train.profile_steps=[3, 4]", env={"PYTHONPATH": str(tmp_path)})
    run = data / "runs" / "diagnostics"
    host = socket.gethostname()
    assert f"rank 1 on {host} is a straggler" in result.stderr, result.stderr[-3000:]
    assert "(input-bound)" in result.stderr
    assert "rank 0 on" not in result.stderr
    table = (run / "timing.md").read_text()
    assert "| host | ranks | mean step s | max step s | mean own s | mean data wait s | times flagged |" in table
    row = next(line for line in table.splitlines() if line.startswith(f"| {host} |"))
    assert row.split("|")[2].strip() == "0-1" and int(row.split("|")[7]) == 3  # flagged at steps 2, 4 and 6
    report = json.loads((run / "timing.json").read_text())
    assert report["exchanges"] == 3 and [r["flagged"] for r in report["ranks"]] == [0, 3]
    assert report["ranks"][1]["mean_data_wait_s"] > 0.1 > report["ranks"][0]["mean_data_wait_s"]

    traces = sorted((run / "profile").rglob("*.pt.trace.json"))
    assert {re.sub(r"\..*", "", p.name) for p in traces} == {"rank0", "rank1"}
    assert all(p.parent.name == "steps_3-4" for p in traces)
    for path in traces:
        events = json.loads(path.read_text())["traceEvents"]
        steps = {e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")}
        assert steps == {"ProfilerStep#3", "ProfilerStep#4"}, (path, steps)


def test_a_bad_profile_window_is_a_usage_error_naming_it():
    for window in ("3:2", "x", "0:4", "5"):
        result = vitforge("train", "tiny_cpu", "--profile", window, check=False)
        assert result.returncode == 2
        assert f"argument --profile: '{window}': expected steps FIRST:LAST with 1 <= FIRST <= LAST" in result.stderr
