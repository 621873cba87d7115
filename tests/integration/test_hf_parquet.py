"""Parquet in the Hugging Face `datasets` Image layout (written here with pyarrow, bytes inside,
as DESIGN facts say `datasets` itself writes it): sharded like the same images in class folders,
rows with a path instead of bytes, bad rows and bad files, and the windowed order that keeps a
task reading each row group once."""

from __future__ import annotations

import io
import json
import os
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from common.checks import dataset_samples
from common.cli import vitforge
from vitforge.shards import hf_parquet
from vitforge.shards.hf_parquet import WINDOW_ROWS, EmbeddedImages, embedded_row
from vitforge.shards.plan import Inputs, plan_inputs
from vitforge.shards.sources import list_corpus

NAMES = ["cat", "dog", "bird"]  # ClassLabel order: not the sorted order class folders get
IMAGE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])


def _image(i: int, fmt: str) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (24 + i, 20 + i % 4), (i * 7 % 256, 60, 120)).save(out, fmt)
    return out.getvalue()


def _write(path, rows, metadata=True, label_type=pa.int64(), row_group_size=7):
    features = {"image": {"_type": "Image"}, "label": {"names": NAMES, "_type": "ClassLabel"}}
    schema = pa.schema([("image", IMAGE), ("label", label_type), ("note", pa.string())],
                       metadata={"huggingface": json.dumps({"info": {"features": features}})} if metadata else None)
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path, row_group_size=row_group_size)


def test_a_datasets_parquet_shards_to_the_same_samples_as_class_folders(tmp_path):
    rows = []
    for i in range(40):
        data = _image(i, "PNG" if i % 4 == 0 else "JPEG")
        rows.append({"image": {"bytes": data, "path": f"img{i}.jpg"}, "label": i % 3, "note": f"n{i}"})
        folder = tmp_path / "folders" / NAMES[i % 3]
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"img{i}.{'png' if i % 4 == 0 else 'jpg'}").write_bytes(data)
    on_disk = _image(99, "JPEG")  # a row with no bytes but a path, resolved beside the file
    (tmp_path / "side").mkdir()
    (tmp_path / "side" / "extra.jpg").write_bytes(on_disk)
    (tmp_path / "folders" / "dog" / "extra.jpg").write_bytes(on_disk)
    rows.append({"image": {"bytes": None, "path": "side/extra.jpg"}, "label": 1, "note": "on disk"})
    _write(tmp_path / "train.parquet", rows)
    vitforge("shard", tmp_path / "train.parquet", tmp_path / "hf", "--image-col", "image", "--shard-samples", "9",
             "--workers", "2")
    vitforge("shard", tmp_path / "folders", tmp_path / "folders_out", "--shard-samples", "9", "--workers", "1")

    def content(out):
        manifest = json.loads((out / "dataset.json").read_text())
        return manifest, Counter((manifest["classes"][s["cls"]], s["ext"], s["image_bytes"])
                                 for s in dataset_samples(out))

    hf, hf_samples = content(tmp_path / "hf")
    folders, folder_samples = content(tmp_path / "folders_out")
    assert hf["classes"] == NAMES and hf["totals"]["samples"] == 41 and hf_samples == folder_samples
    infos = {s["info"]["source"]: s["info"] for s in dataset_samples(tmp_path / "hf")}
    assert infos[f"{tmp_path}/train.parquet#row=5"]["meta"] == {"note": "n5"}
    assert infos[str(tmp_path / "side" / "extra.jpg")]["class"] == "dog"


def test_bad_rows_are_rejects_naming_the_row_and_bad_files_stop_with_one_line(tmp_path):
    rows = [{"image": {"bytes": _image(i, "JPEG"), "path": None}, "label": i % 3, "note": ""} for i in range(6)]
    rows[2]["image"]["bytes"] = b"\xff\xd8\xff\xe0 not really a jpeg"
    rows[3]["label"] = 7  # not a ClassLabel id
    rows[4]["image"] = {"bytes": None, "path": None}
    _write(tmp_path / "bad.parquet", rows)
    out = vitforge("shard", tmp_path / "bad.parquet", tmp_path / "out", "--image-col", "image", "--workers", "1")
    assert "6 inputs = 3 packed + 3 rejected" in out.stdout
    rejects = {r["source"]: r for r in map(json.loads, (tmp_path / "out" / "rejects.jsonl").read_text().splitlines())}
    assert rejects[f"{tmp_path}/bad.parquet#row=2"]["reason"] in ("corrupt", "truncated", "not_an_image")
    assert any(r["reason"] == "label_unknown" and "row 3: label 7" in r["detail"] for r in rejects.values())
    assert any(r["reason"] == "missing_path" and "row 4" in r["detail"] for r in rejects.values())
    for args, message in [
        (["--image-col", "note"], "column 'note' has type string; expected the datasets Image layout"),
        (["--image-col", "picture"], "no column 'picture' (columns: image, label, note)"),
        (["--image-col", "image", "--url-col", "note"], "--url-col and --image-col contradict each other"),
    ]:
        failed = vitforge("shard", tmp_path / "bad.parquet", tmp_path / "x", *args, check=False)
        assert failed.returncode == 2 and message in failed.stderr and "Traceback" not in failed.stderr, failed.stderr


def test_the_plan_keeps_row_group_windows_together_so_each_row_group_is_read_once(tmp_path):
    dot = _image(0, "PNG")
    rows = [{"image": {"bytes": dot, "path": None}, "label": i % 3, "note": ""} for i in range(5 * 1000)]
    _write(tmp_path / "many.parquet", rows, row_group_size=1000)
    corpus = list_corpus(str(tmp_path / "many.parquet"), image_column="image")
    plan = plan_inputs(Inputs.of(corpus.records, 0), corpus.classes, {}, shard_bytes=None, shard_samples=500,
                       dedup=False)
    order = [embedded_row(plan.inputs.source(int(i))) for i in plan.order]
    # Row groups of 1,000 rows: windows of whole groups with >= WINDOW_ROWS rows: groups 0-2 and 3-4.
    assert WINDOW_ROWS == 2048
    window = [0 if row < 3000 else 1 for row in order]
    first = window[0]
    assert window == [first] * window.count(first) + [1 - first] * window.count(1 - first)
    assert order != sorted(order)  # shuffled within each window
    reader = EmbeddedImages(str(tmp_path / "many.parquet"), "image")
    try:
        assert all(reader.read(row) == dot for row in order)
        assert reader.row_groups_read == 5
    finally:
        reader.close()


def test_windows_close_at_a_byte_budget_too_and_the_reader_holds_at_most_two(tmp_path, monkeypatch):
    """Rows of 2 KB in row groups of 100 (about 205 KB): far under WINDOW_ROWS, so only the byte
    budget (made 500 KB here) cuts windows, before the group that would pass it: two row groups
    each, the last alone. The reader, fed in plan order, reads every row group once and never
    holds more than 2 x the budget."""
    monkeypatch.setattr(hf_parquet, "WINDOW_BYTES", 500_000)
    rows = [{"image": {"bytes": os.urandom(2000), "path": None}, "label": i % 3, "note": ""} for i in range(900)]
    _write(tmp_path / "wide.parquet", rows, row_group_size=100)
    corpus = list_corpus(str(tmp_path / "wide.parquet"), image_column="image")
    plan = plan_inputs(Inputs.of(corpus.records, 0), corpus.classes, {}, shard_bytes=None, shard_samples=50,
                       dedup=False)
    order = [embedded_row(plan.inputs.source(int(i))) for i in plan.order]
    windows = [row // 200 for row in order]  # groups 0-1, 2-3, 4-5, 6-7, 8
    runs = [w for n, w in enumerate(windows) if n == 0 or windows[n - 1] != w]
    assert sorted(runs) == [0, 1, 2, 3, 4]  # each window's rows together
    reader = EmbeddedImages(str(tmp_path / "wide.parquet"), "image")
    held = []
    try:
        for row in order:
            assert reader.read(row) == rows[row]["image"]["bytes"]
            held.append(sum(v.nbytes for v in reader._cache.values()))
        assert reader.row_groups_read == 9 and max(held) <= 2 * 500_000
    finally:
        reader.close()


def test_dedup_compares_the_embedded_images(tmp_path):
    images = [_image(i, "JPEG") for i in range(5)]
    rows = [{"image": {"bytes": images[i % 5], "path": None}, "label": i % 3, "note": f"n{i}"} for i in range(8)]
    (tmp_path / "side.jpg").write_bytes(images[1])  # a path row whose file repeats an embedded image
    rows.append({"image": {"bytes": None, "path": "side.jpg"}, "label": 0, "note": "on disk"})
    _write(tmp_path / "dups.parquet", rows)
    out = vitforge("shard", tmp_path / "dups.parquet", tmp_path / "out", "--image-col", "image", "--dedup",
                   "--workers", "1")
    manifest = json.loads((tmp_path / "out" / "dataset.json").read_text())
    assert manifest["totals"]["samples"] == 5 and manifest["totals"]["duplicates"] == 4, out.stdout
    duplicates = {d["source"]: d["duplicate_of"]
                  for d in map(json.loads, (tmp_path / "out" / "duplicates.jsonl").read_text().splitlines())}
    parquet = f"{tmp_path}/dups.parquet"
    assert duplicates == {f"{parquet}#row=5": f"{parquet}#row=0", f"{parquet}#row=6": f"{parquet}#row=1",
                          f"{parquet}#row=7": f"{parquet}#row=2", str(tmp_path / "side.jpg"): f"{parquet}#row=1"}

