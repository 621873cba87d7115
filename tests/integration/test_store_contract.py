"""One suite for the Store contract (core/store.py), run against every implementation: a local
folder, S3 (SeaweedFS), GCS (fake-gcs-server) and Azure Blob (Azurite), each on 127.0.0.1.

Each backend param gets a fresh, empty store root from `backend`; the emulators' session fixtures
(`s3_server`, `gcs_server`, `azure_server` in conftest.py) are looked up by name, so a backend whose
fixture is missing fails here with pytest's missing-fixture error rather than being skipped.
Where an emulator cannot show a guarantee, the case says so and keeps it for the real cloud."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import threading
import uuid
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint
from typing import Callable

import pytest

from common.checks import SECRET
from common.faulty_proxy import FaultSchedule, start_proxy
from vitforge.core import (PARTIAL_MARK, PreconditionFailed, StorageError, Store, UsageError, object_store,
                           open_store, register_store, store_schemes)
from vitforge.core import store as store_module

BACKENDS = ["local", "s3", "gcs", "azure"]
SCHEMES = {"s3": "s3", "gcs": "gs", "azure": "az"}
# The knobs that make put_file upload in several parts at test size (module of the backend: values).
SMALL_PARTS = {"s3": ("vitforge.core.store_s3", {"UPLOAD_PART_BYTES": 5 << 20}),  # S3's least part
               "gcs": ("vitforge.core.store_gcs", {"UPLOAD_CHUNK_BYTES": 1 << 20}),  # a multiple of 256 KiB
               "azure": ("vitforge.core.store_azure", {"SINGLE_PUT_BYTES": 1 << 20, "BLOCK_BYTES": 1 << 20})}
MULTI_PART_BYTES = 11 << 20  # three S3 parts, a dozen GCS chunks or Azure blocks


@dataclass
class Backend:
    name: str
    root: str  # a fresh, empty store root URL (or folder)
    env: dict = field(default_factory=dict)  # the client environment pointing at the emulator
    server: dict = field(default_factory=dict)  # the emulator's session fixture

    def open(self) -> Store:
        return open_store(self.root)

    def secrets(self) -> list[str]:
        """Every credential in the environment: none may appear in an error."""
        words = ("SECRET", "KEY", "CONNECTION_STRING", "TOKEN", "PASSWORD")
        return [v for k, v in self.env.items() if any(w in k for w in words) and len(v) >= 8]


@pytest.fixture(params=BACKENDS)
def backend(request, tmp_path, monkeypatch) -> Backend:
    name = request.param
    if name == "local":
        return Backend(name, str(tmp_path / "store"))
    server = request.getfixturevalue(f"{name}_server")
    env = dict(server["env"])
    if name == "s3":
        env["AWS_SECRET_ACCESS_KEY"] = SECRET  # the test server takes any key: any secret leaked is this one
        bucket = "ct-" + uuid.uuid4().hex[:12]
        server["client"].create_bucket(Bucket=bucket)
    else:
        bucket = server["make_bucket"]()
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return Backend(name, f"{SCHEMES[name]}://{bucket}/root", env, server)


def test_bytes_round_trip_and_overwrite(backend):
    store = backend.open()
    assert isinstance(store, Store)
    store.put_bytes("a/b.bin", b"first")
    assert store.get_bytes("a/b.bin") == b"first" and store.exists("a/b.bin")
    store.put_bytes("a/b.bin", b"second, longer")
    assert store.get_bytes("a/b.bin") == b"second, longer"
    assert store.get_versioned("a/b.bin")[0] == b"second, longer"
    store.put_bytes("empty", b"")
    assert store.get_bytes("empty") == b""


def test_one_object_by_its_url(backend):
    """What the sharder reads a corpus's images and manifests through: `object_store(url)`."""
    store = backend.open()
    store.put_bytes("o/x.bin", b"abc")
    other, name = object_store(store.url("o/x.bin"))
    assert other.get_bytes(name) == b"abc" and other.url(name) == store.url("o/x.bin")
    if backend.name != "local":  # a URL naming a bucket is a bad input, not a failed store
        with pytest.raises(IsADirectoryError):
            object_store(backend.root.rsplit("/", 1)[0] + "/")


def test_put_file_in_parts_is_all_or_nothing_to_a_reader(backend, tmp_path, monkeypatch):
    if backend.name in SMALL_PARTS:
        module, knobs = SMALL_PARTS[backend.name]
        for knob, value in knobs.items():
            monkeypatch.setattr(module + "." + knob, value)
    store = backend.open()
    data = os.urandom(MULTI_PART_BYTES + 1)
    local = tmp_path / "big.bin"
    local.write_bytes(data)
    store.put_bytes("big.bin", b"old")
    seen, failed = set(), []

    def upload():
        try:
            store.put_file(str(local), "big.bin", keep=True)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            failed.append(e)

    writer = threading.Thread(target=upload)
    writer.start()
    while writer.is_alive():  # a reader during the upload sees the old object or the whole new one
        seen.add(hashlib.sha256(store.get_bytes("big.bin")).hexdigest())
    writer.join()
    assert not failed, failed
    assert store.get_bytes("big.bin") == data and local.exists()  # keep=True: the local file stays
    assert seen <= {hashlib.sha256(b"old").hexdigest(), hashlib.sha256(data).hexdigest()}
    store.put_file(str(local), "moved.bin")
    assert not local.exists() and store.stat("moved.bin").size == len(data)


def test_conditional_create_happens_once(backend):
    store = backend.open()
    version = store.put_if("lease", b"mine", None)
    assert version and store.get_versioned("lease") == (b"mine", store.get_versioned("lease")[1])
    # Azurite answers 409 here, S3 and GCS 412: the implementation turns each into PreconditionFailed.
    with pytest.raises(PreconditionFailed, match="lease"):
        store.put_if("lease", b"theirs", None)
    assert store.get_bytes("lease") == b"mine"
    newer = store.put_if("lease", b"renewed", version)
    with pytest.raises(PreconditionFailed):
        store.put_if("lease", b"stale", version)  # the old version no longer matches
    assert store.get_bytes("lease") == b"renewed" and newer != version


def test_compare_and_swap_loses_no_update_between_two_racing_writers(backend):
    store = backend.open()
    store.put_if("counter", b"0", None)
    each, conflicts, errors = 12, [0, 0], []

    def writer(me: int):
        try:
            for _ in range(each):
                while True:
                    data, version = store.get_versioned("counter")
                    try:
                        store.put_if("counter", str(int(data) + 1).encode(), version)
                        break
                    except PreconditionFailed:
                        conflicts[me] += 1
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert int(store.get_bytes("counter")) == 2 * each  # every increment landed once


def test_ranged_reads_are_exact_and_a_pinned_one_refuses_a_replaced_object(backend):
    store = backend.open()
    data = os.urandom(100_000)
    store.put_bytes("r.bin", data)
    for start, end in [(0, 1), (0, 10), (4_096, 70_001), (99_999, 100_000), (0, 100_000), (5, 5)]:
        assert store.get_range("r.bin", start, end) == data[start:end], (start, end)  # (5, 5): an empty tar member
    old = store.stat("r.bin").version
    assert store.get_range("r.bin", 10, 20, version=old) == data[10:20]
    store.put_bytes("r.bin", os.urandom(100_000))  # same size: only the version tells them apart
    with pytest.raises(PreconditionFailed, match="r.bin"):
        store.get_range("r.bin", 10, 20, version=old)


def test_download_hashes_what_it_wrote(backend, tmp_path):
    store = backend.open()
    data = os.urandom(3 << 20 | 123)
    store.put_bytes("d/x.bin", data)
    target = tmp_path / "x.bin"
    digest = store.download("d/x.bin", str(target), part_bytes=1 << 20, threads=3)
    assert digest == hashlib.sha256(data).hexdigest() and target.read_bytes() == data
    head = tmp_path / "head.bin"
    digest = store.download("d/x.bin", str(head), part_bytes=1 << 20, threads=3, length=(1 << 20) + 5)
    assert digest == hashlib.sha256(data[:(1 << 20) + 5]).hexdigest() and head.read_bytes() == data[:(1 << 20) + 5]
    copy = store.local_copy("d/x.bin", str(tmp_path))
    assert open(copy, "rb").read() == data


def test_listings_are_sorted_per_folder_and_never_show_a_writers_temporary(backend):
    store = backend.open()
    tree = {"a/1.bin": 1, "a/2.bin": 2, "a/sub/3.bin": 3, "b.bin": 4, "c/deep/er/5.bin": 5}
    for name, size in tree.items():
        store.put_bytes(name, b"x" * size)
    assert store.list("a") == ["a/1.bin", "a/2.bin"]  # objects directly in the folder, sorted
    assert store.list("") == ["b.bin"] and store.list("nothing") == []
    folders, objects = store.list_folder("")
    # A local store's root also holds its work folder: its writes are renamed into place from there.
    work = {"_work"} if backend.name == "local" else set()
    assert sorted(set(folders) - work) == ["a", "c"] and objects == {"b.bin": 4}
    folders, objects = store.list_folder("a")
    assert folders == ["sub"] and objects == {"1.bin": 1, "2.bin": 2}
    assert store.list_folder("c") == (["deep"], {})
    assert store.walk("") == tree
    assert store.walk("a") == {k: v for k, v in tree.items() if k.startswith("a/")}
    # A writer's temporary (local: inside the store; object stores: on local disk) is never listed.
    temporary = store.temp_path("a/4.bin")
    with open(temporary, "wb") as f:
        f.write(b"half")
    try:
        assert PARTIAL_MARK in temporary
        assert store.list("a") == ["a/1.bin", "a/2.bin"] and store.walk("") == tree
        assert not store.exists("a/4.bin")
    finally:
        os.unlink(temporary)


def test_stat_gives_each_write_a_new_version_and_delete_ignores_absent_names(backend):
    store = backend.open()
    store.put_bytes("s/one", b"12345")
    store.put_bytes("s/two", b"x")
    info = store.stat("s/one")
    assert info.size == 5 and info.version
    store.put_bytes("s/one", b"54321")  # same size, new bytes
    assert store.stat("s/one").size == 5 and store.stat("s/one").version != info.version
    store.delete(["s/one", "s/never-was"])  # an absent name is not an error
    store.delete([])
    assert not store.exists("s/one") and store.exists("s/two") and store.list("s") == ["s/two"]


def test_a_missing_object_is_file_not_found_naming_its_url(backend, tmp_path):
    store = backend.open()
    store.put_bytes("here", b"x")  # the bucket (or folder) exists: only the object is missing
    url = store.url("gone/obj.bin")
    for call in (lambda: store.get_bytes("gone/obj.bin"), lambda: store.stat("gone/obj.bin"),
                 lambda: store.get_range("gone/obj.bin", 0, 1),
                 lambda: store.download("gone/obj.bin", str(tmp_path / "o"))):
        with pytest.raises(FileNotFoundError) as caught:
            call()
        assert url in str(caught.value)
    assert store.get_versioned("gone/obj.bin") is None and not store.exists("gone/obj.bin")


def _one_clear_line(error: BaseException, backend: Backend, names: str) -> str:
    text = str(error)
    assert "\n" not in text and "Traceback" not in text, text
    assert names in text, text
    assert not any(secret in text for secret in backend.secrets() + [SECRET]), "a credential is in the error"
    return text


def test_a_missing_bucket_is_one_clear_storage_error(backend, tmp_path):
    if backend.name == "local":
        (tmp_path / "a-file").write_bytes(b"")
        root = str(tmp_path / "a-file" / "store")  # a folder that cannot exist
    else:
        root = f"{SCHEMES[backend.name]}://nobucket-{uuid.uuid4().hex[:10]}/root"
    store = open_store(root)
    for call in (lambda: store.put_bytes("x.bin", b"x"), lambda: store.get_bytes("x.bin")):
        with pytest.raises(StorageError) as caught:
            call()
        _one_clear_line(caught.value, backend, store.url("x.bin"))


def _no_aws_credentials(backend: Backend, tmp_path, monkeypatch) -> dict:
    # SeaweedFS, as the tests run it, takes any key and secret: what the S3 client refuses is a
    # request without credentials (a real bucket refuses a wrong secret through the same path).
    # boto3 resolves credentials once per process (its default session): a new one sees the change.
    monkeypatch.setattr("boto3.DEFAULT_SESSION", None)
    return {"AWS_ACCESS_KEY_ID": None, "AWS_SECRET_ACCESS_KEY": None, "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
            "AWS_CONFIG_FILE": "/nonexistent", "AWS_PROFILE": None}


def _unusable_gcs_key(backend: Backend, tmp_path, monkeypatch) -> dict:
    # fake-gcs-server takes anonymous requests: the case shown is a service-account key file that
    # the credential chain cannot use (off the emulator, so the chain reads it).
    key = tmp_path / "key.json"
    key.write_text('{"type": "service_account", "client_email": "x@y.iam.gserviceaccount.com", '
                   f'"private_key": "{SECRET}", "token_uri": "http://127.0.0.1:9/token"}}')
    return {"STORAGE_EMULATOR_HOST": None, "GOOGLE_APPLICATION_CREDENTIALS": str(key)}


def _wrong_azure_key(backend: Backend, tmp_path, monkeypatch) -> dict:
    import base64

    wrong = base64.b64encode(SECRET.encode()).decode()
    parts = [f"AccountKey={wrong}" if p.startswith("AccountKey=") else p
             for p in backend.env["AZURE_STORAGE_CONNECTION_STRING"].split(";")]
    return {"AZURE_STORAGE_CONNECTION_STRING": ";".join(parts)}


# How each backend's standard credential chain is handed credentials it must refuse: variables to
# set (None: unset).
WRONG_CREDENTIALS = {"s3": _no_aws_credentials, "gcs": _unusable_gcs_key, "azure": _wrong_azure_key}


def test_wrong_credentials_give_one_clear_line_without_the_secret(backend, tmp_path, monkeypatch):
    if backend.name == "local":
        pytest.skip("no credentials for a local folder")
    for key, value in WRONG_CREDENTIALS[backend.name](backend, tmp_path, monkeypatch).items():
        if value is None:
            monkeypatch.delenv(key, raising=False)
        else:
            monkeypatch.setenv(key, value)
    store = backend.open()
    with pytest.raises(StorageError) as caught:
        store.get_bytes("x.bin")
    _one_clear_line(caught.value, backend, store.url("x.bin"))


def _cut_s3_transfers(backend: Backend, monkeypatch) -> tuple[FaultSchedule, Callable[[], None]]:
    """Requests through a proxy that cuts every third answer's body mid-way and resets every fifth
    connection before it answers."""
    schedule = FaultSchedule(slow_down_every=0, reset_every=5, cut_body_every=3)
    proxy, port = start_proxy(int(backend.server["endpoint"].rsplit(":", 1)[1]), schedule)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setattr("vitforge.core.store_s3.UPLOAD_PART_BYTES", 5 << 20)
    return schedule, proxy.shutdown


def _cut_gcs_transfers(backend: Backend, monkeypatch) -> tuple[FaultSchedule, Callable[[], None]]:
    """The same proxy in front of fake-gcs-server, 1 MiB resumable upload requests (the emulator
    hands out session URLs on the host it was asked on, so every part goes through the proxy too).
    Only downloads' answers are cut: fake-gcs-server appends a part sent again after it was stored,
    where GCS places it at its Content-Range offset (a part whose answer was lost is sent again);
    connections reset before an answer (the part never reached the emulator) still cut uploads."""
    schedule = FaultSchedule(slow_down_every=0, reset_every=5, cut_body_every=3, cut_only=("GET",))
    proxy, port = start_proxy(int(backend.env["STORAGE_EMULATOR_HOST"].rsplit(":", 1)[1]), schedule)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{port}")
    monkeypatch.setattr("vitforge.core.store_gcs.UPLOAD_CHUNK_BYTES", 1 << 20)
    return schedule, proxy.shutdown


def _cut_azure_transfers(backend: Backend, monkeypatch) -> tuple[FaultSchedule, Callable[[], None]]:
    """The same proxy in front of Azurite, 1 MiB staged blocks: block uploads, the commit and the
    ranged reads all go through it (Azure's answers to uploads have no body, so only reads are cut)."""
    schedule = FaultSchedule(slow_down_every=0, reset_every=5, cut_body_every=3)
    endpoint = backend.server["server"].endpoint  # http://127.0.0.1:PORT/devstoreaccount1
    proxy, port = start_proxy(int(endpoint.split(":")[2].split("/")[0]), schedule)
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", backend.env["AZURE_STORAGE_CONNECTION_STRING"].replace(
        endpoint, f"http://127.0.0.1:{port}/devstoreaccount1"))
    monkeypatch.setattr("vitforge.core.store_azure.BLOCK_BYTES", 1 << 20)
    monkeypatch.setattr("vitforge.core.store_azure.SINGLE_PUT_BYTES", 1 << 20)
    return schedule, proxy.shutdown


# The hook for each object store's cut-transfer case: (backend, monkeypatch) -> (schedule whose
# `injected` counts the cuts, stop). A backend without an entry fails the case, never skips it.
CUT_TRANSFERS = {"s3": _cut_s3_transfers, "gcs": _cut_gcs_transfers, "azure": _cut_azure_transfers}


@pytest.mark.slow
def test_a_transfer_cut_mid_way_is_retried(backend, tmp_path, monkeypatch):
    store = backend.open()
    data = os.urandom(11 << 20)
    if backend.name == "local":
        # A local writer cut short leaves a temporary under its host and pid: invisible, removed by
        # the next writer once that pid is gone, and the retried write lands whole.
        temporary = store.temp_path("big.bin").rsplit("-", 1)[0] + f"-{_dead_pid()}"
        with open(temporary, "wb") as f:
            f.write(data[:1000])
        assert store.list("") == [] and store.abort_uploads("") == 1 and not os.path.exists(temporary)
        store.put_bytes("big.bin", data)
        assert store.get_bytes("big.bin") == data
        return
    if backend.name not in CUT_TRANSFERS:
        pytest.fail(f"no cut-transfer case for {backend.name} yet: add one to CUT_TRANSFERS")
    schedule, stop = CUT_TRANSFERS[backend.name](backend, monkeypatch)
    try:
        store = backend.open()  # a client for the faulty endpoint
        local = tmp_path / "big.bin"
        local.write_bytes(data)
        store.put_file(str(local), "big.bin", keep=True)
        assert store.get_bytes("big.bin") == data
        assert store.download("big.bin", str(tmp_path / "back.bin"), part_bytes=1 << 20,
                               threads=4) == hashlib.sha256(data).hexdigest()
        assert store.get_range("big.bin", 5, 6_000_000) == data[5:6_000_000]
    finally:
        stop()
    assert schedule.injected["cut_body"] >= 2 and schedule.injected["reset"] >= 2, schedule.injected


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


@pytest.fixture
def schemes(monkeypatch):
    """The registry as it stands, restored after the test."""
    monkeypatch.setattr(store_module, "_openers", dict(store_module._openers))
    monkeypatch.setattr(store_module, "_entry_points_loaded", False)


def _folder_opener(url: str, work_dir: str):
    """A user's scheme, `mine://path`: a local folder under another name."""
    return open_store(url.split("://", 1)[1], work_dir)


def test_a_user_scheme_registers_by_call_and_by_entry_point(schemes, tmp_path, monkeypatch):
    register_store("mine", _folder_opener)
    store = open_store(f"mine://{tmp_path}/one")
    store.put_bytes("x", b"1")
    assert (tmp_path / "one" / "x").read_bytes() == b"1"
    with pytest.raises(UsageError, match="already registered"):
        register_store("mine", _folder_opener)
    register_store("mine", f"{__name__}:_folder_opener", clobber=True)  # "module:name", imported on use
    assert open_store(f"mine://{tmp_path}/one").get_bytes("x") == b"1"

    # An installed package's entry point, as importlib.metadata reports it.
    point = EntryPoint("theirs", f"{__name__}:_folder_opener", store_module.ENTRY_POINT_GROUP)
    groups = []
    monkeypatch.setattr(store_module, "entry_points", lambda group: groups.append(group) or [point])
    assert "theirs" in store_schemes() and groups == [store_module.ENTRY_POINT_GROUP]
    open_store(f"theirs://{tmp_path}/two").put_bytes("y", b"2")
    assert (tmp_path / "two" / "y").read_bytes() == b"2"


def test_an_unknown_scheme_lists_the_known_ones(schemes, monkeypatch):
    monkeypatch.setattr(store_module, "entry_points", lambda group: [])
    with pytest.raises(UsageError) as caught:
        open_store("nosuch://bucket/x")
    text = str(caught.value)
    assert "nosuch://" in text and all(f"{s}://" in text for s in ("file", "s3", "gs", "az", "abfs"))
    assert store_module.ENTRY_POINT_GROUP in text


def test_a_local_folder_removed_under_a_writer_costs_a_retry_not_the_write(tmp_path):
    # Local only: an object store has no folders to lose. A local one loses two kinds: a folder
    # its delete emptied (as object stores have none, it removes them), and the shared work folder
    # that the first sharding task to finish removes while the others still write through it. Here
    # another process removes both whenever they are empty, about 5,000 times a second, while
    # this one writes every way a store writes. Before the writers made their folders again, this
    # failed within seconds ("No such file or directory", or makedirs' own "File exists").
    store = open_store(str(tmp_path / "store"))
    work = os.path.dirname(store.temp_path("x"))
    remover = subprocess.Popen([sys.executable, "-c", f"""
import os, signal, sys, time
removed = 0
signal.signal(signal.SIGTERM, lambda *_: (print(removed, flush=True), sys.exit(0)))
print("ready", flush=True)
while True:
    for folder in ({work!r}, {store.url("d")!r}):
        try:
            os.rmdir(folder)
            removed += 1
        except OSError:
            pass
    time.sleep(0.0002)
"""], stdout=subprocess.PIPE, text=True)
    assert remover.stdout.readline() == "ready\n"
    try:
        local = tmp_path / "local.bin"
        for i in range(1500):
            data = f"{i}".encode()
            name = f"d/{i % 3}.bin"
            if i % 3 == 0:
                store.put_bytes(name, data)
            elif i % 3 == 1:
                local.write_bytes(data)
                store.put_file(str(local), name, keep=i % 2 == 0)
            else:
                current = store.get_versioned(name)
                store.put_if(name, data, current[1] if current else None)
            assert store.get_bytes(name) == data
            store.delete([name, f"{name}.lock"])  # the folder goes once it is empty
            store.discard_stale_temporaries(set())
    finally:
        remover.terminate()
        removed = int(remover.communicate(timeout=30)[0])
    assert removed > 300  # the folders really went while the writes ran (2,792 in a run here)
    assert store.list("d") == [] and not os.path.exists(store.url("d"))
    # Only emptied folders inside go: never the root, nor the folders that hold it.
    inner = open_store(str(tmp_path / "outer" / "inner"))
    inner.put_bytes("a/b.bin", b"x")
    shutil.rmtree(os.path.dirname(os.path.dirname(inner.temp_path("x"))))  # the work folder: the root is a/ only
    inner.delete(["a/b.bin"])
    assert os.listdir(inner.url("")) == [] and os.path.isdir(tmp_path / "outer")
    # A write that fails for another cause fails at once, in one line naming the object.
    inner.put_bytes("f", b"")
    with pytest.raises(StorageError, match="inner/f/x: Not a directory") as refused:
        inner.put_if("f/x", b"", None)
    assert not isinstance(refused.value, PreconditionFailed)
