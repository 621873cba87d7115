"""The corrupt-input zoo: every item is normalised or rejected with its reason, the run never
crashes, and inputs = packed + rejected + duplicates."""

from __future__ import annotations

import io
import json
import os
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from common.checks import dataset_samples
from common.cli import vitforge
from common.zoo import NON_UTF8_NAME, good_pixels, write_zoo
from vitforge.synthetic import jpeg_bytes

# As root, permission bits do not stop reads; dropping the DAC override capabilities makes root
# obey them, so the unreadable file really is unreadable (EACCES from the kernel, no mock).
AS_UNPRIVILEGED = (["setpriv", "--bounding-set=-dac_override,-dac_read_search",
                    "--inh-caps=-dac_override,-dac_read_search"] if os.geteuid() == 0 else [])


def read_samples(out) -> dict[str, dict]:
    """source file name -> sample, with the image opened."""
    return {sample["info"]["source"].rsplit("/", 1)[-1]: {**sample, "image": Image.open(io.BytesIO(sample["image_bytes"]))}
            for sample in dataset_samples(out)}


@pytest.fixture
def zoo(tmp_path):
    src = tmp_path / "src"
    expected = write_zoo(src)
    (src / "zoo").chmod(0o755)
    yield src, expected
    os.chmod(src / "zoo" / "unreadable.jpg", 0o644)


def test_every_zoo_item_is_normalised_or_rejected_with_its_reason(zoo, tmp_path):
    src, expected = zoo
    out = tmp_path / "out"
    result = vitforge("shard", src, out, "--min-side", "8", "--shard-samples", "4", "--workers", "2",
                      prefix=AS_UNPRIVILEGED)
    packed = [n for n, o in expected.items() if not o.startswith("rejected")]
    rejected = [n for n, o in expected.items() if o.startswith("rejected")]
    assert (f"{len(expected)} inputs = {len(packed)} packed + {len(rejected)} rejected + 0 duplicates"
            in result.stdout)
    rejects = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    by_name = {r["source"].rsplit("/", 1)[-1]: r for r in rejects}
    assert sorted(by_name) == sorted(rejected)
    for name in rejected:
        assert by_name[name]["reason"] == expected[name].split(":", 1)[1], by_name[name]
        assert by_name[name]["detail"]
    assert "Permission denied" in by_name["unreadable.jpg"]["detail"]
    assert "symbolic links" in by_name["loop_a.jpg"]["detail"]
    samples = read_samples(out)
    shown_non_utf8 = NON_UTF8_NAME.decode("utf-8", "backslashreplace")
    assert sorted(samples) == sorted(shown_non_utf8 if n == os.fsdecode(NON_UTF8_NAME) else n for n in packed)
    for name, outcome in expected.items():
        if outcome.startswith("normalised:"):
            assert outcome.split(":", 1)[1] in samples[name]["info"]["normalised"], (name, samples[name]["info"])
    for sample in samples.values():
        sample["image"].load()
        assert sample["image"].mode == "RGB"
        assert sample["cls"] == 0
    # Kept as they were: clean JPEGs are packed byte for byte.
    assert samples["good.jpg"]["info"]["sha256"] == samples[shown_non_utf8]["info"]["sha256"]
    assert "normalised" not in samples["good.jpg"]["info"]
    # EXIF orientation 6 applied: 80x40 stored pixels become a 40x80 upright image.
    assert samples["exif_rotated.jpg"]["image"].size == (40, 80)
    # 16-bit scaled to 8-bit, not clipped: the ramp still spans the range.
    sixteen = np.asarray(samples["sixteen_bit.png"]["image"])
    assert sixteen.min() == 0 and 240 <= sixteen.max() <= 255 and 100 < sixteen.mean() < 150
    # Alpha composited on white: the fully transparent top row is white.
    alpha = np.asarray(samples["alpha.png"]["image"])
    assert (alpha[0] >= 250).all() and not (alpha[-1] >= 250).all()
    assert samples["alpha.png"]["ext"] == "png" and samples["cmyk.jpg"]["ext"] == "jpg"
    assert vitforge("shard", "verify", out).returncode == 0


def test_format_jpeg_and_max_side_reencode_and_shrink_every_image(zoo, tmp_path):
    src, _ = zoo
    big = src / "zoo" / "big.png"
    Image.fromarray(good_pixels(1, (900, 300))).save(big)
    out = tmp_path / "out"
    vitforge("shard", src, out, "--format", "jpeg", "--max-side", "300", "--quality", "80",
             "--min-side", "8", "--workers", "1", prefix=AS_UNPRIVILEGED)
    samples = read_samples(out)
    assert {s["ext"] for s in samples.values()} == {"jpg"}
    assert samples["big.png"]["image"].size == (300, 100)
    assert samples["big.png"]["info"]["source_width"] == 900
    assert all(max(s["image"].size) <= 300 for s in samples.values())


def _manifest_rows(folder):
    images = folder / "images"
    images.mkdir()
    rows = []
    for i, label in enumerate(["cat", "dog", "cat", "dog", "cat"]):
        (images / f"{i}.jpg").write_bytes(jpeg_bytes(good_pixels(i % 2)))
        rows.append({"path": f"images/{i}.jpg", "label": label, "caption": f"picture {i}"})
    rows.append({"path": "images/missing.jpg", "label": "cat", "caption": "gone"})
    rows.append({"path": "images/0.jpg", "label": "horse", "caption": "unknown class"})
    rows.append({"path": "images/1.jpg", "label": "", "caption": "no label"})
    return rows


@pytest.mark.parametrize("kind", ["csv", "jsonl", "parquet"])
def test_manifests_with_missing_files_and_unknown_labels(tmp_path, kind):
    rows = _manifest_rows(tmp_path)
    classes = tmp_path / "classes.txt"
    classes.write_text("cat\ndog\n")
    path = tmp_path / f"list.{kind}"
    if kind == "csv":
        path.write_text("path,label,caption\n" + "".join(f"{r['path']},{r['label']},{r['caption']}\n" for r in rows))
    elif kind == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        pq.write_table(pa.Table.from_pylist(rows), path)
    out = tmp_path / "out"
    result = vitforge("shard", path, out, "--classes", classes, "--workers", "1")
    assert "8 inputs = 5 packed + 3 rejected + 0 duplicates" in result.stdout
    rejects = {r["detail"].split(":")[0] if r["reason"] != "unreadable" else "missing": r
               for r in map(json.loads, (out / "rejects.jsonl").read_text().splitlines())}
    reasons = sorted(r["reason"] for r in rejects.values())
    assert reasons == ["label_unknown", "label_unknown", "unreadable"]
    assert any("'horse'" in r["detail"] for r in rejects.values())
    assert any("missing.jpg" in r["source"] and "No such file" in r["detail"] for r in rejects.values())
    samples = read_samples(out)
    assert {name: s["cls"] for name, s in samples.items()} == {"0.jpg": 0, "1.jpg": 1, "2.jpg": 0, "3.jpg": 1, "4.jpg": 0}
    assert samples["2.jpg"]["info"]["meta"] == {"caption": "picture 2"}
    assert json.loads((out / "dataset.json").read_text())["classes"] == ["cat", "dog"]


def test_manifest_class_map_from_labels_and_integer_labels(tmp_path):
    rows = _manifest_rows(tmp_path)[:5]
    (tmp_path / "names.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    vitforge("shard", tmp_path / "names.jsonl", tmp_path / "a", "--workers", "1")
    assert json.loads((tmp_path / "a" / "dataset.json").read_text())["classes"] == ["cat", "dog"]
    numbered = [{**r, "label": 3 if r["label"] == "dog" else 0} for r in rows] + [
        {"path": "images/0.jpg", "label": -1, "caption": "negative"}]
    (tmp_path / "ids.jsonl").write_text("".join(json.dumps(r) + "\n" for r in numbered))
    result = vitforge("shard", tmp_path / "ids.jsonl", tmp_path / "b", "--workers", "1")
    assert "6 inputs = 5 packed + 1 rejected" in result.stdout
    manifest = json.loads((tmp_path / "b" / "dataset.json").read_text())
    assert manifest["num_classes"] == 4 and manifest["class_counts"] == [3, 0, 0, 2]


@pytest.mark.parametrize("content, message", [
    ("path,label\n", "no rows"),
    ("file,label\nimages/0.jpg,cat\n", "no column 'path'"),
])
def test_bad_manifests_fail_clearly(tmp_path, content, message):
    (tmp_path / "bad.csv").write_text(content)
    result = vitforge("shard", tmp_path / "bad.csv", tmp_path / "out", check=False)
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr


def test_broken_jsonl_names_the_line(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"path": "a.jpg", "label": 0}\n{"path": \n')
    result = vitforge("shard", tmp_path / "bad.jsonl", tmp_path / "out", check=False)
    assert result.returncode == 2 and "bad.jsonl:2: not valid JSON" in result.stderr


def test_classes_from_another_dataset_keep_its_ids_and_count_absent_ones_as_zero(tmp_path, small_corpus):
    train = tmp_path / "train"
    vitforge("shard", small_corpus, train, "--workers", "1")
    val_src = tmp_path / "val"
    shutil.copytree(small_corpus / "class_03", val_src / "class_03")
    shutil.copytree(small_corpus / "class_01", val_src / "class_01")
    vitforge("shard", val_src, tmp_path / "val_out", "--classes", train / "dataset.json", "--workers", "1")
    manifest = json.loads((tmp_path / "val_out" / "dataset.json").read_text())
    assert manifest["classes"] == [f"class_{i:02d}" for i in range(5)]
    assert manifest["class_counts"] == [0, 24, 0, 24, 0]
