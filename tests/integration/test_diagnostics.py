"""Straggler detection and profiler windows: one real 2-rank run (DeepSpeed ZeRO-2, gloo on the
CPU) in which rank 1's loader is slowed on purpose and steps 3-4 are profiled."""

from __future__ import annotations

import json
import re
import socket

import pytest

from common.cli import train, vitforge
from common.slow_loader import write_slow_loader


@pytest.mark.slow
def test_a_slow_rank_is_named_with_its_host_and_a_profiler_window_traces_its_steps(data, tmp_path):
    write_slow_loader(tmp_path, 'os.environ.get("RANK") == "1"', 0.15)  # rank 1 waits 0.15 s a batch
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
