"""What the sharder lists as its inputs: folder symlinks are not followed by default (a link to `/`
must not walk the machine), unreadable folders are rejects rather than the end of the run, and
manifest columns of the wrong type stop the run with one line naming the column."""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from common.checks import dataset_samples
from common.cli import vitforge
from test_zoo import AS_UNPRIVILEGED
from vitforge.synthetic import jpeg_bytes, write_class_folders
from common.zoo import good_pixels

# A listing that followed a link to / would take minutes; the fixed one takes seconds.
WALK_TIMEOUT = 120


def packed_sources(out) -> list[str]:
    return sorted(sample["info"]["source"] for sample in dataset_samples(out))


def rejects(out) -> list[dict]:
    return [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]


@pytest.fixture
def linked_tree(tmp_path):
    """SRC/class_00, SRC/class_01 (2 images each) and folder links that lead out of it: to a folder
    holding a marker image, to /, to SRC itself (a loop) and to a sibling class folder."""
    src = tmp_path / "src"
    write_class_folders(str(src), num_classes=2, per_class=2, size=(32, 24))
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "marker.jpg").write_bytes(jpeg_bytes(good_pixels(3, (32, 24))))
    os.symlink(outside, src / "class_00" / "elsewhere")
    os.symlink("/", src / "everything")
    os.symlink("..", src / "class_01" / "loop")
    os.symlink("../class_00", src / "class_01" / "again")
    # A symlinked file keeps working: it is an image, not a folder to walk.
    os.symlink("img_00000.jpg", src / "class_01" / "alias.jpg")
    real = sorted(str(p) for p in src.rglob("*.jpg") if not p.is_symlink()) + [str(src / "class_01" / "alias.jpg")]
    return src, outside, sorted(real)


def test_folder_links_are_not_followed_by_default(linked_tree, tmp_path):
    src, _, real = linked_tree
    out = tmp_path / "out"
    result = vitforge("shard", src, out, "--workers", "1", timeout=WALK_TIMEOUT)
    assert packed_sources(out) == real
    assert "5 inputs = 5 packed + 0 rejected" in result.stdout
    assert "skipped 4 symlinked folders" in result.stderr and "--follow-symlinks" in result.stderr
    assert json.loads((out / "dataset.json").read_text())["classes"] == ["class_00", "class_01"]
    # SRC itself may be a link: it is followed, and names the same images through it.
    (tmp_path / "src_link").symlink_to(src)
    linked = tmp_path / "linked"
    vitforge("shard", tmp_path / "src_link", linked, "--workers", "1", timeout=WALK_TIMEOUT)
    assert packed_sources(linked) == [s.replace(str(src), str(tmp_path / "src_link"), 1) for s in real]


def test_follow_symlinks_stays_inside_the_root_and_lists_each_folder_once(linked_tree, tmp_path):
    src, outside, real = linked_tree
    out = tmp_path / "out"
    result = vitforge("shard", src, out, "--follow-symlinks", "--workers", "1", timeout=WALK_TIMEOUT)
    assert packed_sources(out) == real
    assert "class_00/elsewhere" in result.stderr and "everything" in result.stderr and "--root" in result.stderr
    # Widened to SRC's parent, the link to `outside` is followed (under its class), the one to / still is not.
    wide = tmp_path / "wide"
    result = vitforge("shard", src, wide, "--follow-symlinks", "--root", tmp_path, "--workers", "1",
                      timeout=WALK_TIMEOUT)
    marker = str(src / "class_00" / "elsewhere" / "marker.jpg")
    assert packed_sources(wide) == sorted(real + [marker])
    assert "everything" in result.stderr and "class_00/elsewhere" not in result.stderr
    manifest = json.loads((wide / "dataset.json").read_text())
    assert manifest["class_counts"] == [3, 3]
    assert "--follow-symlinks" in manifest["command"]


@pytest.mark.parametrize("labels", [[], ["--no-labels"]], ids=["class_folders", "unlabelled"])
def test_unreadable_folders_and_files_are_rejects_and_the_run_goes_on(tmp_path, labels):
    src = tmp_path / "src"
    write_class_folders(str(src), num_classes=2, per_class=2, size=(32, 24))
    locked = src / "class_00" / "locked"
    locked.mkdir()
    (locked / "hidden.jpg").write_bytes(jpeg_bytes(good_pixels(0, (32, 24))))
    secret = src / "class_01" / "secret.jpg"
    secret.write_bytes(jpeg_bytes(good_pixels(1, (32, 24))))
    os.chmod(locked, 0)
    os.chmod(secret, 0)
    out = tmp_path / "out"
    try:
        result = vitforge("shard", src, out, *labels, "--workers", "1", check=False, prefix=AS_UNPRIVILEGED)
    finally:
        os.chmod(locked, 0o755)
        os.chmod(secret, 0o644)
    assert result.returncode == 0, result.stderr
    assert "6 inputs = 4 packed + 2 rejected" in result.stdout
    found = {r["source"]: r for r in rejects(out)}
    assert sorted(found) == sorted([str(locked), str(secret)])
    for reject in found.values():
        assert reject["reason"] == "unreadable" and "Permission denied" in reject["detail"], reject
    assert "folder" in found[str(locked)]["detail"]
    assert vitforge("shard", "verify", out).returncode == 0


def _write_manifest(tmp_path, kind: str, rows: list[dict], schema: pa.Schema | None = None):
    images = tmp_path / "images"
    images.mkdir(exist_ok=True)
    for i in range(3):
        (images / f"{i}.jpg").write_bytes(jpeg_bytes(good_pixels(i, (32, 24))))
    path = tmp_path / f"list.{kind}"
    if kind == "parquet":
        pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


GOOD = [{"path": f"images/{i}.jpg", "label": name} for i, name in enumerate(["cat", "dog", "cat"])]


@pytest.mark.parametrize("column, values, arrow_type", [
    ("path", [0, 1, 2], "int64"),
    ("path", [["images/0.jpg"], ["images/1.jpg"], ["images/2.jpg"]], "list<element: string>"),
    ("label", [0.0, 1.0, 0.0], "double"),
    ("label", [{"x": 1}, {"x": 2}, {"x": 1}], "struct<x: int64>"),
    ("label", [True, False, True], "bool"),
])
def test_parquet_columns_of_the_wrong_type_are_a_usage_error(tmp_path, column, values, arrow_type):
    rows = [{**row, column: value} for row, value in zip(GOOD, values)]
    path = _write_manifest(tmp_path, "parquet", rows)
    result = vitforge("shard", path, tmp_path / "out", "--workers", "1", check=False)
    assert result.returncode == 2, result.stderr
    line = [line for line in result.stderr.splitlines() if line.startswith("vitforge:")]
    assert len(line) == 1 and "Traceback" not in result.stderr, result.stderr
    assert f"list.parquet: column {column!r} has type {arrow_type}; expected string" in line[0], line[0]
    assert not (tmp_path / "out" / "dataset.json").exists()


@pytest.mark.parametrize("row, message", [
    ({"path": 7, "label": "cat"}, "list.jsonl:2: column 'path' is an integer (7); expected string"),
    ({"path": ["images/1.jpg"], "label": "cat"}, "list.jsonl:2: column 'path' is an array"),
    ({"path": "images/1.jpg", "label": 1.5},
     "list.jsonl:2: column 'label' is a float (1.5); expected string (class name) or integer (class id)"),
    ({"path": "images/1.jpg", "label": {"x": 1}}, "list.jsonl:2: column 'label' is an object ({'x': 1})"),
    ({"path": "images/1.jpg", "label": True}, "list.jsonl:2: column 'label' is a boolean (True)"),
    (["images/1.jpg", "cat"], "list.jsonl:2: not a JSON object but an array"),
])
def test_jsonl_cells_of_the_wrong_type_name_the_line_and_column(tmp_path, row, message):
    path = _write_manifest(tmp_path, "jsonl", [GOOD[0], row, GOOD[2]])
    result = vitforge("shard", path, tmp_path / "out", "--workers", "1", check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert message in result.stderr, result.stderr
    assert not (tmp_path / "out" / "dataset.json").exists()


def test_parquet_string_like_and_integer_columns_are_accepted(tmp_path):
    """Categorical (dictionary) labels as pandas writes them, large strings, integer class ids, nulls."""
    named = pa.schema([("path", pa.large_string()), ("label", pa.dictionary(pa.int32(), pa.string()))])
    path = _write_manifest(tmp_path, "parquet", GOOD, named)
    vitforge("shard", path, tmp_path / "named", "--workers", "1")
    manifest = json.loads((tmp_path / "named" / "dataset.json").read_text())
    assert manifest["classes"] == ["cat", "dog"] and manifest["class_counts"] == [2, 1]
    ids = [{"path": r["path"], "label": i % 2} for i, r in enumerate(GOOD)] + [{"path": None, "label": None}]
    path = _write_manifest(tmp_path, "parquet", ids, pa.schema([("path", pa.string()), ("label", pa.int16())]))
    result = vitforge("shard", path, tmp_path / "ids", "--workers", "1")
    assert "4 inputs = 3 packed + 1 rejected" in result.stdout
    assert json.loads((tmp_path / "ids" / "dataset.json").read_text())["classes"] == ["0", "1"]


def test_class_names_that_are_not_strings_are_a_usage_error(tmp_path):
    path = _write_manifest(tmp_path, "jsonl", GOOD)
    classes = tmp_path / "classes.json"
    classes.write_text(json.dumps(["cat", {"x": 1}]))
    result = vitforge("shard", path, tmp_path / "out", "--classes", classes, "--workers", "1", check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "classes.json: class 1 is an object ({'x': 1}); expected a string" in result.stderr, result.stderr
