"""`vitforge shard` end to end: output, determinism, workers, parts + merge, resume, verify, info, errors."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from common.checks import dataset_samples, tree_bytes, without_plan
from common.cli import REPO, vitforge


def shard(src, dest, *extra, env=None):
    return vitforge("shard", src, dest, "--shard-samples", "16", "--workers", "1", *extra, env=env)


def test_happy_path_layout_manifest_and_labels(small_corpus, tmp_path):
    out = tmp_path / "out"
    result = shard(small_corpus, out)
    assert "120 inputs = 120 packed + 0 rejected + 0 duplicates" in result.stdout
    manifest = json.loads((out / "dataset.json").read_text())
    assert manifest["classes"] == [f"class_{i:02d}" for i in range(5)]
    assert manifest["class_counts"] == [24] * 5
    assert [s["name"] for s in manifest["shards"]] == [f"train-{i:06d}.tar" for i in range(8)]
    assert [s["samples"] for s in manifest["shards"]] == [16] * 7 + [8]
    for shard_info in manifest["shards"]:
        assert (out / shard_info["name"]).stat().st_size == shard_info["bytes"]
        assert (out / shard_info["index"]).exists()
    labels_by_class = {}
    keys = []
    for sample in dataset_samples(out):
        info = sample["info"]
        keys.append(sample["key"])
        assert sample["cls"] == info["label"]
        labels_by_class.setdefault(Path(info["source"]).parent.name, set()).add(info["label"])
        assert info["sha256"] and info["width"] > 0
    assert labels_by_class == {f"class_{i:02d}": {i} for i in range(5)}
    assert len(keys) == len(set(keys)) == 120
    # Globally shuffled: the first shard mixes classes.
    with tarfile.open(out / "train-000000.tar") as tar:
        first = {tar.extractfile(m).read() for m in tar if m.name.endswith(".cls")}
    assert len(first) >= 3


def test_same_seed_same_bytes_other_seed_other_order(small_corpus, tmp_path):
    shard(small_corpus, tmp_path / "a")
    shard(small_corpus, tmp_path / "b")
    shard(small_corpus, tmp_path / "c", "--seed", "7")
    a, b, c = (tree_bytes(tmp_path / n) for n in "abc")
    assert a == b
    assert a["train-000000.tar"] != c["train-000000.tar"]


def test_workers_do_not_change_output(small_corpus, tmp_path):
    vitforge("shard", small_corpus, tmp_path / "w1", "--shard-samples", "16", "--workers", "1")
    vitforge("shard", small_corpus, tmp_path / "w2", "--shard-samples", "16", "--workers", "2")
    assert tree_bytes(tmp_path / "w1") == tree_bytes(tmp_path / "w2")


def test_parts_then_merge_equal_one_run(small_corpus, tmp_path):
    shard(small_corpus, tmp_path / "whole")
    parts = tmp_path / "parts"
    for part in (2, 0):
        result = shard(small_corpus, parts, "--num-parts", "3", "--part", str(part))
        assert "other parts are still running" in result.stdout
    assert not (parts / "dataset.json").exists()
    early = vitforge("shard", "merge", parts, check=False)
    assert early.returncode == 2 and "not finished" in early.stderr and "train-000002.tar" in early.stderr
    # The last part comes from a SLURM array task id, as a job array would run it.
    shard(small_corpus, parts, "--num-parts", "3", env={"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_MIN": "4"})
    vitforge("shard", "merge", parts)
    assert without_plan(tree_bytes(parts)) == without_plan(tree_bytes(tmp_path / "whole"))


def test_byte_target_closes_shards(small_corpus, tmp_path):
    out = tmp_path / "out"
    vitforge("shard", small_corpus, out, "--shard-bytes", "40KiB", "--workers", "1")
    manifest = json.loads((out / "dataset.json").read_text())
    sizes = [s["bytes"] for s in manifest["shards"]]
    assert len(sizes) > 3 and sum(s["samples"] for s in manifest["shards"]) == 120
    # Planned from source sizes plus tar overhead: every shard but the last lands near the target.
    assert all(20_000 < size < 60_000 for size in sizes[:-1])


def test_rerun_after_completion_rebuilds_nothing(small_corpus, tmp_path):
    out = tmp_path / "out"
    shard(small_corpus, out)
    before = {p: p.stat().st_mtime_ns for p in out.glob("*.tar")}
    result = shard(small_corpus, out)
    assert "built 0 shards, 8 already complete" in result.stdout
    assert {p: p.stat().st_mtime_ns for p in out.glob("*.tar")} == before


def test_changed_parameters_refuse_to_mix(small_corpus, tmp_path):
    out = tmp_path / "out"
    shard(small_corpus, out)
    result = vitforge("shard", small_corpus, out, "--shard-samples", "16", "--seed", "3", check=False)
    assert result.returncode == 2
    assert "other parameters" in result.stderr and "seed" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_kill_9_at_random_points_then_rerun_is_byte_identical(small_corpus, tmp_path, seed):
    reference = tmp_path / "reference"
    vitforge("shard", small_corpus, reference, "--shard-samples", "4", "--workers", "1")
    out = tmp_path / "killed"
    rng = random.Random(seed)
    cmd = [sys.executable, "-m", "vitforge", "shard", str(small_corpus), str(out), "--shard-samples", "4",
           "--workers", str(1 + seed % 2)]
    kills = 0
    for _ in range(3):
        # Kill once a random number of shards is done, plus a random few milliseconds: mid-shard,
        # mid-upload, mid-record, wherever that lands.
        target = rng.randrange(1, 25)
        process = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while process.poll() is None and len(list(out.glob("_work/shards/*.json"))) < target:
            time.sleep(0.005)
        time.sleep(rng.uniform(0, 0.03))
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
            kills += 1
        process.wait()
    vitforge(*cmd[3:])
    assert kills >= 2
    assert tree_bytes(out) == tree_bytes(reference)


def test_killed_midway_leaves_no_shard_that_looks_complete(small_corpus, tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "vitforge", "shard", str(small_corpus), str(out), "--shard-samples", "2",
           "--workers", "1"]
    process = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not list(out.glob("_work/shards/*.json")) and time.monotonic() < deadline:
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not (out / "dataset.json").exists()
    # Every shard visible under its final name has its index and record; its bytes match the record.
    for record_path in out.glob("_work/shards/*.json"):
        record = json.loads(record_path.read_text())
        assert (out / record["name"]).stat().st_size == record["bytes"]
    assert vitforge("shard", "info", out, check=False).returncode == 2


def test_verify_passes_then_names_each_problem(small_corpus, tmp_path):
    out = tmp_path / "out"
    shard(small_corpus, out)
    ok = vitforge("shard", "verify", out)
    assert "verified 8 shards, 120 samples: all good" in ok.stdout
    # Flip a byte inside an image of shard 1, truncate shard 3, and damage shard 5's index.
    with tarfile.open(out / "train-000001.tar") as tar:
        member = next(m for m in tar if m.name.endswith(".jpg"))
    with open(out / "train-000001.tar", "r+b") as f:
        f.seek(member.offset_data + member.size // 2)
        f.write(b"\xff\xd9" * 32)  # end-of-image markers inside the entropy-coded data
    data = (out / "train-000003.tar").read_bytes()
    (out / "train-000003.tar").write_bytes(data[: len(data) // 2])
    idx = (out / "train-000005.idx").read_text().splitlines()
    idx[1] = idx[1].replace(" ", "  ", 1)
    (out / "train-000005.idx").write_text("\n".join(idx) + "\n")
    bad = vitforge("shard", "verify", out, check=False)
    assert bad.returncode == 1
    problems = [line for line in bad.stdout.splitlines() if line.startswith("PROBLEM")]
    assert any("train-000001.tar: sha256" in p for p in problems)
    assert any(f"train-000001.tar: sample {member.name.split('.')[0]}: image does not decode" in p for p in problems), problems
    assert any("train-000003.tar" in p and "bytes" in p for p in problems)
    assert any("train-000005.idx" in p for p in problems)
    assert not any("train-000002" in p for p in problems)


def test_info_summarises(small_corpus, tmp_path):
    out = tmp_path / "out"
    shard(small_corpus, out)
    text = vitforge("shard", "info", out).stdout
    assert "120 in 8 shards" in text
    assert "120 = 120 packed + 0 rejected + 0 duplicates" in text
    assert "classes      5; samples per class min 24, median 24, max 24" in text
    assert "shard size histogram" in text and "image size histogram" in text
    manifest = json.loads((out / "dataset.json").read_text())
    for name in ("image_bytes", "short_side"):
        bands = {int(k): v for k, v in manifest["histograms"][name].items()}
        assert sum(bands.values()) == 120 and all(k & (k - 1) == 0 and k > 0 for k in bands)
    # The generated images are 64x48 +-10%: their shorter sides fall in the 32-63 px band.
    assert manifest["histograms"]["short_side"] == {"32": 120}


def test_dedup_reports_duplicates(small_corpus, tmp_path):
    src = tmp_path / "src"
    import shutil

    shutil.copytree(small_corpus, src)
    first = sorted((src / "class_01").iterdir())[0]
    shutil.copy(first, src / "class_01" / "zz_copy.jpg")
    shutil.copy(first, src / "class_03" / "zz_copy_in_other_class.jpg")
    result = vitforge("shard", src, tmp_path / "out", "--shard-samples", "16", "--dedup", "--workers", "2")
    assert "122 inputs = 120 packed + 0 rejected + 2 duplicates" in result.stdout
    duplicates = [json.loads(l) for l in (tmp_path / "out" / "duplicates.jsonl").read_text().splitlines()]
    assert sorted(Path(d["source"]).name for d in duplicates) == ["zz_copy.jpg", "zz_copy_in_other_class.jpg"]
    assert {d["duplicate_of"] for d in duplicates} == {str(first)}
    no_dedup = vitforge("shard", src, tmp_path / "out2", "--shard-samples", "16")
    assert "122 inputs = 122 packed" in no_dedup.stdout


@pytest.mark.parametrize("args, message", [
    (["shard", "/nonexistent/corpus", "OUT"], "not a folder"),
    (["shard", "SRC", "OUT", "--part", "3", "--num-parts", "2"], "--part 3 is outside"),
    (["shard", "SRC", "OUT", "--shard-bytes", "lots"], "is not a size"),
    (["shard", "SRC", "OUT", "--prefix", "a.b"], "--prefix"),
    (["shard", "verify", "/nonexistent/out"], "no dataset manifest"),
    (["shard", "merge", "/nonexistent/out"], "no shard plan"),
])
def test_bad_arguments_give_clear_errors(small_corpus, tmp_path, args, message):
    args = [str(small_corpus) if a == "SRC" else str(tmp_path / "o") if a == "OUT" else a for a in args]
    result = vitforge(*args, check=False)
    assert result.returncode != 0
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_help_lists_subcommands():
    text = vitforge("shard", "--help").stdout
    for word in ("merge DEST", "verify DEST", "info DEST", "--num-parts", "--dedup", "--max-side", "s3://"):
        assert word in text
    assert "shard" in vitforge("--help").stdout


def test_no_temporaries_left_behind(small_corpus, tmp_path):
    out = tmp_path / "out"
    shard(small_corpus, out)
    leftovers = [p for p in out.rglob("*") if "partial" in p.name or p.name == "tmp"]
    assert leftovers == []
    assert sorted(os.listdir(out / "_work")) == ["plan", "shards"]
    assert sorted(os.listdir(out / "_work" / "plan")) == ["duplicates.jsonl.gz", "header.json",
                                                          "part-00000.jsonl.gz"]


def _children(pid: int) -> set[int]:
    found = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        found |= {int(c) for c in (task / "children").read_text().split()}
    return found


def test_kill_9_leaves_no_worker_processes(tmp_path):
    from vitforge.synthetic import write_class_folders

    src = tmp_path / "src"
    write_class_folders(str(src), num_classes=4, per_class=150, size=(320, 240))
    process = subprocess.Popen([sys.executable, "-m", "vitforge", "shard", str(src), str(tmp_path / "out"),
                                "--workers", "2", "--shard-samples", "50"], cwd=REPO,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    workers: set[int] = set()
    deadline = time.monotonic() + 60
    while len(workers) < 2 and process.poll() is None and time.monotonic() < deadline:
        workers |= _children(process.pid)
        time.sleep(0.01)
    assert len(workers) >= 2, "the workers never started"
    process.send_signal(signal.SIGKILL)
    process.wait()
    deadline = time.monotonic() + 10
    while any(map(_running, workers)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [w for w in workers if _running(w)] == []


def _running(pid: int) -> bool:
    """Alive and not a zombie waiting to be reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_order_does_not_depend_on_where_the_corpus_is_mounted(small_corpus, tmp_path):
    import shutil

    moved = tmp_path / "elsewhere" / "deeper"
    shutil.copytree(small_corpus, moved)
    shard(small_corpus, tmp_path / "a")
    shard(moved, tmp_path / "b")
    relative = [[Path(s["info"]["source"]).relative_to(root).as_posix() for s in dataset_samples(out)]
                for root, out in ((small_corpus, tmp_path / "a"), (moved, tmp_path / "b"))]
    assert relative[0] == relative[1]
