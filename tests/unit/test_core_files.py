"""core.files: writes whose folder is removed under them (by a store's delete, or by the sharding
task that finished first tidying the shared work folder) make it again instead of failing. Each
interleaving is forced here, one at a time; test_store_contract.py races a real remover."""

from __future__ import annotations

import errno
import os

import pytest

from vitforge.core import atomic_write, create_file, files
from vitforge.core.files import make_folder, replace_into


def test_a_file_is_created_in_a_folder_removed_before_it_with_its_parent(tmp_path):
    path = tmp_path / "work" / "tmp" / "a.partial"
    with create_file(str(path)) as f:  # neither folder exists: both are made
        f.write(b"x")
    assert path.read_bytes() == b"x"


def test_a_rename_into_a_removed_folder_makes_it_and_a_missing_source_still_fails(tmp_path):
    (tmp_path / "src").write_bytes(b"y")
    replace_into(str(tmp_path / "src"), str(tmp_path / "d" / "e" / "f.bin"))
    assert (tmp_path / "d" / "e" / "f.bin").read_bytes() == b"y"
    with pytest.raises(FileNotFoundError):
        replace_into(str(tmp_path / "src"), str(tmp_path / "g.bin"))  # gone: never retried as a folder


def test_makedirs_raising_file_exists_as_the_folder_goes_is_retried(tmp_path, monkeypatch):
    real, calls = os.makedirs, []

    def vanishing(path, exist_ok=False):  # what makedirs raises when the folder goes between its checks
        calls.append(path)
        if len(calls) == 1:
            raise FileExistsError(errno.EEXIST, "File exists", path)
        real(path, exist_ok=exist_ok)

    monkeypatch.setattr(os, "makedirs", vanishing)
    make_folder(str(tmp_path / "w"))
    assert len(calls) == 2 and (tmp_path / "w").is_dir()
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(FileExistsError):  # a file in the way is no race: it fails after the tries
        make_folder(str(tmp_path / "file"))


def test_a_stale_nfs_handle_is_a_folder_gone_too(tmp_path, monkeypatch):
    # Another node removed the folder: NFS answers ESTALE, not ENOENT.
    real, seen = open, []

    def stale_once(path, *args, **kwargs):
        if not seen:
            seen.append(path)
            raise OSError(errno.ESTALE, "Stale file handle", path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(files, "open", stale_once, raising=False)
    atomic_write(str(tmp_path / "a.bin"), b"z", str(tmp_path / "t" / "a.tmp"))
    assert (tmp_path / "a.bin").read_bytes() == b"z" and seen == [str(tmp_path / "t" / "a.tmp")]
    monkeypatch.setattr(files, "open", lambda *a, **k: (_ for _ in ()).throw(PermissionError(errno.EACCES, "no")),
                        raising=False)
    with pytest.raises(PermissionError):  # any other error is the writer's to see, at once
        create_file(str(tmp_path / "b.bin"))
