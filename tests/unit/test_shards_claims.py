"""Claims on a shared store (shards/claims.py): a task judged dead while it made the plan leaves the
claim of the task that took over, and deletes its own once its work is made."""

from __future__ import annotations

import json

from vitforge.core import open_store
from vitforge.shards.claims import _make_claimed
from vitforge.shards.layout import FIRST


def test_a_planner_thought_dead_leaves_the_claim_of_the_task_that_took_over(tmp_path):
    store = open_store(str(tmp_path / "out"))
    mine = store.put_if(FIRST.claim, json.dumps({"part": 0, "host": "node-1", "pid": 1, "beat": 0}).encode(), None)
    # While this task plans, another judges it dead (no renewal seen in time) and takes the claim over.
    theirs = json.dumps({"part": 1, "host": "node-2", "pid": 1, "beat": 0}).encode()
    store.put_if(FIRST.claim, theirs, mine)
    made = _make_claimed(store, FIRST.claim, mine, lambda: None, lambda: "the plan", 0)
    # The claim stays the other task's (it deletes it when its own plan is written), not this one's to delete.
    assert made == "the plan" and store.get_versioned(FIRST.claim)[0] == theirs
    # A claim still this task's is deleted once its work is made, lock file and all.
    store.delete([FIRST.claim, f"{FIRST.claim}.lock"])
    mine = store.put_if(FIRST.claim, json.dumps({"part": 0, "host": "node-1", "pid": 1, "beat": 0}).encode(), None)
    _make_claimed(store, FIRST.claim, mine, lambda: None, lambda: "the plan", 0)
    assert store.get_versioned(FIRST.claim) is None
