"""The tar writer (shards/tarfile_writer.py): what it writes reads back with tarfile, member by
member, its headers are tarfile's own, and the DALI index points at each member's data; its background
hashing and writing keep the bytes, the digest and the index those of a plain sequential writer,
across many hand-overs, and a failing file stops it with the file's error."""

from __future__ import annotations

import errno
import hashlib
import io
import tarfile
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vitforge.shards.tarfile_writer import BATCH_BYTES, FIXED_MTIME, TarShardWriter, _header, index_path_for

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


def sequential_tar(samples: list[dict]) -> bytes:
    """The archive written the plain way: header, data, padding per member, then the end blocks."""
    out = bytearray()
    for sample in samples:
        for ext, data in sample.items():
            if ext != "__key__":
                out += _header(f"{sample['__key__']}.{ext}", len(data)) + data + bytes(-len(data) % 512)
    out += bytes(1024)
    return bytes(out + bytes(-len(out) % 10240))


def test_many_batches_give_the_sequential_bytes_digest_and_offsets(tmp_path):
    # 40 samples of 97 KiB to 1.3 MiB: several batches per hand-over, members larger than a batch.
    samples = [{"__key__": f"s{i:03d}", "jpg": bytes([i]) * (97 * 1024 + i * 31 * 1024), "cls": str(i).encode()}
               for i in range(40)]
    assert sum(len(s["jpg"]) for s in samples) > 8 * BATCH_BYTES
    path = tmp_path / "a.tar"
    with open(path, "wb") as out, TarShardWriter(out) as writer:
        for sample in samples:
            writer.write(sample)
        writer.close()
    data = path.read_bytes()
    assert data == sequential_tar(samples)
    assert writer.sha256 == hashlib.sha256(data).hexdigest() and writer.offset == len(data)
    with tarfile.open(path) as tar:
        members = list(tar)
    assert [(m.name, m.size) for m in members] == [
        (f"{s['__key__']}.{ext}", len(s[ext])) for s in samples for ext in ("jpg", "cls")]
    offsets = {m.name: m.offset_data for m in members}
    for line, sample in zip(writer.dali_index().decode().splitlines()[1:], samples):
        fields = line.split(" ")
        assert int(fields[1]) == offsets[f"{sample['__key__']}.jpg"]
        assert data[int(fields[1]):int(fields[1]) + int(fields[2])] == sample["jpg"]
    assert not any(t.name == "tar-writer" for t in threading.enumerate())


class FullDisk(io.RawIOBase):
    """A file that takes `room` bytes, then fails as a full disk does."""

    def __init__(self, room: int):
        self.room = room

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= len(data)
        return len(data)


def test_a_full_disk_stops_the_writer_with_the_files_error_and_no_thread_left():
    writer = TarShardWriter(FullDisk(3 * BATCH_BYTES))
    with pytest.raises(OSError, match="No space left") as caught:
        with writer:
            for i in range(200):  # 20 MB: far past the room, so a write() or close() must fail
                writer.write({"__key__": f"k{i}", "jpg": bytes(100_000)})
            writer.close()
    assert caught.value.errno == errno.ENOSPC
    assert not any(t.name == "tar-writer" for t in threading.enumerate())
