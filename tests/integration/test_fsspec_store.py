"""Reading through fsspec (core/store_fsspec.py): every scheme without a store of its own, here
http:// (a real file server on 127.0.0.1 that answers byte ranges, vitforge.testing.local_http) and
fsspec's memory://. The read side of the store contract, the refusal of every write, a corpus
sharded from an HTTP folder, shards verified over HTTP, and a 2-rank run trained and evaluated
from http:// shards equal to the run from the same shards on disk."""

from __future__ import annotations

import hashlib
import json
import os
import threading
import uuid
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import pytest

from common.checks import assert_same_weights, losses, weights
from common.cli import EXTENSIONS, STRAIGHT, train, vitforge
from vitforge.core import PreconditionFailed, StorageError, Store, UsageError, errors, open_store
from vitforge.testing import start_local_http

TREE = {"a/1.bin": 3, "a/2.bin": 5, "b.bin": 7, "c/deep/x.bin": 11}


@pytest.fixture(scope="module")
def http_root(tmp_path_factory, data):
    """A file server on 127.0.0.1 over a folder holding the trainer corpus (`data`) and a scratch
    folder per test: (server, folder)."""
    folder = tmp_path_factory.mktemp("http-root")
    os.symlink(data, folder / "data")
    server = start_local_http(str(folder), str(tmp_path_factory.mktemp("http-logs")))
    yield server, folder
    server.stop()


@pytest.fixture(params=["http", "memory"])
def readable(request, http_root):
    """(store root URL, write(name, bytes)): a fresh folder that the test fills through the side
    door (the served folder, fsspec's memory filesystem) and vitforge reads."""
    name = uuid.uuid4().hex[:10]
    if request.param == "http":
        server, folder = http_root

        def write(relative: str, data: bytes) -> None:
            path = folder / name / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            os.utime(path, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns + 1_000_000))  # a new ETag

        (folder / name).mkdir()
        return f"{server.url}/{name}", write
    import fsspec

    memory = fsspec.filesystem("memory")

    def write(relative: str, data: bytes) -> None:
        memory.pipe_file(f"/{name}/{relative}", data)

    return f"memory://{name}", write


def test_reads_keep_the_store_contract_and_every_write_is_refused(readable, tmp_path):
    root, write = readable
    for name, size in TREE.items():
        write(name, bytes(range(size)))
    data = os.urandom(100_000)
    write("r.bin", data)
    store = open_store(root)
    assert isinstance(store, Store)
    assert store.get_bytes("a/2.bin") == bytes(range(5)) and store.exists("b.bin")
    assert store.get_versioned("r.bin") == (data, store.stat("r.bin").version)
    for start, end in ((0, 1), (5, 5), (99_000, 100_000), (123, 45_678)):
        assert store.get_range("r.bin", start, end) == data[start:end], (start, end)
    old = store.stat("r.bin")
    assert old.size == 100_000 and store.get_range("r.bin", 10, 20, version=old.version) == data[10:20]
    target = tmp_path / "copy"
    assert store.download("r.bin", str(target), part_bytes=30_000, threads=3) == hashlib.sha256(data).hexdigest()
    assert target.read_bytes() == data
    write("r.bin", os.urandom(100_000))  # same size: only the version tells them apart
    with pytest.raises(PreconditionFailed, match="r.bin"):
        store.get_range("r.bin", 10, 20, version=old.version)

    tree = {**TREE, "r.bin": 100_000}
    assert store.walk("") == tree and store.walk("a") == {"a/1.bin": 3, "a/2.bin": 5}
    assert store.list("a") == ["a/1.bin", "a/2.bin"] and store.list_folder("c") == (["deep"], {})
    assert store.list_folder("") == (["a", "c"], {"b.bin": 7, "r.bin": 100_000})

    missing = store.url("gone/obj.bin")
    for call in (lambda: store.get_bytes("gone/obj.bin"), lambda: store.stat("gone/obj.bin"),
                 lambda: store.get_range("gone/obj.bin", 0, 1), lambda: store.download("gone/obj.bin", str(tmp_path / "o"))):
        with pytest.raises(FileNotFoundError, match=missing):
            call()
    assert store.get_versioned("gone/obj.bin") is None and not store.exists("gone/obj.bin")

    scheme = root.split("://")[0]
    local = tmp_path / "local"
    local.write_bytes(b"x")
    for call in (lambda: store.put_bytes("w", b"x"), lambda: store.put_if("lease.json", b"x", None),
                 lambda: store.put_file(str(local), "w"), lambda: store.delete(["b.bin"])):
        with pytest.raises(UsageError, match=rf"{scheme}:// is read through fsspec, which offers no all-or-nothing "
                                             "write and no compare-and-swap"):
            call()
    assert store.get_bytes("b.bin") == bytes(range(7))  # nothing was deleted


def test_a_dead_server_is_retried_to_the_deadline_not_taken_for_a_missing_object(monkeypatch):
    from vitforge.core import free_port

    monkeypatch.setenv("VITFORGE_STORE_DEADLINE_S", "1.5")
    store = open_store(f"http://127.0.0.1:{free_port()}/data")
    with pytest.raises(StorageError, match=r"http://127.0.0.1:\d+/data/x.tar.*(deadline|attempts)"):
        store.stat("x.tar")


def test_a_server_that_ignores_ranges_is_refused_by_name(tmp_path):
    (tmp_path / "s.tar").write_bytes(os.urandom(4096))

    def handler(*args, **kwargs):
        return _Plain(*args, directory=str(tmp_path), **kwargs)

    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        store = open_store(f"http://127.0.0.1:{server.server_address[1]}")
        assert len(store.get_bytes("s.tar")) == 4096  # a whole read works
        with pytest.raises(StorageError, match="does not answer byte ranges"):
            store.get_range("s.tar", 100, 200)
    finally:
        server.shutdown()
        server.server_close()


class _Plain(SimpleHTTPRequestHandler):
    """Python's own file server: no Range support."""

    def log_message(self, *args) -> None:
        pass


def test_a_corpus_shards_from_an_http_folder_and_shards_verify_over_http(http_root, data, tmp_path):
    server, _ = http_root
    base = f"{server.url}/data"
    out = tmp_path / "from-http"
    vitforge("shard", f"{base}/val_src", out, "--prefix", "val", "--workers", "2")
    mine, theirs = (json.loads((folder / "dataset.json").read_text()) for folder in (out, data / "val"))
    assert mine["classes"] == theirs["classes"] and mine["totals"]["samples"] == theirs["totals"]["samples"] == 100
    assert _images(out) == _images(data / "val")  # the same images, under the same labels

    verified = vitforge("shard", "verify", f"{base}/train")
    assert verified.stdout.strip().endswith("400 samples: all good"), verified.stdout
    fetched = [r["path"] for r in server.requests() if r["path"].startswith("/data/train/")]
    assert any(p.endswith(".tar") for p in fetched)


def test_shards_and_checkpoints_are_never_written_through_fsspec(http_root, data):
    server, _ = http_root
    for command in (["shard", data / "val_src", f"{server.url}/data/new", "--workers", "1"],
                    ["train", "tiny_cpu", "--set", f"data.train={data / 'train'}",
                     "--set", f"checkpoint.dir={server.url}/runs"]):
        refused = vitforge(*command, check=False, env=EXTENSIONS)
        assert refused.returncode == errors.USAGE, refused.stderr
        lines = [x for x in refused.stderr.splitlines() if "vitforge:" in x]
        assert len(lines) == 1 and "http:// is read through fsspec" in lines[0] and "compare-and-swap" in lines[0], \
            refused.stderr
        assert "Traceback" not in refused.stderr
    assert not (http_root[1] / "data" / "new").exists()


def _images(folder) -> set[tuple[int, str]]:
    """(label, sha256 of the image bytes) of every sample in a dataset's shards."""
    import tarfile

    found = set()
    for shard in sorted(folder.glob("*.tar")):
        with tarfile.open(shard) as tar:
            members = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
        for name, body in members.items():
            stem, ext = name.rsplit(".", 1)
            if ext in ("jpg", "png", "webp", "jpeg"):
                found.add((int(members[f"{stem}.cls"]), hashlib.sha256(body).hexdigest()))
    return found


@pytest.mark.slow
def test_a_run_from_http_shards_equals_the_run_from_the_same_shards_on_disk(http_root, data, straight, tmp_path):
    server, _ = http_root
    base = f"{server.url}/data"
    logs = tmp_path / "logs"
    train(data, "http", *STRAIGHT, f"data.train={base}/train", f"data.val={base}/val", "train.eval_every=24",
          f"data.cache_dir={tmp_path / 'cache'}", f"checkpoint.log_dir={logs}", store=str(tmp_path / "runs"))
    assert losses(logs) == losses(straight)
    assert_same_weights(weights(str(tmp_path / "runs" / "http")), weights(str(straight)))
    held_out = [json.loads(line) for line in (logs / "metrics.jsonl").read_text().splitlines()]
    from_http = next(m for m in reversed(held_out) if "eval_top1" in m)
    local = vitforge("eval", "tiny_cpu", "--checkpoint", straight, "--set", f"data.val={data / 'val'}",
                     "--set", "data.backend=torch", "--set", "data.workers=0", env=EXTENSIONS)
    from_disk = json.loads(local.stdout.strip().splitlines()[-1])
    assert from_http["eval_samples"] == from_disk["eval_samples"] == 100
    assert from_http["eval_top1"] == from_disk["eval_top1"] and abs(from_http["eval_loss"] - from_disk["eval_loss"]) < 1e-6
    shards = {r["path"] for r in server.requests() if r["path"].startswith("/data/train/") and r["path"].endswith(".tar")}
    assert shards  # the shards came over HTTP
