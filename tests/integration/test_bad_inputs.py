"""Inputs an adversarial user tried: tars that are not WebDataset, manifest rows that escape their
folder, files whose bytes are not what their name says, decompression bombs in foreign shards."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile

import pytest

from common.cli import REPO, vitforge
from vitforge.core import errors
from vitforge.synthetic import jpeg_bytes
from common.zoo import bomb_png, good_pixels


def _tar(path, members: list[tuple[str, bytes]]) -> None:
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def _loader_error(pattern: str) -> str:
    result = vitforge("loader-bench", pattern, "--backend", "torch", "--batch", "2", "--steps", "1", "--workers", "0",
                      "--image-size", "32", check=False)
    assert result.returncode == errors.USAGE, result.stderr
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("vitforge:")]
    assert len(lines) == 1
    return lines[0]


@pytest.mark.slow
def test_tars_that_are_not_webdataset_get_one_line_naming_tar_and_member(tmp_path):
    (tmp_path / "noise-0.tar").write_bytes(os.urandom(4096))
    assert "noise-0.tar: not a tar archive" in _loader_error(str(tmp_path / "noise-*.tar"))
    jpeg = jpeg_bytes(good_pixels())
    _tar(tmp_path / "cut-0.tar", [("a.jpg", jpeg), ("a.cls", b"1"), ("b.jpg", jpeg), ("b.cls", b"2")])
    whole = (tmp_path / "cut-0.tar").read_bytes()
    cut = whole.index(jpeg, whole.index(b"b.jpg")) + len(jpeg) // 2
    (tmp_path / "cut-0.tar").write_bytes(whole[:cut])
    line = _loader_error(str(tmp_path / "cut-0.tar"))
    assert "cut-0.tar: member b.jpg is cut short" in line
    _tar(tmp_path / "nolabel-0.tar", [("a.jpg", jpeg), ("a.cls", b"1"), ("b.jpg", jpeg)])
    line = _loader_error(str(tmp_path / "nolabel-0.tar"))
    assert "nolabel-0.tar: sample b has no .cls label member" in line and ".idx" not in line


def test_manifest_rows_outside_the_root_are_rejected_even_without_validation(small_corpus, tmp_path):
    image = next(small_corpus.rglob("*.jpg"))
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "good.jpg").write_bytes(image.read_bytes())
    (folder / "notes.jpg").write_text("just text, named like an image\n")
    (folder / "list.csv").write_text("path,label\ngood.jpg,0\n../../../../../../etc/passwd,1\n/etc/shadow,1\n"
                                     "notes.jpg,0\n")
    for validate in ([], ["--no-validate"]):
        out = tmp_path / f"out{len(validate)}"
        vitforge("shard", folder / "list.csv", out, *validate, "--workers", "1")
        rejects = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
        reasons = {os.path.basename(r["source"]): r["reason"] for r in rejects}
        assert reasons == {"passwd": "outside_root", "shadow": "outside_root", "notes.jpg": "not_an_image"}, rejects
        manifest = json.loads((out / "dataset.json").read_text())
        assert manifest["totals"]["samples"] == 1
        packed = b"".join((out / s["name"]).read_bytes() for s in manifest["shards"])
        assert b"root:" not in packed
    wide = tmp_path / "wide"
    vitforge("shard", folder / "list.csv", wide, "--no-validate", "--root", "/", "--workers", "1")
    rejects = [json.loads(line) for line in (wide / "rejects.jsonl").read_text().splitlines()]
    assert {r["reason"] for r in rejects if r["source"].endswith("/etc/passwd")} == {"not_an_image"}


def test_pillows_bomb_guard_stays_on_in_loader_processes():
    code = ("from PIL import Image; default = Image.MAX_IMAGE_PIXELS; import vitforge.shards, vitforge.pipeline, "
            "vitforge.trainer; print(Image.MAX_IMAGE_PIXELS == default and default is not None)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert result.stdout.strip() == "True"


@pytest.mark.parametrize("backend", ["torch", "dali-cpu"])
def test_a_bomb_in_a_foreign_shard_is_replaced_not_decoded(tmp_path, backend):
    import resource

    from vitforge.pipeline import IGNORE_LABEL, LoaderSpec, build_loader

    jpeg = jpeg_bytes(good_pixels())
    _tar(tmp_path / "foreign-0.tar", [("a.jpg", jpeg), ("a.cls", b"1"), ("bomb.png", bomb_png(20000, 20000)),
                                      ("bomb.cls", b"2"), ("c.jpg", jpeg), ("c.cls", b"3")])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    loader = build_loader(LoaderSpec(str(tmp_path / "foreign-0.tar"), batch_size=3, image_size=32, train=False,
                                     backend=backend, workers=1))
    batch = next(iter(loader))
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    position = batch["key"].index("foreign-0.tar:bomb")
    assert batch["label"][position].item() == IGNORE_LABEL and "foreign-0.tar:bomb" in batch["bad"]
    assert grown_mb < 1000  # a decode would take 1.2 GB for these 400 million pixels
