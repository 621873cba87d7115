"""The sharder's listing streams: a manifest or a folder tree goes into the planner's columns without
a Python object per input held, and in the order (and with the class ids) the listing always had."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from common.cli import REPO
from vitforge.core import store_s3
from vitforge.shards.sources import list_corpus

ROWS = 200_000

# The planner's own path (build._make_plan): list, then drain into the columns. A small manifest of
# the same kind first, so that lazy imports and allocator pools are not counted as growth. VmHWM,
# not ru_maxrss: a child's ru_maxrss starts at its parent's (pytest's) peak, which hides any growth.
DRAIN = """
import sys
from vitforge.shards.plan import Inputs
from vitforge.shards.sources import list_corpus
def peak():
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM"))
Inputs.of(list_corpus(sys.argv[1]).records, seed=0)
before = peak()
inputs = Inputs.of(list_corpus(sys.argv[2]).records, seed=0)
print(len(inputs), inputs.nbytes(), peak() - before)
"""


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_a_large_manifest_lists_in_little_more_than_its_columns(tmp_path, kind):
    # ImageNet-like rows; the images need not exist (their sizes are 0, as for any missing input).
    paths = [f"img/n{i % 1000:08d}/n{i % 1000:08d}_{i:09d}.JPEG" for i in range(ROWS)]
    labels = [i % 1000 for i in range(ROWS)]
    manifests = []
    for rows in (1000, ROWS):
        manifests.append(tmp_path / f"list{rows}.{kind}")
        if kind == "jsonl":
            manifests[-1].write_text("".join(json.dumps({"path": p, "label": c}) + "\n"
                                             for p, c in zip(paths[:rows], labels[:rows])))
        else:
            pq.write_table(pa.table({"path": paths[:rows], "label": labels[:rows]}), manifests[-1],
                           row_group_size=50_000)
    result = subprocess.run([sys.executable, "-c", DRAIN, *map(str, manifests)], capture_output=True, text=True,
                            cwd=REPO, timeout=300, check=True)
    count, columns, grown = map(int, result.stdout.split())
    assert count == ROWS
    # Measured: the columns are ~100 bytes per row and the listing grows the process by about them
    # (JSONL ~21 MB; Parquet ~51 MB, ~30 MB of it arrow's pool, whatever the row count). A row dict
    # and a SourceRecord per row held until the end (the listing before it streamed): ~170 MB.
    assert grown < 2 * columns + 64 * 2**20, f"listing {ROWS} rows grew RSS by {grown / 2**20:.0f} MB"


def _touch(path, data: bytes = b"x") -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


@pytest.fixture
def tricky_tree(tmp_path):
    """Names whose order changes if a folder's entries are sorted by name instead of by full path:
    "-" and "." sort before "/", "0" after it; a class without images takes no id."""
    src = tmp_path / "tree"
    for rel in ["a/1.jpg", "a/1-2.jpg", "a/sub/3.png", "a/sub-x.jpg", "a/sub.jpg", "a/sub0/5.jpg",
                "a/sub/deeper/4.JPEG", "a/notes.txt", "a-b/x.jpg", "0_empty/readme.txt", "b/y.png", "top.jpg"]:
        _touch(src / rel, rel.encode())
    return src


LABELLED = [("a/1-2.jpg", 0), ("a/1.jpg", 0), ("a/sub-x.jpg", 0), ("a/sub.jpg", 0), ("a/sub/3.png", 0),
            ("a/sub/deeper/4.JPEG", 0), ("a/sub0/5.jpg", 0), ("a-b/x.jpg", 1), ("b/y.png", 2)]


def test_a_folder_tree_lists_in_full_path_order_with_the_sorted_class_ids(tricky_tree):
    corpus = list_corpus(str(tricky_tree))
    records = [(r.name, r.label, r.size, r.source) for r in corpus.records]
    # Class by class in name order ("a" before "a-b"), each class in relative-path order.
    assert records == [(rel, label, len(rel), str(tricky_tree / rel)) for rel, label in LABELLED]
    assert corpus.classes == ["a", "a-b", "b"]
    # A class map given: its ids; a class folder outside it is a reject, not a new class.
    mapped = list_corpus(str(tricky_tree), classes=["b", "a"])
    assert [(r.name, r.label, r.problem and r.problem[0]) for r in mapped.records] == [
        (rel, {"a": 1, "b": 0}.get(rel.split("/")[0]), None if rel.startswith(("a/", "b/")) else "label_unknown")
        for rel, _ in LABELLED]
    # Unlabelled: every image at any depth, in relative-path order ("a-b/" before "a/").
    unlabelled = [r.name for r in list_corpus(str(tricky_tree), labelled=False).records]
    assert unlabelled == sorted([rel for rel, _ in LABELLED] + ["top.jpg"])


def test_a_manifest_lists_rows_in_order_with_ids_from_every_label(tmp_path):
    _touch(tmp_path / "img" / "1.jpg", b"12345")
    rows = [{"path": "img/1.jpg", "label": "dog", "w": 3}, {"path": "img/2.jpg", "label": "cat"},
            {"path": "", "label": "cat"}, {"path": "img/1.jpg", "label": None}, {"path": "../x.jpg", "label": "emu"}]
    manifest = tmp_path / "list.jsonl"
    manifest.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    corpus = list_corpus(str(manifest))
    assert corpus.classes == ["cat", "dog", "emu"]  # known before the first record: ids from all labels
    records = [(r.name, r.label, r.size, r.meta, r.problem and r.problem[0]) for r in corpus.records]
    assert records == [("img/1.jpg", 1, 5, {"w": 3}, None), ("img/2.jpg", 0, 0, {}, None),
                       ("", 0, 0, {}, "missing_path"), ("img/1.jpg", None, 0, {}, "label_unknown"),
                       ("../x.jpg", 2, 0, {}, "outside_root")]


def test_an_s3_tree_lists_page_by_page_in_the_local_order(tricky_tree, s3_env, s3_server, bucket, monkeypatch):
    for path in sorted(p for p in tricky_tree.rglob("*") if p.is_file()):
        key = f"raw/{path.relative_to(tricky_tree).as_posix()}"
        s3_server["client"].put_object(Bucket=bucket, Key=key, Body=path.read_bytes())
    monkeypatch.setattr(store_s3, "LIST_PAGE_KEYS", 2)  # several pages per class, and for the class names
    for labelled in (True, False):
        local = list_corpus(str(tricky_tree), labelled=labelled)
        remote = list_corpus(f"s3://{bucket}/raw", labelled=labelled)
        assert [(r.name, r.label, r.size, r.source) for r in remote.records] == [
            (r.name, r.label, r.size, f"s3://{bucket}/raw/{r.name}") for r in local.records]
        assert remote.classes == local.classes
