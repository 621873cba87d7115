"""The tar writer's background hashing and writing: the bytes, the digest and the index stay those of a
plain sequential writer, across many hand-overs, and a failing file stops it with the file's error."""

from __future__ import annotations

import errno
import hashlib
import io
import tarfile
import threading

import pytest

from vitforge.shards.tarfile_writer import BATCH_BYTES, TarShardWriter, _header


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
