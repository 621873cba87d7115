"""The sharder at scale: one planner per job, plan slices, a task reads only its slice, bounded dedup."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict

import pytest

from common.checks import tree_bytes, without_plan
from common.cli import REPO
from vitforge.core import open_store
from vitforge.shards import ShardJob, ensure_plan
from vitforge.shards.layout import FIRST
from vitforge.shards.plan import (SAMPLE_OVERHEAD, Inputs, deduplicate, load_slice, plan_inputs, read_header,
                                  write_plan)
from vitforge.shards.sources import SourceRecord


def reference_items(records: list[SourceRecord], seed: int, shard_samples: int | None,
                    shard_bytes: int | None) -> list[list[dict]]:
    """The plan as the one-file planner made it (before slices): sorted() by the keyed hash of the
    name, greedy cut; an independent oracle for the columns' lexsort and chunked cut."""
    def key(record):
        return hashlib.blake2b(record.name.encode("utf-8", "surrogateescape"), key=str(seed).encode(),
                               digest_size=16).digest()

    shards, size = [[]], 0
    for position, record in enumerate(sorted(records, key=key)):
        item_size = record.size + SAMPLE_OVERHEAD
        if (shard_samples and len(shards[-1]) >= shard_samples) or (
                shard_bytes and shards[-1] and size + item_size > shard_bytes):
            shards.append([])
            size = 0
        shards[-1].append({"key": f"{position:09d}", "source": record.source, "label": record.label,
                           "meta": record.meta, "problem": list(record.problem) if record.problem else None})
        size += item_size
    return shards


def odd_records(n: int) -> list[SourceRecord]:
    """Labels and none, metadata, problems, a name listed twice, a non-UTF-8 (surrogate-escaped) path."""
    records = []
    for i in range(n):
        name = f"c{i % 3}/img{i:04d}.jpg" if i != 7 else "c0/\udcff-latin1.jpg"
        records.append(SourceRecord(f"/data/{name}", None if i % 11 == 0 else i % 3, 100 + (i * 7919) % 4000,
                                    meta={"caption": f"#{i} \u00e9"} if i % 4 == 0 else {},
                                    problem=("missing_path", f"row {i}") if i % 13 == 0 else None, name=name))
    records.append(SourceRecord("/data/again.jpg", 1, 500, name="c1/img0001.jpg"))  # same name: ties keep listing order
    return records


@pytest.mark.parametrize("shard_samples, shard_bytes", [(7, None), (None, 9000), (5, 6000)])
def test_slices_reproduce_the_one_file_plan_for_any_part_count(tmp_path, shard_samples, shard_bytes):
    records = odd_records(200)
    plan = plan_inputs(Inputs.of(records, seed=3), ["a", "b", "c"], {}, shard_bytes=shard_bytes,
                       shard_samples=shard_samples, dedup=False)
    store = open_store(str(tmp_path))
    header = write_plan(store, plan, parts=3)
    expected = reference_items(records, 3, shard_samples, shard_bytes)
    assert header.shards == len(expected) > 6 and header.inputs == 201
    for num_parts in (3, 1, 2, 5, header.shards + 2):  # the planner's count, and a job resumed with others
        got = []
        for part in range(num_parts):
            shards = load_slice(store, header, part, num_parts)
            assert list(shards) == list(header.shard_range(part, num_parts))
            got += [[asdict(item) for item in items] for items in shards.values()]
        assert got == expected, num_parts


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


def test_a_planner_thought_dead_leaves_the_claim_of_the_task_that_took_over(tmp_path):
    from vitforge.shards.claims import _make_claimed

    store = open_store(str(tmp_path / "out"))
    mine = store.put_if(FIRST.claim, json.dumps({"part": 0, "host": "node-1", "pid": 1, "beat": 0}).encode(), None)
    # While this task plans, another judges it dead (no renewal seen in time) and takes the claim over.
    theirs = json.dumps({"part": 1, "host": "node-2", "pid": 1, "beat": 0}).encode()
    store.put_if(FIRST.claim, theirs, mine)
    made = _make_claimed(store, FIRST.claim, mine, lambda: None, lambda: "the plan", 0)
    # The claim stays the other task's (it deletes it when its own plan is written), not this one's to delete.
    assert made == "the plan" and store.get_versioned(FIRST.claim)[0] == theirs
    # A claim still this task's is deleted once its work is made, lock file and all.
    store.delete([FIRST.claim, f"{FIRST.claim}.lock"])
    mine = store.put_if(FIRST.claim, json.dumps({"part": 0, "host": "node-1", "pid": 1, "beat": 0}).encode(), None)
    _make_claimed(store, FIRST.claim, mine, lambda: None, lambda: "the plan", 0)
    assert store.get_versioned(FIRST.claim) is None


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


def test_dedup_keeps_the_first_and_holds_at_most_twice_the_threads_in_flight():
    contents = [f"image {i % 37 if i % 5 == 0 else 1000 + i}".encode() for i in range(300)]
    records = [SourceRecord(str(i), 0, 10, name=str(i), problem=("empty", "") if i == 35 else None)
               for i in range(300)]
    inputs = Inputs.of(records, seed=0)
    started, release = [], threading.Event()

    def read(source: str) -> bytes:  # row 0 holds the ordered results back until released
        started.append(int(source))
        if source == "0":
            release.wait(30)
        if source == "299":
            raise FileNotFoundError(source)
        return contents[int(source)]

    threads = 4
    worker = threading.Thread(target=lambda: found.extend(deduplicate(inputs, threads, read)))
    found: list = []
    worker.start()
    time.sleep(0.5)
    in_flight = len(started)
    release.set()
    worker.join(30)
    assert in_flight <= 2 * threads
    first: dict[bytes, int] = {}
    expected = []
    for i, data in enumerate(contents[:299]):
        if i == 35:
            continue
        if data in first:
            expected.append((i, first[data], hashlib.sha256(data).hexdigest()))
        first.setdefault(data, i)
    assert found == expected and len(expected) > 10
