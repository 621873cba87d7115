"""A job array plans a Parquet list together (shards/array_plan.py): every task lists a share of the
row groups, buckets are sorted and cut by whichever task takes them, and the result is the plan
one task makes; a throttled array, a dead task and a resubmitted part still finish the same."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import threading

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

import vitforge.shards.plan as plan
from common.checks import tree_bytes, without_plan
from common.cli import vitforge
from vitforge.core import open_store
from vitforge.shards import ShardJob, run
from vitforge.shards.array_plan import _shares
from vitforge.shards.layout import FIRST
from vitforge.shards.plan_slices import load_slice, read_header
from vitforge.shards.sources import list_corpus

ROWS = 90
SHARD_SAMPLES = 4
BUCKET_INPUTS = 16  # so 90 inputs make 6 buckets, each cut on its own


@pytest.fixture(params=[7, ROWS], ids=["row-groups-of-7", "one-row-group"])
def listing(request, tmp_path):
    """90 rows in row groups of 7 (13 groups), or in one (split between tasks by rows): labels by
    name, a row without a label, a missing file."""
    (tmp_path / "img").mkdir()
    rows = []
    for i in range(ROWS):
        path = tmp_path / "img" / f"{i:03d}.jpg"
        Image.new("RGB", (16 + i % 5, 16), (i * 7 % 256, i % 3 * 80, 0)).save(path)
        rows.append({"path": f"img/{i:03d}.jpg" if i != 13 else "img/missing.jpg",
                     "label": ["cat", "dog", "eel"][i % 3] if i % 17 else None, "caption": f"#{i}"})
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "list.parquet", row_group_size=request.param)
    return tmp_path / "list.parquet"


@pytest.fixture
def small_buckets(monkeypatch):
    monkeypatch.setattr(plan, "BUCKET_INPUTS", BUCKET_INPUTS)


def _job(src, dest, parts: int = 1, part: int = 0) -> ShardJob:
    return ShardJob(str(src), str(dest), shard_samples=SHARD_SAMPLES, shard_bytes=None, num_parts=parts, part=part)


def _together(job, parts: int) -> None:
    """Every part at once, as a job array runs them: `job(part)` is part's ShardJob."""
    failures = []

    def one(part: int):
        try:
            run(job(part))
        except BaseException as e:  # noqa: BLE001 - reported below
            failures.append(e)

    threads = [threading.Thread(target=one, args=(p,)) for p in range(parts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures


def _header(dest) -> dict:
    return json.loads((dest / FIRST.header).read_text())


def test_an_array_plans_a_parquet_list_together_to_the_plan_one_task_makes(listing, small_buckets, tmp_path):
    run(_job(listing, tmp_path / "one"))
    _together(lambda part: _job(listing, tmp_path / "three", 3, part), 3)
    one, three = tree_bytes(tmp_path / "one"), tree_bytes(tmp_path / "three")
    assert without_plan(three) == without_plan(one)
    manifest = json.loads(one["dataset.json"])
    assert manifest["totals"]["inputs"] == ROWS and manifest["totals"]["rejected"] >= 1
    header = _header(tmp_path / "three")
    assert header["parts"] == 6 and len(header["slice_inputs"]) == 6 and sum(header["slice_inputs"]) == ROWS
    # Each bucket is cut on its own: ceil(its inputs / 4) shards, none spanning two buckets.
    assert header["slice_shards"] == [-(-n // SHARD_SAMPLES) for n in header["slice_inputs"]]
    assert header["shards"] == manifest["totals"]["shards"] == sum(header["slice_shards"])
    spread = tmp_path / "three" / FIRST.plan_dir / "spread"
    assert not spread.exists() or list(spread.iterdir()) == []
    # Slice k is numbered within itself; the first keys of the dataset are slice 0's.
    lines = [json.loads(line) for p in range(6)
             for line in gzip.decompress((tmp_path / "three" / FIRST.slice(p)).read_bytes()).splitlines()]
    assert [line[1] for line in lines[:3]] == ["000000000", "000000001", "000000002"]
    assert len(lines) == ROWS


def test_a_throttled_array_and_a_dead_task_finish_the_plan_and_a_lost_part_rebuilds_its_shards(
        listing, small_buckets, tmp_path):
    run(_job(listing, tmp_path / "one"))
    dest = tmp_path / "array"
    # Part 1 died holding the claim on its share's spill: a process of this host that is gone.
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    claim = dest / FIRST.plan_dir / "spread" / "spill-00001.json.claim"
    claim.parent.mkdir(parents=True)
    claim.write_text(json.dumps({"part": 1, "host": __import__("socket").gethostname(), "pid": int(gone.stdout),
                                 "beat": 0}))
    # One task at a time (an array throttled to one running task): part 0 makes every unit.
    for part in range(3):
        run(_job(listing, dest, 3, part))
    assert without_plan(tree_bytes(dest)) == without_plan(tree_bytes(tmp_path / "one"))
    # Part 1 is lost after the fact: its shards are deleted and it is resubmitted alone.
    header = _header(dest)
    owned = range(header["shards"] // 3, 2 * header["shards"] // 3)
    before = tree_bytes(dest)
    for i in owned:
        for name in (f"train-{i:06d}.tar", f"train-{i:06d}.idx", FIRST.record(f"train-{i:06d}.tar")):
            (dest / name).unlink()
    result = vitforge("shard", listing, dest, "--shard-samples", str(SHARD_SAMPLES), "--shard-bytes", "0",
                      "--num-parts", "3", "--part", "1")
    assert f"{len(owned)} to build" in result.stderr
    assert tree_bytes(dest) == before


@pytest.mark.parametrize("labelled", [True, False], ids=["class-folders", "unlabelled"])
def test_an_array_plans_a_folder_together_class_ids_as_one_listing_gives(labelled, small_buckets, tmp_path):
    """Class folders split by top-level entry: an empty class folder takes no id in any share, a
    file directly in SRC is no input, and a file that is no image is left out, as in one listing."""
    src = tmp_path / "src"
    for i in range(70):
        folder = src / f"{i % 9}" / ("deep" if i % 5 == 0 else "")
        folder.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (16, 12 + i % 4), (i * 3 % 256, 9, 9)).save(folder / f"{i:03d}.png")
    (src / "4-empty").mkdir()
    (src / "README.txt").write_text("not an input")
    (src / "2" / "notes.txt").write_text("not an image")

    def job(dest, parts=1, part=0):
        return ShardJob(str(src), str(dest), shard_samples=SHARD_SAMPLES, shard_bytes=None, labels=labelled,
                        num_parts=parts, part=part)

    run(job(tmp_path / "one"))
    _together(lambda part: job(tmp_path / "four", 4, part), 4)
    assert without_plan(tree_bytes(tmp_path / "four")) == without_plan(tree_bytes(tmp_path / "one"))
    manifest = json.loads((tmp_path / "four" / "dataset.json").read_text())
    assert manifest["totals"]["inputs"] == 70
    assert manifest["classes"] == ([str(c) for c in range(9)] if labelled else [])
    assert _header(tmp_path / "four")["parts"] == 5  # 70 inputs, buckets of 16


def test_below_a_bucket_the_plan_is_the_one_a_single_task_makes_of_the_listing(listing, tmp_path):
    """The array's plan (one bucket: 90 inputs) against plan.py's one-task planner on the same
    records: the same items, shard by shard."""
    run(_job(listing, tmp_path / "array", 3, 1))
    store = open_store(str(tmp_path / "array"))
    header = read_header(store)
    assert header.parts == 1 and header.slice_shards is not None
    job = _job(listing, tmp_path / "array")
    corpus = list_corpus(str(listing))
    single = plan.make_plan(corpus, job.output_parameters(), seed=0, shard_bytes=None, shard_samples=SHARD_SAMPLES,
                            dedup=False)
    one = open_store(str(tmp_path / "single"))
    plan.write_plan(one, single, parts=1)
    assert load_slice(store, header, 0, 1) == load_slice(one, read_header(one), 0, 1)
    assert header.classes == corpus.classes == ["cat", "dog", "eel"]


def test_a_plan_under_way_with_other_parameters_is_refused_and_leftovers_are_tidied(listing, tmp_path):
    dest = tmp_path / "out"
    # A job with --seed 0 began planning (its first task fixed the shares), then was cancelled.
    _shares(_job(listing, dest, 3), open_store(str(dest)), FIRST)
    result = vitforge("shard", listing, dest, "--shard-samples", str(SHARD_SAMPLES), "--shard-bytes", "0",
                      "--seed", "1", "--num-parts", "3", "--part", "0", check=False)
    assert result.returncode == 2, result.stderr
    assert "a shard plan with other parameters is being made there, by `vitforge shard" in result.stderr
    assert "--seed 1" not in result.stderr.split("by `")[1].split("`")[0] and "Traceback" not in result.stderr
    # The same parameters finish it; a task that finds the plan made deletes what its steps left.
    run(_job(listing, dest, 3, 0))
    spread = dest / FIRST.plan_dir / "spread"
    spread.mkdir(exist_ok=True)
    (spread / "spill-00001-0000-0123456789ab.bin").write_bytes(b"left by a task thought dead")
    run(_job(listing, dest, 3, 2))
    assert not spread.exists() or list(spread.iterdir()) == []


def test_a_task_killed_while_it_holds_a_bucket_is_taken_over(listing, tmp_path):
    run(_job(listing, tmp_path / "one"))
    dest = tmp_path / "array"
    # Part 0 claims the bucket and hangs in it (a stand-in for a slow sort), then is killed -9.
    code = ("import sys, time\nimport vitforge.shards.array_plan as ap\n"
            "def stuck(*args, **kwargs):\n    print('holding', flush=True)\n    time.sleep(600)\n"
            "ap._bucket = stuck\nfrom vitforge.shards import ShardJob, run\n"
            f"run(ShardJob({str(listing)!r}, {str(dest)!r}, shard_samples={SHARD_SAMPLES}, shard_bytes=None, "
            "num_parts=2, part=0))\n")
    task = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert task.stdout.readline().strip() == "holding"
        assert (dest / FIRST.plan_dir / "spread" / "bucket-00000.json.claim").exists()
    finally:
        task.kill()
        task.wait()
    # Part 1 (this host: the holder's pid is gone) takes the bucket over at once and finishes.
    run(_job(listing, dest, 2, 1))
    run(_job(listing, dest, 2, 0))
    assert without_plan(tree_bytes(dest)) == without_plan(tree_bytes(tmp_path / "one"))


def test_a_list_in_a_store_is_read_by_row_group_ranges(listing, small_buckets, s3_env, bucket, s3_server, tmp_path):
    client = s3_server["client"]
    client.put_object(Bucket=bucket, Key="lists/list.parquet", Body=listing.read_bytes())
    for image in (listing.parent / "img").iterdir():
        client.put_object(Bucket=bucket, Key=f"lists/img/{image.name}", Body=image.read_bytes())
    src = f"s3://{bucket}/lists/list.parquet"
    run(_job(src, tmp_path / "one"))
    _together(lambda part: _job(src, tmp_path / "two", 2, part), 2)
    assert without_plan(tree_bytes(tmp_path / "two")) == without_plan(tree_bytes(tmp_path / "one"))
    assert json.loads((tmp_path / "two" / "dataset.json").read_text())["totals"]["inputs"] == ROWS


@pytest.mark.parametrize("case", ["no_such_column", "no_rows"])
def test_a_bad_list_stops_every_part_with_one_line(case, tmp_path):
    if case == "no_rows":
        pq.write_table(pa.table({"path": pa.array([], pa.string()), "label": pa.array([], pa.string())}),
                       tmp_path / "list.parquet")
        expected = "manifest has no rows"
    else:
        pq.write_table(pa.table({"file": ["a.jpg"], "label": ["cat"]}), tmp_path / "list.parquet")
        expected = "no column 'path' (columns: file, label)"
    result = vitforge("shard", tmp_path / "list.parquet", tmp_path / "out", "--num-parts", "2", "--part", "0",
                      check=False)
    assert result.returncode == 2, result.stderr
    assert expected in result.stderr and "Traceback" not in result.stderr
