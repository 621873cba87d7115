"""Property tests of the small pieces: tar writing, DALI index, shard planning."""

from __future__ import annotations

import gzip
import io
import json
import random
import tarfile

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vitforge.shards.plan import SAMPLE_OVERHEAD, make_plan
from vitforge.shards.sources import Corpus, SourceRecord
from vitforge.shards.tarfile_writer import FIXED_MTIME, TarShardWriter, _header, index_path_for

keys = st.text("0123456789abcdefghij_-", min_size=1, max_size=20)
member_data = st.binary(max_size=3000)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(keys, member_data, member_data), min_size=1, max_size=8, unique_by=lambda t: t[0]))
def test_written_tar_reads_back_and_index_points_at_the_data(samples):
    out = io.BytesIO()
    writer = TarShardWriter(out)
    for key, image, label in samples:
        writer.write({"__key__": key, "jpg": image, "cls": label})
    writer.close()
    data = out.getvalue()
    assert len(data) % 10240 == 0 and writer.offset == len(data)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        members = [(m.name, tar.extractfile(m).read(), m.mtime) for m in tar]
    assert members == [(f"{k}.{e}", d, FIXED_MTIME) for k, i, c in samples for e, d in (("jpg", i), ("cls", c))]
    lines = writer.dali_index().decode().splitlines()
    assert lines[0] == f"v1.2 {len(samples)}"
    for line, (key, image, label) in zip(lines[1:], samples):
        fields = line.split(" ")
        for (ext, offset, size, name), expected in zip(zip(*[iter(fields)] * 4), (image, label)):
            assert name.startswith(key + ".") and ext == name.split(".", 1)[1]
            assert data[int(offset):int(offset) + int(size)] == expected


@settings(max_examples=200, deadline=None)
@given(st.text("abcdefghijklmnopqrstuvwxyz0123456789._-", min_size=1, max_size=100), st.integers(0, 8**11 - 1))
def test_header_template_equals_tarfile(name, size):
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode, info.uid, info.gid, info.uname, info.gname = size, FIXED_MTIME, 0o644, 0, 0, "", ""
    assert _header(name, size) == info.tobuf(format=tarfile.USTAR_FORMAT)


def test_key_with_dot_is_refused():
    with pytest.raises(ValueError, match="'a.b'"):
        TarShardWriter(io.BytesIO()).write({"__key__": "a.b", "jpg": b""})


def test_index_name_follows_wds2idx():
    assert index_path_for("train-000001.tar") == "train-000001.idx"
    assert index_path_for("a/b.c/train-000001.tar") == "a/b.c/train-000001.idx"


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 5000), min_size=1, max_size=200), st.integers(0, 3),
       st.one_of(st.none(), st.integers(1, 20)), st.one_of(st.none(), st.integers(3000, 40000)))
def test_plan_respects_limits_and_ignores_listing_order(sizes, seed, per_shard, shard_bytes):
    if per_shard is None and shard_bytes is None:
        per_shard = 7
    records = [SourceRecord(f"/data/c/{i}.jpg", i % 3, size) for i, size in enumerate(sizes)]
    plan = make_plan(Corpus(records, ["a", "b", "c"]), {}, seed=seed, shard_bytes=shard_bytes,
                     shard_samples=per_shard, dedup=False)
    shuffled = records[:]
    random.Random(seed).shuffle(shuffled)
    again = make_plan(Corpus(shuffled, ["a", "b", "c"]), {}, seed=seed, shard_bytes=shard_bytes,
                      shard_samples=per_shard, dedup=False)
    assert plan.slice_bytes(0, 1) == again.slice_bytes(0, 1)
    # One row per item: [shard, key, source, label, meta, problem].
    rows = [json.loads(line) for line in gzip.decompress(plan.slice_bytes(0, 1)).splitlines()]
    shards = [[row for row in rows if row[0] == i] for i in range(plan.num_shards)]
    assert sorted(row[2] for row in rows) == sorted(r.source for r in records)
    size_of = {r.source: r.size + SAMPLE_OVERHEAD for r in records}
    for shard in shards:
        assert shard
        if per_shard:
            assert len(shard) <= per_shard
        if shard_bytes and len(shard) > 1:
            assert sum(size_of[row[2]] for row in shard) <= shard_bytes
    keys = [row[1] for row in rows]
    assert keys == sorted(keys) and len(set(keys)) == len(keys)


def test_the_benchmark_summary_reads_goal_and_comparison_lines():
    from benchmarks.summarise import goal_rows

    text = "\n".join([
        "corpus: 4000 JPEGs",
        "best CPU backend (dali-cpu) vs baseline, per CPU-second: 1.42x (goal >= 1.5x)",
        "overhead: +2.8% (goal <= 5%)  [2 ranks]",
        "(a) async stall vs its own local write: 1.00x (goal <= 1.0x; vitforge adds 5 ms)",
        "4 node(s): first-epoch egress, one order / partitioned = 4.00x (for comparison)",
    ])
    rows = goal_rows("bench", text)
    assert [(r["value"], r["goal"], r["met"]) for r in rows] == [
        ("1.42x", ">= 1.5x", False), ("+2.8%", "<= 5%", True), ("1.00x", "<= 1.0x", True), ("4.00x", "-", None)]
    assert rows[0]["figure"] == "best CPU backend (dali-cpu) vs baseline, per CPU-second"


def test_one_version_string_in_the_package_metadata_and_the_cli():
    from importlib.metadata import version

    from common.cli import vitforge
    from vitforge.core import __version__

    assert version("vitforge") == __version__  # pyproject.toml reads it from vitforge.core
    assert vitforge("--version").stdout.strip() == f"vitforge {__version__}"


PRODUCT_PACKAGES = ("core", "shards", "pipeline", "trainer", "cluster")
# The other vitforge packages each product package may import, as docs/ARCHITECTURE.md states the rules.
# Neither the `vitforge` front-end (the CLI) nor `vitforge.testing` (the local stand-ins) is among them.
MAY_IMPORT = {"core": set(), "shards": {"core"}, "pipeline": {"core", "shards"}, "trainer": {"core", "pipeline"},
              "cluster": {"core", "shards", "pipeline", "trainer"}}


def _vitforge_imports(path, package: str):
    """(line, package imported) for every vitforge import in one file, at any depth (lazy ones too),
    relative ones resolved against `package`, the dotted package the file belongs to."""
    import ast

    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names = [f"{module}.{alias.name}" for alias in node.names]  # `from vitforge import testing`
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "vitforge":
                imported = parts[1] if len(parts) > 1 else "vitforge"
                yield node.lineno, imported if imported in (*PRODUCT_PACKAGES, "testing") else "vitforge"


def _product_imports(root):
    for top in PRODUCT_PACKAGES:
        for path in sorted((root / top).rglob("*.py")):
            folders = path.relative_to(root).parent.parts  # (top, subpackage, ...)
            for line, imported in _vitforge_imports(path, ".".join(("vitforge", *folders))):
                if imported != top:
                    yield top, imported, f"{path.relative_to(root)}:{line}"


def test_the_import_walk_resolves_absolute_relative_and_lazy_imports(tmp_path):
    (tmp_path / "trainer" / "sub").mkdir(parents=True)
    (tmp_path / "trainer" / "sub" / "m.py").write_text(
        "import vitforge.core\nfrom ..pipeline_like import x\nfrom ... import shards\n"
        "def f():\n    from vitforge import testing\n    from . import y\n")
    found = sorted(_vitforge_imports(tmp_path / "trainer" / "sub" / "m.py", "vitforge.trainer.sub"))
    assert found == [(1, "core"), (2, "trainer"), (3, "shards"), (5, "testing"), (6, "trainer")]


def test_no_product_package_imports_the_local_stand_ins_or_the_cli():
    from common.cli import REPO as repo

    bad = [where for _, imported, where in _product_imports(repo) if imported in ("testing", "vitforge")]
    assert not bad, f"product code imports vitforge.testing or the vitforge front-end: {bad}"


def test_product_packages_import_only_in_the_documented_direction():
    from common.cli import REPO as repo

    bad = [f"{where}: {top} imports {imported}" for top, imported, where in _product_imports(repo)
           if imported not in MAY_IMPORT[top]]
    assert not bad, "imports against the rules in docs/ARCHITECTURE.md:\n" + "\n".join(bad)
