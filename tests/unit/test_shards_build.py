"""The sharding job's plan phase (shards/build.py's ensure_plan): one planner per job, a task reads only
the plan slices of its shards, a planner killed mid-write leaves no plan that looks complete, and a
task waiting for another's plan gives up at its deadline naming the planner."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from common.checks import tree_bytes, without_plan
from common.cli import REPO
from vitforge.core import open_store
from vitforge.shards import ShardJob, ensure_plan
from vitforge.shards.layout import FIRST
from vitforge.shards.plan_slices import load_slice, read_header


@pytest.fixture
def small_manifest(small_corpus, tmp_path):
    """small_corpus as a JSONL manifest: one task plans it (a folder or Parquet list is planned by
    the whole array, tests/integration/test_array_plan.py)."""
    rows = [{"path": str(p), "label": p.parent.name} for p in sorted(small_corpus.rglob("*.*"))]
    (tmp_path / "manifest.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return tmp_path / "manifest.jsonl"


def test_a_task_reads_only_the_slices_of_its_shards(small_manifest, tmp_path):
    small_corpus = small_manifest
    out = tmp_path / "out"
    ensure_plan(ShardJob(str(small_corpus), str(out), shard_samples=16, num_parts=3))
    assert read_header(open_store(str(out))).shards == 8  # parts own shards 0-1, 2-4, 5-7
    for part in (0, 2):
        os.unlink(out / FIRST.slice(part))
    # Resumed with another part count, a task reads the slices overlapping its shards: shard 3 lies in slice 1.
    assert "built 1 shards, 0 already complete" in run_part(small_corpus, out, "--num-parts", "8", "--part", "3").stdout
    assert "built 2 shards, 1 already complete" in run_part(small_corpus, out, "--num-parts", "3", "--part", "1").stdout
    missing = run_part(small_corpus, out, "--num-parts", "3", "--part", "2", check=False)
    assert missing.returncode == 2 and "part-00002.jsonl.gz: a slice of a complete plan is missing" in missing.stderr
    assert "Traceback" not in missing.stderr


def run_part(src, dest, *extra, check=True):
    result = subprocess.run([sys.executable, "-m", "vitforge", "shard", str(src), str(dest), "--shard-samples", "16",
                             "--workers", "1", *extra], cwd=REPO, capture_output=True, text=True, timeout=120)
    if check and result.returncode != 0:
        raise AssertionError(result.stderr)
    return result


def test_tasks_started_together_plan_once_and_equal_one_run(small_manifest, tmp_path):
    small_corpus = small_manifest
    run_part(small_corpus, tmp_path / "whole")
    out = tmp_path / "parts"
    tasks = [subprocess.Popen([sys.executable, "-m", "vitforge", "shard", str(small_corpus), str(out),
                               "--shard-samples", "16", "--workers", "1", "--num-parts", "3"], cwd=REPO,
                              env={**os.environ, "SLURM_ARRAY_TASK_ID": str(i)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(3)]
    logs = [task.communicate(timeout=120) for task in tasks]
    assert [task.returncode for task in tasks] == [0, 0, 0], logs
    assert sum("planned 120 inputs into 8 shards in 3 slices" in err for _, err in logs) == 1
    assert not (out / "_work" / "plan" / "claim.json").exists()
    if not (out / "dataset.json").exists():  # the last two may have finished together, each before the other
        subprocess.run([sys.executable, "-m", "vitforge", "shard", "merge", str(out)], cwd=REPO, check=True)
    assert without_plan(tree_bytes(out)) == without_plan(tree_bytes(tmp_path / "whole"))


def test_killed_while_planning_leaves_no_plan_that_looks_complete(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"path": f"img/{i:06d}.jpg", "label": i % 10}) + "\n" for i in range(20000)))
    job = ShardJob(str(rows), str(tmp_path / "out"), shard_samples=10, shard_bytes=None, num_parts=2000)
    planner = subprocess.Popen([sys.executable, "-c", "import sys; from vitforge.shards import ShardJob, ensure_plan; "
                                f"ensure_plan(ShardJob({job.src!r}, {job.dest!r}, shard_samples=10, shard_bytes=None, "
                                "num_parts=2000))"], cwd=REPO)
    first_slice = tmp_path / "out" / FIRST.slice(0)
    deadline = time.monotonic() + 120
    while not first_slice.exists() and planner.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    planner.send_signal(signal.SIGKILL)
    planner.wait()
    store = open_store(job.dest)
    assert first_slice.exists() and not store.exists(FIRST.header), "the kill did not land while slices were written"
    assert read_header(store) is None
    # The next run takes the dead planner's claim over at once (same host, pid gone) and plans again.
    started = time.monotonic()
    header = ensure_plan(job)
    assert time.monotonic() - started < 60 and header.shards == 2000 and header.parts == 2000
    assert [i.key for i in load_slice(store, header, 1999, 2000)[1999]] == [f"{p:09d}" for p in range(19990, 20000)]


def test_a_waiting_task_gives_up_at_its_deadline_naming_the_planner(small_manifest, tmp_path):
    small_corpus = small_manifest
    out = tmp_path / "out"
    store = open_store(str(out))
    # A live planner on another host, as its claim says: this task waits for it, then stops.
    store.put_if("_work/plan/claim.json", json.dumps({"part": 4, "host": "node-17", "pid": 1, "beat": 0}).encode(),
                 None)
    result = run_part(small_corpus, out, "--num-parts", "3", "--plan-wait", "1", check=False)
    assert result.returncode == 2, result.stderr
    assert "waited 1 s for the shard plan that part 4 (host node-17, pid 1) is making" in result.stderr
    assert "--plan-wait" in result.stderr and "Traceback" not in result.stderr
