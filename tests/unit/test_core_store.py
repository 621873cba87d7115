"""The store's helpers (core/store.py): the stale temporaries of a work folder already removed are
none, not an error."""

from __future__ import annotations

from vitforge.core.store import discard_stale


def test_stale_temporaries_of_a_removed_work_folder_are_none(tmp_path):
    assert discard_stale(str(tmp_path / "gone"), {"shard-000000.tar"}) == 0
