"""`vitforge shard SRC DEST --extend`: versions that read as one dataset, old shards untouched,
exact dedup against what is there, pinned readers, resumes refused on a changed order, bad input."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
from PIL import Image

from common.checks import dataset_samples, tree_bytes, without_plan
from common.cli import train, vitforge
from vitforge.core import errors
from vitforge.pipeline import LoaderSpec, build_loader
from vitforge.pipeline.index import load_index
from vitforge.synthetic import write_class_folders
from vitforge.testing.local_images import start_image_server


def _jpeg(i: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (40 + i, 32), (i * 40 % 256, 90, 200 - i)).save(out, "JPEG", quality=90)
    return out.getvalue()


def shard(src, dest, *extra, check=True):
    return vitforge("shard", src, dest, "--shard-samples", "8", "--workers", "1", *extra, check=check)


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> dict[str, Path]:
    """`whole`: 4 classes x 10 images, one of them named to sort first (aardvark); `a`: the first
    6 images of the three others; `b`: the rest, aardvark among them, so b brings a new class."""
    root = tmp_path_factory.mktemp("extend")
    whole = root / "whole"
    write_class_folders(str(whole), num_classes=4, per_class=10, size=(48, 40), seed=5)
    (whole / "class_03").rename(whole / "aardvark")
    for part in ("a", "b"):
        for folder in sorted(whole.iterdir()):
            for i, image in enumerate(sorted(folder.iterdir())):
                if (part == "a") == (folder.name != "aardvark" and i < 6):
                    (root / part / folder.name).mkdir(parents=True, exist_ok=True)
                    shutil.copy(image, root / part / folder.name / image.name)
    return {"whole": whole, "a": root / "a", "b": root / "b", "root": root}


def _seen(out: Path) -> Counter:
    """What a reader sees: (class name, image sha256) per sample."""
    return Counter((s["info"]["class"], hashlib.sha256(s["image_bytes"]).hexdigest()) for s in dataset_samples(out))


def test_two_steps_read_as_one_and_the_old_shards_stay(corpora, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    shard(corpora["whole"], one)
    shard(corpora["a"], two)
    before = tree_bytes(two)
    result = shard(corpora["b"], two, "--extend")
    assert "version 2 (dataset.v2.json) added 22 inputs = 22 packed" in result.stdout, result.stdout
    after = tree_bytes(two)
    v1 = json.loads(before["dataset.json"])
    assert all(after[s["name"]] == before[s["name"]] and after[s["index"]] == before[s["index"]] for s in v1["shards"])
    assert json.loads(after["dataset.v1.json"]) == v1  # the old version's manifest, kept as it was
    v2 = json.loads(after["dataset.json"])
    assert after["dataset.v2.json"] == after["dataset.json"] and v2["version"] == 2
    one_manifest = json.loads((one / "dataset.json").read_text())
    assert _seen(two) == _seen(one) and v2["totals"]["samples"] == one_manifest["totals"]["samples"] == 40
    # Class ids stay: the old classes keep theirs, the new one is appended (one step sorts it first).
    assert v2["classes"] == v1["classes"] + ["aardvark"] and one_manifest["classes"][0] == "aardvark"
    assert dict(zip(v2["classes"], v2["class_counts"])) == dict(zip(one_manifest["classes"],
                                                                    one_manifest["class_counts"]))
    samples = dataset_samples(two)
    assert all(s["cls"] == v2["classes"].index(s["info"]["class"]) for s in samples)
    keys = [s["key"] for s in samples]
    assert keys == sorted(keys) and len(set(keys)) == 40  # numbered on: no key of version 1 reused
    assert [s["name"] for s in v2["shards"][:len(v1["shards"])]] == [s["name"] for s in v1["shards"]]
    assert [h["added"]["samples"] for h in v2["history"]] == [18, 22]
    # The same command again finds its version there and changes nothing.
    again = shard(corpora["b"], two, "--extend")
    assert tree_bytes(two) == after and "version 2 (dataset.v2.json)" in again.stdout
    assert "versions     2" in vitforge("shard", "info", two).stdout
    assert vitforge("shard", "verify", two).stdout.rstrip().endswith("40 samples: all good")
    # A late run of the first command merges nothing: version 2 stays what readers see.
    shard(corpora["a"], two)
    assert tree_bytes(two) == after
    # Once a third version is added, running the second's command again adds nothing either.
    third = corpora["root"] / "third"
    shutil.copytree(corpora["b"] / "aardvark", third / "aardvark", dirs_exist_ok=True)
    (third / "aardvark" / "img_00000.jpg").write_bytes(_jpeg(3))
    assert "version 3 (dataset.v3.json) added 10 inputs = 1 packed + 0 rejected + 9 duplicates" in shard(third, two, "--extend").stdout
    shard(corpora["b"], two, "--extend")
    assert json.loads((two / "dataset.json").read_text())["version"] == 3


@pytest.mark.parametrize("first_dedup", [True, False], ids=["digests-kept", "digests-from-shards"])
def test_an_extension_leaves_out_what_the_dataset_holds(corpora, tmp_path, first_dedup):
    """Exact duplicates of samples already in the dataset (found through the digests the first
    plan kept, or, without them, the sha256 each sample's JSON records), and within the new source."""
    out, extra = tmp_path / "out", corpora["root"] / f"extra-{first_dedup}"
    shard(corpora["a"], out, *(["--dedup"] if first_dedup else []))
    assert (out / "_work" / "plan" / "digests.bin").exists() == first_dedup
    old = next(iter(sorted((corpora["a"] / "class_01").iterdir())))
    shutil.copytree(corpora["b"], extra)
    shutil.copy(old, extra / "class_01" / "copy_of_old.jpg")
    shutil.copy(extra / "aardvark" / "img_00000.jpg", extra / "aardvark" / "twice.jpg")
    result = shard(extra, out, "--extend")
    assert "added 24 inputs = 22 packed + 0 rejected + 2 duplicates" in result.stdout, result.stdout
    by_sha = {s["info"]["sha256"]: s for s in dataset_samples(out)}
    duplicates = [json.loads(line) for line in (out / "duplicates.jsonl").read_text().splitlines()]
    against_old = next(d for d in duplicates if d["source"].endswith("copy_of_old.jpg"))
    first = by_sha[against_old["sha256"]]
    assert first["info"]["source"].endswith(f"class_01/{old.name}")
    assert against_old["duplicate_of"].endswith(f"#{first['key']}")  # SHARD#KEY of the sample kept
    within = next(d for d in duplicates if d["source"].endswith("twice.jpg"))
    assert within["duplicate_of"].endswith("aardvark/img_00000.jpg")
    assert len(by_sha) == 40


def test_a_pinned_reader_keeps_the_old_set_and_a_resume_across_versions_is_refused(corpora, tmp_path):
    out = tmp_path / "out"
    shard(corpora["a"], out)
    spec = LoaderSpec(str(out), batch_size=4, image_size=32, backend="torch", workers=0)
    saved = build_loader(spec).state_dict()
    shard(corpora["b"], out, "--extend")
    old, new = load_index(str(out / "dataset.v1.json")), load_index(str(out))
    assert (len(old), old.version, len(new), new.version) == (18, 1, 40, 2)
    assert old.shard_urls == new.shard_urls[:len(old.shard_urls)]
    # The position saved on version 1, loaded over version 2: refused, naming both and the ways on.
    with pytest.raises(Exception, match=r"version 2 of its dataset, and this run's position was saved on version 1.*"
                                        r"dataset\.v1\.json.*data\.resume_extended=true"):
        build_loader(spec).load_state_dict({**saved, "epoch": 3, "consumed": 8})
    pinned = build_loader(LoaderSpec(str(out / "dataset.v1.json"), batch_size=4, image_size=32, backend="torch",
                                     workers=0))
    pinned.load_state_dict({**saved, "epoch": 3, "consumed": 8})
    assert (pinned.epoch, pinned.consumed, pinned.num_samples) == (3, 8, 18)
    asked = build_loader(LoaderSpec(str(out), batch_size=4, image_size=32, backend="torch", workers=0,
                                    resume_extended=True))
    asked.load_state_dict({**saved, "epoch": 3, "consumed": 8})
    assert (asked.epoch, asked.consumed, asked.num_samples) == (4, 0, 40)
    # A subset of the dataset is of its version too; a state saved before versions were recorded
    # counts as another version when the sample count changed.
    subset = build_loader(LoaderSpec(str(out), batch_size=4, image_size=32, backend="torch", workers=0, subset=8))
    with pytest.raises(Exception, match="saved on version 1"):
        subset.load_state_dict({**subset.state_dict(), "dataset_version": 1})
    unversioned = {k: v for k, v in saved.items() if k != "dataset_version"}
    with pytest.raises(Exception, match="saved on version unknown"):
        build_loader(spec).load_state_dict(unversioned)
    asked.load_state_dict({**unversioned, "epoch": 3, "consumed": 8})
    assert (asked.epoch, asked.consumed) == (4, 0)
    batch = next(iter(asked))
    assert len(batch["label"]) == 4


def test_an_extension_in_parts_equals_one_run(corpora, tmp_path):
    whole, parted = tmp_path / "whole", tmp_path / "parted"
    for out in (whole, parted):
        shard(corpora["a"], out)
    shard(corpora["b"], whole, "--extend")
    first = shard(corpora["b"], parted, "--extend", "--num-parts", "2", "--part", "0")
    assert "other parts are still running" in first.stdout
    early = vitforge("shard", "merge", parted, check=False)
    assert early.returncode == errors.USAGE and "not finished yet" in early.stderr
    assert json.loads((parted / "dataset.json").read_text())["version"] == 1  # readers still see version 1
    shard(corpora["b"], parted, "--extend", "--num-parts", "2", "--part", "1")
    assert vitforge("shard", "merge", parted).stdout == shard(corpora["b"], whole, "--extend").stdout.split(
        "\n", 1)[1].replace(str(whole), str(parted))
    assert without_plan(tree_bytes(parted)) == without_plan(tree_bytes(whole))


def test_bad_extensions_are_refused_naming_the_cause(corpora, tmp_path):
    out = tmp_path / "out"
    nothing = shard(corpora["b"], tmp_path / "empty", "--extend", check=False)
    assert nothing.returncode == errors.USAGE and "no finished dataset to extend" in nothing.stderr
    shard(corpora["a"], out)
    other = shard(corpora["b"], out, "--extend", "--format", "jpeg", check=False)
    assert other.returncode == errors.USAGE and "image:" in other.stderr and "in the dataset" in other.stderr
    prefix = shard(corpora["b"], out, "--extend", "--prefix", "more", check=False)
    assert prefix.returncode == errors.USAGE and "prefix: 'train' in the dataset, 'more' here" in prefix.stderr
    alone = shard(corpora["b"], out, "--verify-existing", check=False)
    assert alone.returncode == errors.USAGE and "give --extend too" in alone.stderr
    plain = shard(corpora["b"], out, check=False)
    assert plain.returncode == errors.USAGE and "or --extend to add SRC" in plain.stderr
    # An extension under way is finished or abandoned before another starts.
    shard(corpora["b"], out, "--extend", "--num-parts", "2", "--part", "0")
    other = shard(corpora["whole"], out, "--extend", check=False)
    assert other.returncode == errors.USAGE and "has an unfinished extension, planned in _work/v2/ by `vitforge " \
        "shard" in other.stderr and "--extend`: finish it by running that command again" in other.stderr
    shutil.rmtree(out / "_work" / "v2")
    damaged = out / "train-000001.tar"
    data = bytearray(damaged.read_bytes())
    data[600] ^= 0xFF
    damaged.write_bytes(bytes(data))
    trusted = tree_bytes(out)
    refused = shard(corpora["b"], out, "--extend", "--verify-existing", check=False)
    assert refused.returncode == errors.USAGE and "train-000001.tar: sha256 differs" in refused.stderr
    assert tree_bytes(out) == trusted  # nothing planned or written


@pytest.mark.slow
def test_a_run_on_an_extended_dataset_resumes_only_pinned_or_when_asked(corpora, tmp_path):
    """Trained on version 1, the run's checkpoint does not resume over version 2 (exit 4, naming
    both versions); pinned to dataset.v1.json it resumes where it stopped; with
    data.resume_extended=true it goes on over version 2 from the next epoch."""
    shard(corpora["a"], tmp_path / "train")
    common = ("data.val=null", "model.num_classes=4", "train.global_batch=6", "train.micro_batch=6",
              "train.log_every=1")
    train(tmp_path, "ext", *common, "train.steps=2", nproc=1)
    shard(corpora["b"], tmp_path / "train", "--extend")
    refused = train(tmp_path, "ext", *common, "train.steps=4", nproc=1, check=False)
    assert refused.returncode == errors.CHECKPOINT, refused.stderr[-2000:]
    assert "is version 2 of its dataset, and this run's position was saved on version 1" in refused.stderr
    pinned = train(tmp_path, "ext", *common, "train.steps=4", f"data.train={tmp_path / 'train' / 'dataset.v1.json'}",
                   nproc=1)
    assert "at step 2" in pinned.stderr + pinned.stdout
    asked = train(tmp_path, "ext", *common, "train.steps=6", "data.resume_extended=true", nproc=1)
    assert "from the start of epoch" in asked.stderr and "at step 4" in asked.stderr + asked.stdout


def test_retry_failed_downloads_the_retryable_rejects_again_under_their_keys(corpora, tmp_path):
    """A 500 (retryable) comes through on the retry and becomes a sample under the key its reject
    had; a 404 is not asked for again; a timeout that still stalls stays a reject, and a second
    retry asks only for it. Totals keep each row once. An --extend with another list then leaves
    out a URL already in the dataset."""
    server = start_image_server({f"g{i}.jpg": _jpeg(i) for i in range(6)}, stall_s=3)
    try:
        rows = [f"img/g{i}.jpg" for i in range(4)] + ["flaky/g4.jpg", "missing/g5.jpg", "stalled/g5.jpg"]
        urls = tmp_path / "urls.jsonl"
        urls.write_text("".join(json.dumps({"url": f"{server.url}/{r}", "label": i % 2}) + "\n"
                                for i, r in enumerate(rows)))
        out = tmp_path / "out"
        # A retry takes the allowed networks from the list's version; only timing is given again.
        fetch = ["--retries", "0", "--first-byte-timeout", "1", "--workers", "1"]
        listing = ["--url-col", "url", "--shard-samples", "3", "--allow-network", "127.0.0.0/8"]
        first = vitforge("shard", urls, out, *listing, *fetch)
        assert "7 inputs = 4 packed + 3 rejected" in first.stdout, first.stdout
        keys = {r["source"].split("/", 3)[3]: r["key"] for r in map(json.loads, (out / "rejects.jsonl").open())}
        # As a 3-task array: the last task owns the one shard, builds and merges; the first starts
        # late and finds its job's retry merged (it starts no other).
        array = {"SLURM_JOB_ID": "501", "SLURM_ARRAY_JOB_ID": "500", "SLURM_ARRAY_TASK_MIN": "0"}
        retried = vitforge("shard", "--retry-failed", out, *fetch, "--num-parts", "3",
                           env={**array, "SLURM_ARRAY_TASK_ID": "2"})
        assert "7 inputs = 5 packed + 2 rejected + 0 duplicates" in retried.stdout, retried.stdout
        late = vitforge("shard", "--retry-failed", out, *fetch, "--num-parts", "3",
                        env={**array, "SLURM_JOB_ID": "503", "SLURM_ARRAY_TASK_ID": "0"})
        assert "built 0 shards" in late.stdout and "version 2 (dataset.v2.json) retried 2 rejects: 1 packed now, " \
            "1 still rejected" in late.stdout, late.stdout
        manifest = json.loads((out / "dataset.json").read_text())
        assert manifest["version"] == 2 and manifest["history"][-1]["retried"] == 2
        assert manifest["history"][-1]["command"] == "vitforge shard --retry-failed DEST"
        flaky = next(s for s in dataset_samples(out) if s["info"]["url"].endswith("flaky/g4.jpg"))
        assert flaky["key"] == keys["flaky/g4.jpg"] and flaky["cls"] == 0
        assert {r["reason"] for r in map(json.loads, (out / "rejects.jsonl").open())} == {"http_404", "timeout"}
        assert server.paths("/missing/") == ["/missing/g5.jpg"] and len(server.paths("/flaky/")) == 2
        again = vitforge("shard", "--retry-failed", out, *fetch)
        assert "7 inputs = 5 packed + 2 rejected" in again.stdout
        assert json.loads((out / "dataset.json").read_text())["history"][-1]["retried"] == 1
        assert len(server.paths("/stalled/")) == 3 and len(server.paths("/flaky/")) == 2
        # Another list: a URL already packed is a duplicate; one that timed out (a reject) is fetched again.
        more = tmp_path / "more.jsonl"
        more.write_text("".join(json.dumps({"url": f"{server.url}/{r}", "label": 1}) + "\n"
                                for r in ("img/g0.jpg", "img/g5.jpg", "stalled/g5.jpg")))
        extended = vitforge("shard", more, out, *listing, "--extend", *fetch)
        assert "10 inputs = 6 packed + 3 rejected + 1 duplicates" in extended.stdout, extended.stdout
        assert len(server.paths("/stalled/")) == 4
        # A folder dataset takes a URL list as an extension (URLs compare with URLs only).
        folder = tmp_path / "folder"
        shard(corpora["a"], folder)
        mixed = vitforge("shard", more, folder, *listing, "--extend", *fetch)
        assert "added 3 inputs = 2 packed + 1 rejected + 0 duplicates" in mixed.stdout, mixed.stdout
    finally:
        server.stop()
    refused = vitforge("shard", "--retry-failed", tmp_path / "plain", check=False)
    assert refused.returncode == errors.USAGE and "dataset.json: no dataset manifest" in refused.stderr
    shard(corpora["a"], tmp_path / "plain")
    refused = vitforge("shard", "--retry-failed", tmp_path / "plain", check=False)
    assert refused.returncode == errors.USAGE and "no version of this dataset was sharded from a URL list" in \
        refused.stderr
